"""The server's pieces in process, without HTTP: request parsing, text deltas, the engine loop.

The engine loop is the only thread that touches the engine; these tests check that, that a
step that raises fails only its requests (blocks freed, invariants kept, later requests served),
that admission stops at the waiting-queue limit, and that text deltas never leak a stop string.
"""
from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace
from typing import Literal, Optional  # noqa: F401 - the annotations of a test's EngineConfig subclass

import pytest

pytest.importorskip("pydantic")

from minipaged.server import protocol as P  # noqa: E402
from minipaged.server.engine_loop import EngineLoop, text_delta  # noqa: E402


# -- parsing -------------------------------------------------------------------------------
def test_parse_is_strict_about_types_and_names():
    ok = P.parse_request("completion", {"prompt": "hi", "max_tokens": 3, "temperature": 0, "stop": "x"})
    assert ok.max_tokens == 3 and ok.temperature == 0.0
    for body, needle in [
        ({"prompt": "hi", "max_tokens": "3"}, "max_tokens"),
        ({"prompt": "hi", "max_tokens": True}, "max_tokens"),
        ({"prompt": "hi", "seed": 1.5}, "seed"),
        ({"prompt": "hi", "temperature": float("inf")}, "temperature"),
        ({"prompt": "hi", "temperature": 1e-45}, "use 0 for the most likely token"),
        ({"prompt": "hi", "temperature": 3}, "temperature"),
        ({"prompt": "hi", "seed": 2**70}, "seed"),
        ({"prompt": "hi", "seed": -1}, "seed"),
        ({"prompt": "hi", "n": 0}, "n"),
        ({"prompt": "hi", "stop": ["x"] * 17}, "at most 16"),
        ({"prompt": "hi", "stream": 1}, "stream"),
        ({"prompt": [1, "a"]}, "prompt: must be a string, a list of token ids"),
        ({"prompt": [[1, 2], "text"]}, "prompt: must be"),
        ({"prompt": [[1, 2], []]}, "empty"),
        ({"messages": [{"role": "user", "content": "x"}]}, "messages"),
    ]:
        with pytest.raises(P.APIError) as e:  # the schema's checks, then SamplingParams' own
            P.sampling_params_of(P.parse_request("completion", body), 16)
        assert e.value.status == 400 and needle in e.value.message, (body, e.value.message)
    # unknown fields are ignored, as vLLM ignores them (test_vllm_compat.py checks they are logged once)
    assert P.parse_request("completion", {"prompt": "hi", "temprature": 0}).temperature is None
    with pytest.raises(P.APIError, match="tool parser"):
        P.parse_request("chat", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]})
    # a field at its "not used" value is fine: clients send them by default
    P.parse_request("chat", {"messages": [{"role": "user", "content": "x"}], "tools": [], "tool_choice": "none"})


def test_prompts_and_params():
    chat = P.parse_request("chat", {"messages": [{"role": "developer", "content": [{"type": "text", "text": "be brief"}]},
                                                 {"role": "user", "content": "hi"}], "max_completion_tokens": 5})
    assert P.prompts_of(chat) == [[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]]
    assert P.sampling_params_of(chat, 100).max_tokens == 5
    comp = P.parse_request("completion", {"prompt": [[1, 2], [3]], "stop": ["a", "b"], "temperature": 0})
    assert P.prompts_of(comp) == [[1, 2], [3]]
    sp = P.sampling_params_of(comp, 16)
    assert sp.max_tokens == 16 and sp.stop == ["a", "b"] and sp.temperature == 0
    both = P.parse_request("chat", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "max_completion_tokens": 3})
    with pytest.raises(P.APIError, match="not both"):
        P.sampling_params_of(both, 10)


def test_text_delta_holds_back_stop_string_starts_and_partial_characters():
    def out(text, finished=False):
        return SimpleNamespace(text=text, finished=finished)

    shown = ""
    stream = [out("Hello"), out("Hello E"), out("Hello EN"), out("Hello caf\ufffd"), out("Hello café", True)]
    pieces = []
    for o in stream:
        d = text_delta(shown, o, ["END"])
        pieces.append(d)
        shown += d
    assert pieces == ["Hello", " ", "", "caf", "é"], pieces  # "E", "EN" held back; then they were not the stop
    assert shown == "Hello café"
    # the stop string itself: the engine cut it from the final text, nothing of it was shown
    shown, pieces = "", []
    for o in [out("ab"), out("abE"), out("abEN"), out("ab", True)]:
        d = text_delta(shown, o, ["END"])
        pieces.append(d)
        shown += d
    assert shown == "ab" and "E" not in "".join(pieces)
    # an engine that gives delta_text is taken at its word
    assert text_delta("x", SimpleNamespace(text="ignored", finished=False, delta_text="yz"), []) == "yz"


# -- the engine loop, in process -----------------------------------------------------------
class ThreadRecordingEngine:
    """Wraps an engine; records which thread calls it, and can make chosen steps raise."""

    def __init__(self, engine, fail_steps=()):
        self._engine, self._fail = engine, set(fail_steps)
        self.threads: set[int] = set()
        self.steps = 0

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def add_request(self, *a, **k):
        self.threads.add(threading.get_ident())
        return self._engine.add_request(*a, **k)

    def abort_request(self, rid):
        self.threads.add(threading.get_ident())
        return self._engine.abort_request(rid)

    def step(self):
        self.threads.add(threading.get_ident())
        self.steps += 1
        if self.steps in self._fail:
            raise RuntimeError(f"planted failure in step {self.steps}")
        return self._engine.step()


def _engine(tiny_model, **kw):
    from minipaged.engine import LLMEngine

    model, tok = tiny_model
    kw.setdefault("attention", "torch")
    return LLMEngine(model, tok, record_trace=False, **kw)


async def _run(loop_: EngineLoop, jobs: list[tuple[str, object, object]]) -> dict[str, list]:
    aio = asyncio.get_running_loop()
    q: asyncio.Queue = asyncio.Queue()
    for rid, prompt, params in jobs:
        loop_.submit(rid, prompt, params, q, aio)
    events: dict[str, list] = {rid: [] for rid, _, _ in jobs}
    open_ = set(events)
    while open_:
        ev = await asyncio.wait_for(q.get(), 60)
        events[ev.request_id].append(ev)
        if ev.kind == "error" or ev.output.finished:
            open_.discard(ev.request_id)
    return events


def test_loop_serves_like_the_engine_and_only_its_thread_touches_it(tiny_model):
    from minipaged import SamplingParams

    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13], [20] * 17]
    direct = _engine(tiny_model)
    ids = [direct.add_request(p, params) for p in prompts]
    done = direct.run()
    want = [done[i].token_ids for i in ids]

    box = {}
    loop_ = EngineLoop(lambda: box.setdefault("e", ThreadRecordingEngine(_engine(tiny_model)))).start()
    try:
        events = asyncio.run(_run(loop_, [(f"r{i}", p, params) for i, p in enumerate(prompts)]))
        got = [events[f"r{i}"][-1].output.token_ids for i in range(len(prompts))]
        assert got == want
        assert all(ev.kind == "token" for evs in events.values() for ev in evs)
        eng = box["e"]
        assert eng.threads == {loop_._thread.ident} and loop_._thread.ident != threading.get_ident()
        assert loop_.call(lambda e: len(e.requests)) == 0, "finished requests were not pruned from the engine"
    finally:
        loop_.shutdown(1)
    assert not loop_.alive


def test_a_step_that_raises_fails_its_requests_frees_blocks_and_the_loop_goes_on(tiny_model):
    from minipaged import SamplingParams, parts

    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    loop_ = EngineLoop(lambda: ThreadRecordingEngine(_engine(tiny_model), fail_steps={2})).start()
    try:
        events = asyncio.run(_run(loop_, [("a", [5, 6, 7], params), ("b", [8, 9], params)]))
        for rid in "ab":
            assert events[rid][-1].kind == "error" and events[rid][-1].error.status == 500
            assert "planted failure" in events[rid][-1].error.message
        loop_.call(lambda e: parts.check_scheduler(e.scheduler))
        assert loop_.call(lambda e: parts.num_used_blocks(e.allocator)) == 0
        again = asyncio.run(_run(loop_, [("c", [5, 6, 7], params)]))
        assert again["c"][-1].kind == "token" and len(again["c"][-1].output.token_ids) == 5
        assert loop_.alive
    finally:
        loop_.shutdown(1)


def test_admission_stops_at_the_waiting_limit(tiny_model):
    from minipaged import SamplingParams

    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    loop_ = EngineLoop(lambda: _engine(tiny_model, max_num_seqs=1), max_waiting_requests=1).start()
    try:
        # Hold the engine thread so that three submissions reach it together.
        holder = threading.Thread(target=loop_.call, args=(lambda e: time.sleep(0.5),))
        holder.start()
        time.sleep(0.1)
        events = asyncio.run(_run(loop_, [(f"r{i}", [5, 6], params) for i in range(3)]))
        holder.join()
        kinds = [events[f"r{i}"][-1].kind for i in range(3)]
        assert kinds == ["token", "error", "error"], kinds
        assert all(events[f"r{i}"][-1].error.status == 503 for i in (1, 2))
    finally:
        loop_.shutdown(1)


def test_bad_requests_and_a_broken_factory(tiny_model):
    from minipaged import SamplingParams

    loop_ = EngineLoop(lambda: _engine(tiny_model)).start()
    try:
        ev = asyncio.run(_run(loop_, [("x", [10**6], SamplingParams(max_tokens=2)), ("y", 3.5, SamplingParams(max_tokens=2))]))
        assert ev["x"][-1].error.status == 400 and "token ids" in ev["x"][-1].error.message
        assert ev["y"][-1].error.status == 400
    finally:
        loop_.shutdown(1)
    with pytest.raises(ZeroDivisionError):
        EngineLoop(lambda: 1 / 0).start()
    with pytest.raises(ValueError, match="max_waiting_requests"):
        EngineLoop(lambda: None, max_waiting_requests=0)


def test_chat_without_max_tokens_fills_the_room_left_in_a_small_pool(tiny_model):
    from minipaged import SamplingParams

    loop_ = EngineLoop(lambda: _engine(tiny_model, num_blocks=3, block_size=16)).start()  # 48 slots, context 128
    try:
        aio = asyncio.new_event_loop()
        q: asyncio.Queue = asyncio.Queue()

        async def go():
            loop_.submit("c", [{"role": "user", "content": "hi"}], SamplingParams(max_tokens=10**6, ignore_eos=True, temperature=0.0),
                         q, asyncio.get_running_loop(), auto_max_tokens=True)
            while True:
                ev = await asyncio.wait_for(q.get(), 60)
                if ev.kind == "error" or ev.output.finished:
                    return ev

        ev = aio.run_until_complete(go())
        assert ev.kind == "token", ev.error
        out = ev.output
        assert out.finish_reason == "length" and len(out.prompt_token_ids) + len(out.token_ids) == 49, out
    finally:
        loop_.shutdown(1)


def test_shutdown_refuses_new_requests(tiny_model):
    from minipaged import SamplingParams

    loop_ = EngineLoop(lambda: _engine(tiny_model)).start()
    loop_.shutdown(0.1)
    with pytest.raises(P.APIError) as e:
        loop_.submit("z", [5], SamplingParams(max_tokens=1), asyncio.Queue(), asyncio.new_event_loop())
    assert e.value.status == 503


def test_server_config_is_validated():
    from minipaged.server.app import ServerConfig

    with pytest.raises(ValueError, match="max_request_bytes"):
        ServerConfig(max_request_bytes=0)
    with pytest.raises(ValueError, match="model_names"):
        ServerConfig(model_names=())


# -- n > 1 through the app, with a scripted engine (the real one gets n with parallel sampling) --
class ScriptedEngine:
    """Answers every request with n scripted samples over two steps, as RequestOutput.outputs does."""

    def __init__(self):
        self.scheduler = SimpleNamespace(waiting=[], running=[], num_preemptions=0)
        self.allocator = SimpleNamespace(num_blocks=4, num_free_blocks=4, block_size=16)
        self.config = SimpleNamespace(max_model_len=64)
        self.pending = {}

    def add_request(self, prompt, params, request_id):
        n = getattr(params, "n", 1)
        words = [("Hel", "lo"), ("Wo", "rld"), ("Fo", "o")][:n]
        steps = []
        for k in (0, 1):
            samples = [SimpleNamespace(index=j, text="".join(w[: k + 1]), token_ids=[1] * (k + 1), delta_text=w[k],
                                       finished=k == 1, finish_reason=("length" if j == 0 else "stop") if k == 1 else None)
                       for j, w in enumerate(words)]
            steps.append(SimpleNamespace(request_id=request_id, prompt_token_ids=[7, 8], outputs=samples, text=samples[0].text,
                                         token_ids=samples[0].token_ids, delta_text=samples[0].delta_text, error=None,
                                         finished=k == 1, finish_reason=samples[0].finish_reason))
        self.pending[request_id] = iter(steps)
        return request_id

    def has_unfinished_requests(self):
        return bool(self.pending)

    def step(self):
        outs = []
        for rid, it in list(self.pending.items()):
            o = next(it)
            outs.append(o)
            if o.finished:
                del self.pending[rid]
        return outs

    def abort_request(self, rid):
        return self.pending.pop(rid, None) is not None


def test_n_samples_become_choices_in_order(monkeypatch):
    import dataclasses
    import json

    from fastapi.testclient import TestClient

    from minipaged import SamplingParams
    from minipaged.server.app import ServerConfig, create_app

    if not P.supports_n():  # until the engine's SamplingParams has n, give it one for this test
        @dataclasses.dataclass
        class WithN(SamplingParams):
            n: int = 1

        monkeypatch.setattr(P, "SamplingParams", WithN)
    app = create_app(ScriptedEngine, ServerConfig(model_names=("fake",)))
    with TestClient(app) as client:
        r = client.post("/v1/completions", json={"prompt": ["a", "b"], "n": 2, "max_tokens": 2})
        body = r.json()
        assert r.status_code == 200, body
        assert [(c["index"], c["text"], c["finish_reason"]) for c in body["choices"]] == [
            (0, "Hello", "length"), (1, "World", "stop"), (2, "Hello", "length"), (3, "World", "stop")]
        assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 8, "total_tokens": 12,
                                 "prompt_tokens_details": {"cached_tokens": 0}}
        with client.stream("POST", "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "n": 3, "stream": True}) as s:
            lines = [ln for ln in s.iter_lines() if ln]
        assert lines[-1] == "data: [DONE]"
        chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
        text = {i: "" for i in range(3)}
        ends = {}
        for c in chunks:
            ch = c["choices"][0]
            text[ch["index"]] += ch["delta"].get("content", "")
            if ch["finish_reason"]:
                ends[ch["index"]] = ch["finish_reason"]
        assert text == {0: "Hello", 1: "World", 2: "Foo"} and ends == {0: "length", 1: "stop", 2: "stop"}
        assert [c["choices"][0]["delta"].get("role") for c in chunks[:3]] == ["assistant"] * 3


# -- every engine setting from the command line ----------------------------------------------
def _sample_value(tp):
    """A value of the field's type other than None, and its command-line text."""
    import typing

    from minipaged.flags import _unwrap_optional

    inner, _ = _unwrap_optional(tp)
    if typing.get_origin(inner) is typing.Literal:
        v = typing.get_args(inner)[-1]
        return v, str(v)
    if typing.get_origin(inner) in (tuple, list):
        (item,) = [a for a in typing.get_args(inner) if a is not Ellipsis]
        v = {int: (3, 4), str: ("a", "b"), float: (0.5, 1.5)}[item]
        v = v if typing.get_origin(inner) is tuple else list(v)
        return v, ",".join(map(str, v))
    return {int: (7, "7"), float: (0.25, "0.25"), str: ("x", "x"),
            dict: ({"method": "ngram", "num_speculative_tokens": 2}, '{"method": "ngram", "num_speculative_tokens": 2}')}[inner]


def _check_every_field(parser_argv, skip, kwargs_of):
    """Every EngineConfig field not in ``skip`` is a flag of its real type; unset flags are left out."""
    from minipaged.flags import _unwrap_optional, config_fields, option_of

    assert kwargs_of([]) == {}, "a flag that was not given must not override the engine's default"
    names = [name for name, _, _ in config_fields()]
    assert set(skip) <= set(names), f"skip names fields that do not exist: {set(skip) - set(names)}"
    for name, tp, _ in config_fields():
        if name in skip:
            continue
        flag = option_of(name)
        inner, optional = _unwrap_optional(tp)
        if inner is bool:
            cases = [([flag], True), (["--no-" + flag[2:]], False), ([flag, "False"], False), ([flag, "true"], True)]
        else:
            v, text = _sample_value(tp)
            cases = [([flag, text], v)]
        if optional:
            cases.append(([flag, "auto"], None))  # an explicit "decide for me"
        for argv, want in cases:
            got = kwargs_of(argv)
            assert name in got and got[name] == want and type(got[name]) is type(want), (argv, got.get(name, "missing"), want)
        with pytest.raises(SystemExit):  # a value of the wrong type is refused by the parser itself
            kwargs_of([flag, "not-a-value"])


def test_serve_and_bench_take_every_engine_config_field_with_its_real_type(capsys):
    from minipaged.bench.serving import BENCH_DECIDES
    from minipaged.cli import build_parser
    from minipaged.flags import engine_kwargs
    from minipaged.server.cli import SERVER_FIXED
    from minipaged.server.cli import engine_kwargs as serve_kwargs

    ap = build_parser()

    def serve(argv):
        kw = serve_kwargs(ap.parse_args(["serve", *argv]))
        return {k: v for k, v in kw.items() if k not in SERVER_FIXED and k != "attention"}

    def bench(argv):
        return engine_kwargs(ap.parse_args(["bench", *argv]), skip=BENCH_DECIDES)

    _check_every_field(None, SERVER_FIXED, serve)
    _check_every_field(None, BENCH_DECIDES, bench)
    # the probe that failed: `--enable-prefix-caching False` was a plain string flag, refused by the engine
    assert serve(["--enable-prefix-caching", "False", "--packed-gemm", "auto", "--gguf-blocks"]) == {
        "enable_prefix_caching": False, "packed_gemm": None, "gguf_blocks": True}
    with pytest.raises(SystemExit):
        serve(["--no-packed-gemm", "true"])
    assert "takes no value" in capsys.readouterr().err


def test_a_new_engine_config_field_is_a_flag_by_itself(monkeypatch):
    """Fields added later (any supported type) get typed flags without touching the command line."""
    import argparse
    import dataclasses

    import minipaged.config as config
    from minipaged.flags import add_engine_flags, engine_kwargs

    @dataclasses.dataclass(frozen=True)
    class Extended(config.EngineConfig):
        fast_paths: Optional[bool] = None
        fused_decode: bool = True
        ratio: float = 0.5
        mode: Literal["eager", "graph"] = "eager"
        skip_ops: tuple[str, ...] = ()

    monkeypatch.setattr(config, "EngineConfig", Extended)
    ap = argparse.ArgumentParser()
    add_engine_flags(ap)
    kw = engine_kwargs(ap.parse_args(["--fast-paths", "auto", "--no-fused-decode", "--ratio", "0.75", "--mode", "graph",
                                      "--skip-ops", "rope,norm"]))
    assert kw == {"fast_paths": None, "fused_decode": False, "ratio": 0.75, "mode": "graph", "skip_ops": ("rope", "norm")}

    @dataclasses.dataclass(frozen=True)
    class Untyped(config.EngineConfig):
        table: set = dataclasses.field(default_factory=set)  # (a dict is a JSON object: --speculative-config '{...}')

    monkeypatch.setattr(config, "EngineConfig", Untyped)
    with pytest.raises(TypeError, match="table"):  # loud when the parser is built, never an untyped flag
        add_engine_flags(argparse.ArgumentParser())


# -- the server on a shared machine: key, JSON only, Host names, unencodable strings ----------
def _guarded_client(**cfg):
    from fastapi.testclient import TestClient

    from minipaged.server.app import ServerConfig, create_app

    app = create_app(ScriptedEngine, ServerConfig(model_names=("fake",), **cfg))
    return TestClient(app, base_url="http://127.0.0.1:8000")


def test_api_key_is_required_on_v1_routes_as_a_bearer_token():
    body = {"prompt": "a", "max_tokens": 2}
    with _guarded_client(api_key="s3cret") as c:
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
        assert r.headers["www-authenticate"] == "Bearer"
        assert c.post("/v1/completions", json=body, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert c.post("/v1/completions", json=body, headers={"Authorization": "Basic s3cret"}).status_code == 401
        assert c.get("/v1/models").status_code == 401
        ok = c.post("/v1/completions", json=body, headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "Hello"
        assert c.get("/health").status_code == 200 and c.get("/metrics").status_code == 200  # probes stay open
    with pytest.raises(ValueError, match="api_key"):
        _guarded_client(api_key=" ")


def test_api_key_comes_from_the_flag_or_the_environment(monkeypatch):
    from minipaged.cli import build_parser
    from minipaged.server.cli import api_key_of

    ap = build_parser()
    monkeypatch.delenv("MINIPAGED_API_KEY", raising=False)
    assert api_key_of(ap.parse_args(["serve"])) is None
    monkeypatch.setenv("MINIPAGED_API_KEY", "from-env")
    assert api_key_of(ap.parse_args(["serve"])) == "from-env"
    assert api_key_of(ap.parse_args(["serve", "--api-key", "from-flag"])) == "from-flag"


def test_bodies_must_be_json_so_a_web_page_cannot_post_without_a_preflight():
    with _guarded_client() as c:
        for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None):
            headers = {"content-type": ctype} if ctype else {}
            r = c.post("/v1/completions", content=b'{"prompt": "a", "max_tokens": 2}', headers=headers)
            assert r.status_code == 415 and "application/json" in r.json()["error"]["message"], (ctype, r.text)
        r = c.post("/v1/completions", content=b'{"prompt": "a", "max_tokens": 2}',
                   headers={"content-type": "Application/JSON; charset=utf-8"})
        assert r.status_code == 200, r.text


def test_on_loopback_a_host_header_naming_another_site_is_refused():
    from minipaged.server.security import host_name, is_loopback

    assert [host_name(h) for h in ("127.0.0.1:8000", "[::1]:80", "localhost", "::1")] == ["127.0.0.1", "::1", "localhost", "::1"]
    assert all(map(is_loopback, ("127.0.0.1", "127.8.9.1", "::1", "[::1]", "localhost", "LOCALHOST")))
    assert not any(map(is_loopback, ("0.0.0.0", "10.0.0.1", "evil.example", "localhost.evil.example", "")))
    body = {"prompt": "a", "max_tokens": 2}
    with _guarded_client(allowed_hosts="loopback") as c:
        for host in ("evil.example:8000", "evil.example", "127.0.0.1.nip.io", "10.0.0.5:8000"):  # DNS rebinding
            r = c.post("/v1/completions", json=body, headers={"host": host})
            assert r.status_code == 421 and r.json()["error"]["code"] == "invalid_host", (host, r.text)
            assert c.get("/v1/models", headers={"host": host}).status_code == 421
        for host in ("127.0.0.1:8000", "localhost:8000", "[::1]:8000", "localhost"):
            assert c.post("/v1/completions", json=body, headers={"host": host}).status_code == 200, host
    with _guarded_client() as c:  # not bound to loopback: any name (the API key is the protection there)
        assert c.post("/v1/completions", json=body, headers={"host": "evil.example"}).status_code == 200


def test_strings_that_cannot_be_encoded_are_400_naming_where():
    with _guarded_client() as c:
        for raw, where in [(b'{"prompt": "a", "\\udcff": 1}', "field name"),
                           (b'{"prompt": "a", "max_\\ud800tokens": 1}', "position 4"),
                           (b'{"prompt": "a\\udcffb", "max_tokens": 2}', "$.prompt"),
                           (b'{"messages": [{"role": "user", "content": "x\\ud800"}]}', "$.messages[0].content")]:
            path = "/v1/chat/completions" if b"messages" in raw else "/v1/completions"
            r = c.post(path, content=raw, headers={"content-type": "application/json"})
            assert r.status_code == 400, (raw, r.status_code, r.text)
            msg = r.json()["error"]["message"]
            assert where in msg and "surrogate" in msg, msg
        assert c.post("/v1/completions", json={"prompt": "a", "max_tokens": 2}).status_code == 200  # still serving


def test_max_tokens_past_the_context_is_400_naming_both_numbers(tiny_model):
    from minipaged import SamplingParams

    loop_ = EngineLoop(lambda: _engine(tiny_model)).start()  # the tiny model's context: 128
    try:
        prompt = [5] * 10
        ev = asyncio.run(_run(loop_, [("x", prompt, SamplingParams(max_tokens=119, ignore_eos=True)),
                                      ("ok", prompt, SamplingParams(max_tokens=118, ignore_eos=True, temperature=0.0))]))
        err = ev["x"][-1].error
        assert err is not None and err.status == 400 and err.param == "max_tokens", err
        for number in ("128", "10", "119", "118"):  # the context, the prompt, what was asked, what fits
            assert number in err.message, err.message
        out = ev["ok"][-1].output
        assert ev["ok"][-1].kind == "token" and len(out.token_ids) == 118 and out.finish_reason == "length"
        assert loop_.call(lambda e: len(e.requests)) == 0  # the refused one never reached the engine
    finally:
        loop_.shutdown(1)


# -- a client that hangs up is aborted within 2 s, streamed or not ----------------------------
class SlowEngine:
    """An engine whose steps take ``delay_s`` each, so a request runs for seconds."""

    def __init__(self, engine, delay_s=0.05):
        self._engine, self.delay_s = engine, delay_s

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def step(self):
        time.sleep(self.delay_s)
        return self._engine.step()


@pytest.fixture
def live_server(tiny_model):
    """The app with a slow engine, on uvicorn in a thread on 127.0.0.1; yields (port, engine loop, metrics)."""
    uvicorn = pytest.importorskip("uvicorn")
    from minipaged.server.app import ServerConfig, create_app
    from minipaged.server.launch import free_port

    port = free_port()
    app = create_app(lambda: SlowEngine(_engine(tiny_model)), ServerConfig(model_names=("tiny",), allowed_hosts="loopback"))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert time.monotonic() < deadline and th.is_alive(), "uvicorn did not start"
        time.sleep(0.05)
    yield port, app.state.engine_loop, app.state.metrics
    server.should_exit = True
    th.join(30)


def _aborted(metrics) -> float:
    from minipaged.server.metrics import parse_metrics

    m = parse_metrics(metrics.render()[0].decode())
    return m.get("minipaged:request_aborted_total", m.get("vllm:request_aborted_total", 0.0))


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_hangs_up_is_aborted_within_2_s(live_server, stream):
    import json
    import socket

    port, loop_, metrics = live_server
    body = json.dumps({"prompt": [5, 6, 7], "max_tokens": 120, "ignore_eos": True, "temperature": 0, "stream": stream}).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    if stream:
        assert s.recv(1024).startswith(b"HTTP/1.1 200"), "no stream started"
    deadline = time.monotonic() + 30
    while loop_.stats.num_steps < 5:  # generating: tokens arrive every step, so only a hang-up check ends it
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.02)
    before = _aborted(metrics)
    s.close()
    hung_up = time.monotonic()
    while loop_.stats.num_in_flight or loop_.stats.num_running:
        assert time.monotonic() - hung_up < 2.0, (f"still running {time.monotonic() - hung_up:.1f} s after the client hung up "
                                                  f"(steps {loop_.stats.num_steps}, stream={stream})")
        time.sleep(0.02)
    assert loop_.stats.num_used_blocks == 0
    assert _aborted(metrics) == before + 1, "the hang-up was not counted as aborted"
    assert loop_.stats.num_steps < 120, "the request ran to its end instead of being aborted"


def test_bench_engine_flags_reach_the_engines_it_builds(tiny_model):
    from minipaged.bench.baselines import build_engine

    model, _ = tiny_model
    eng = build_engine(model, "paged", 8, 64, attention="torch",
                       engine={"enable_chunked_prefill": False, "enable_prefix_caching": False, "max_model_len": 64})
    assert (eng.config.enable_chunked_prefill, eng.config.enable_prefix_caching, eng.config.max_model_len) == (False, False, 64)


def test_n_past_max_num_seqs_is_400_before_any_work(tiny_model):
    from minipaged import SamplingParams

    loop_ = EngineLoop(lambda: _engine(tiny_model, max_num_seqs=4)).start()
    try:
        t = time.perf_counter()
        ev = asyncio.run(_run(loop_, [("big", [5, 6], SamplingParams(max_tokens=2, n=2**17))]))
        err = ev["big"][-1].error
        assert err.status == 400 and err.param == "n" and "max_num_seqs=4" in err.message, err.message
        assert time.perf_counter() - t < 5.0  # refused before 2**17 samples were made
        assert loop_.call(lambda e: len(e.requests)) == 0
    finally:
        loop_.shutdown(1)


def test_an_engine_that_fails_after_it_is_built_is_reported_not_waited_on():
    """What start() reads of a built engine raising (its config, its first stats) reaches start()'s caller at once."""
    import time

    from minipaged.server.engine_loop import EngineLoop

    class Broken:
        @property
        def config(self):
            raise RuntimeError("the engine's config could not be read")

    t = time.perf_counter()
    with pytest.raises(RuntimeError, match="config could not be read"):
        EngineLoop(Broken).start(timeout_s=30)
    assert time.perf_counter() - t < 10
