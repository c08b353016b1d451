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
    with pytest.raises(P.APIError, match="Did you mean 'temperature'"):
        P.parse_request("completion", {"prompt": "hi", "temprature": 0})
    with pytest.raises(P.APIError, match="logprobs is not supported"):
        P.parse_request("chat", {"messages": [{"role": "user", "content": "x"}], "logprobs": True})
    # a field at its "not used" value is fine: clients send them by default
    P.parse_request("chat", {"messages": [{"role": "user", "content": "x"}], "logprobs": False, "presence_penalty": 0})


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
        assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 8, "total_tokens": 12}
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
