"""`minipaged serve` through the official `openai` client: chat, completions, streaming, errors.

The server runs in a child process on 127.0.0.1 at a free port and is stopped by its pid.
Greedy answers over HTTP must equal ``LLM.generate``'s on the same model. Malformed bodies,
wrong types, huge bodies, unknown models and routes get OpenAI-style 4xx bodies, never a 500
with a traceback.
"""
from __future__ import annotations

import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from minipaged.server.launch import ServerProcess  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
ENV = {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there was a"]
CHATS = [[{"role": "user", "content": "What is 2 + 2?"}], [{"role": "user", "content": "Name a colour."}]]


@pytest.fixture(scope="module")
def server(smollm2_path):
    with ServerProcess(smollm2_path, env=ENV, max_num_seqs=8, max_waiting_requests=64) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def llm(smollm2):
    from minipaged import LLM

    model, tok = smollm2
    return LLM(model, tok)


def _no_traceback(body: str) -> None:
    assert "Traceback" not in body and 'File "' not in body, f"a response leaked a traceback: {body[:300]}"


# -- the happy paths -----------------------------------------------------------------------
@pytest.mark.slow
def test_models_lists_the_served_names(client, server):
    ids = [m.id for m in client.models.list().data]
    assert ids[0] == "SmolLM2-135M-Instruct" and "HuggingFaceTB/SmolLM2-135M-Instruct" in ids


@pytest.mark.slow
def test_greedy_completions_equal_llm_generate_even_when_sent_together(client, llm):
    from minipaged import SamplingParams

    want = [o.text for o in llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0.0))]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # concurrent clients: batched together on the server
        got = list(pool.map(lambda p: client.completions.create(model="SmolLM2-135M-Instruct", prompt=p, max_tokens=12, temperature=0), PROMPTS))
    assert [r.choices[0].text for r in got] == want
    assert all(r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 12 for r in got)
    assert got[0].usage.prompt_tokens == len(llm.tokenizer.encode(PROMPTS[0]))


@pytest.mark.slow
def test_greedy_chat_equals_llm_chat(client, llm):
    from minipaged import SamplingParams

    want = [o.text for o in llm.chat(CHATS, SamplingParams(max_tokens=16, temperature=0.0))]
    got = [client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=m, max_tokens=16, temperature=0).choices[0].message.content for m in CHATS]
    assert got == want


@pytest.mark.slow
def test_token_id_prompts_and_batched_prompts(client, llm):
    from minipaged import SamplingParams

    ids = llm.tokenizer.encode(PROMPTS[0])
    rid = llm.engine.add_request({"prompt_token_ids": ids}, SamplingParams(max_tokens=8, temperature=0.0))
    want = llm.engine.run()[rid].text
    r = client.completions.create(model="default", prompt=ids, max_tokens=8, temperature=0)
    assert r.choices[0].text == want
    batch = client.completions.create(model="default", prompt=PROMPTS[:2], max_tokens=8, temperature=0)
    solo = [o.text for o in llm.generate(PROMPTS[:2], SamplingParams(max_tokens=8, temperature=0.0))]
    assert [c.index for c in batch.choices] == [0, 1] and [c.text for c in batch.choices] == solo
    assert batch.usage.completion_tokens == 16


@pytest.mark.slow
def test_streamed_completion_and_chat_equal_the_whole_answer(client, llm):
    from minipaged import SamplingParams

    want = llm.generate(PROMPTS[2], SamplingParams(max_tokens=20, temperature=0.0))[0].text
    parts = []
    last = None
    for ch in client.completions.create(model="default", prompt=PROMPTS[2], max_tokens=20, temperature=0, stream=True):
        parts.append(ch.choices[0].text)
        last = ch
    assert "".join(parts) == want and len([p for p in parts if p]) > 3 and last.choices[0].finish_reason == "length"

    want_out = llm.chat(CHATS[0], SamplingParams(max_tokens=16, temperature=0.0))[0]
    want_chat = want_out.text
    deltas, roles, reasons = [], [], []
    stream = client.chat.completions.create(model="default", messages=CHATS[0], max_tokens=16, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    usage = None
    for ch in stream:
        if ch.usage is not None:
            usage = ch.usage
        for c in ch.choices:
            roles.append(c.delta.role)
            deltas.append(c.delta.content or "")
            reasons.append(c.finish_reason)
    assert "".join(deltas) == want_chat
    assert roles[0] == "assistant" and reasons[-1] in ("stop", "length") and all(r is None for r in reasons[:-1])
    assert usage is not None and usage.completion_tokens == len(want_out.token_ids)


@pytest.mark.slow
def test_sse_wire_format_ends_with_done(server):
    body = {"prompt": "Hello", "max_tokens": 4, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert all(ln.startswith("data: ") for ln in lines) and lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
    assert {c["object"] for c in chunks} == {"text_completion"} and len({c["id"] for c in chunks}) == 1


@pytest.mark.slow
def test_stop_strings_are_cut_and_never_streamed(client, llm):
    from minipaged import SamplingParams

    full = llm.generate(PROMPTS[2], SamplingParams(max_tokens=24, temperature=0.0))[0].text
    words = full.split()
    stop = " " + words[3]  # a word in the middle of the answer
    want = llm.generate(PROMPTS[2], SamplingParams(max_tokens=24, temperature=0.0, stop=[stop]))[0].text
    assert stop not in want and len(want) < len(full)
    streamed = "".join(ch.choices[0].text for ch in client.completions.create(
        model="default", prompt=PROMPTS[2], max_tokens=24, temperature=0, stop=stop, stream=True))
    whole = client.completions.create(model="default", prompt=PROMPTS[2], max_tokens=24, temperature=0, stop=[stop])
    assert streamed == want and whole.choices[0].text == want and whole.choices[0].finish_reason == "stop"


@pytest.mark.slow
def test_seeded_sampling_is_reproducible_over_http(client):
    a, b = (client.completions.create(model="default", prompt=PROMPTS[1], max_tokens=10, temperature=0.9, seed=7).choices[0].text for _ in range(2))
    assert a == b


# -- errors --------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("kwargs, param", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(temperature=-1), "temperature"),
    (dict(top_p=0), "top_p"),
    (dict(logprobs=99), "logprobs"),
    (dict(frequency_penalty=5), "frequency_penalty"),
    (dict(extra_body={"repetition_penalty": 0}), "repetition_penalty"),
    (dict(extra_body={"response_format": {"type": "xml"}}), "response_format"),
])
def test_invalid_parameters_are_400_naming_the_field(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="default", prompt="Hi", **kwargs)
    err = e.value.body if isinstance(e.value.body, dict) else {}
    assert e.value.status_code == 400 and err.get("param") == param, e.value.body
    _no_traceback(str(e.value.body))


@pytest.mark.slow
def test_n_greater_than_one_is_refused_until_the_engine_samples_in_parallel(client):
    from minipaged.server.protocol import supports_n

    if supports_n():
        r = client.completions.create(model="default", prompt="Hi", max_tokens=4, n=2, temperature=0.8, seed=1)
        assert [c.index for c in r.choices] == [0, 1] and r.usage.completion_tokens == 8
        seen = {}
        for ch in client.completions.create(model="default", prompt="Hi", max_tokens=4, n=2, temperature=0.8, seed=1, stream=True):
            for c in ch.choices:
                seen[c.index] = seen.get(c.index, "") + c.text
        assert seen == {c.index: c.text for c in r.choices}  # seeded: the stream is the same answer
    else:
        with pytest.raises(openai.BadRequestError, match="n > 1 is not supported yet"):
            client.completions.create(model="default", prompt="Hi", max_tokens=4, n=2)


@pytest.mark.slow
def test_bad_prompts_are_400_and_leave_the_server_serving(client, llm, server):
    too_long = [5] * 8300  # SmolLM2's context is 8192
    with pytest.raises(openai.BadRequestError, match="context"):
        client.completions.create(model="default", prompt=too_long, max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="token ids"):
        client.completions.create(model="default", prompt=[1, 2, 10**9], max_tokens=4)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="default", messages=[{"role": "wizard", "content": "hi"}], max_tokens=4)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="default", messages=[], max_tokens=4)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-4o", prompt="Hi", max_tokens=4)
    ok = client.completions.create(model="default", prompt="Hi", max_tokens=3, temperature=0)
    assert ok.usage.completion_tokens == 3
    m = server.metrics()
    assert m["minipaged:num_kv_blocks_used"] == 0 and m["minipaged:request_rejected_total"] >= 2


@pytest.mark.slow
@pytest.mark.parametrize("body, status, what", [
    (b"{not json", 400, "not valid JSON"),
    (b"", 400, "no body"),
    (b"[1, 2, 3]", 400, "JSON object"),
    (b'{"prompt": "hi", "max_tokens": "5"}', 400, "max_tokens"),
    (b'{"prompt": "hi", "max_tokens": true}', 400, "max_tokens"),
    (b'{"prompt": "hi", "temperature": NaN}', 400, "temperature"),
    (b'{"prompt": "hi", "stream": "yes"}', 400, "stream"),
    (b'{"prompt": 42}', 400, "prompt"),
    (b'{"prompt": []}', 400, "prompt"),
    (b'{"prompt": "hi", "stop": ""}', 400, "stop"),
    (b'{"prompt": "hi", "stop": 3}', 400, "stop"),
    (b"{\"prompt\": " + b"[" * 100000 + b"]" * 100000 + b"}", 400, "JSON"),
    (b'{"prompt": "' + b"a" * (2 << 20) + b'"}', 413, "limit"),
    (b"\xff\xfe\x00garbage", 400, "JSON"),
])
def test_malformed_bodies_get_4xx_openai_errors(server, body, status, what):
    r = httpx.post(server.url + "/completions", content=body, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == status, r.text[:300]
    err = r.json()["error"]
    assert what.lower() in err["message"].lower() and err["type"], err
    _no_traceback(r.text)


@pytest.mark.slow
def test_unknown_routes_and_methods_are_json_errors(server):
    r = httpx.get(server.url + "/engines", timeout=30)
    assert r.status_code == 404 and "no route" in r.json()["error"]["message"]
    r = httpx.get(server.url + "/completions", timeout=30)
    assert r.status_code == 405 and r.json()["error"]["type"]


@pytest.mark.slow
def test_metrics_report_what_happened(client, server):
    client.completions.create(model="default", prompt="Hi", max_tokens=5, temperature=0, stream=False)
    m = server.metrics()
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "num_kv_blocks_used", "num_preemptions_total",
                 "time_to_first_token_seconds_count", "inter_token_latency_seconds_count", "e2e_request_latency_seconds_count",
                 "generation_tokens_total", "request_success_total"):
        assert "vllm:" + name in m, f"/metrics has no vllm:{name}"
    assert m["vllm:num_requests_running"] == 0 and m["vllm:num_kv_blocks_used"] == 0
    assert m["vllm:time_to_first_token_seconds_count"] >= 1
    assert m["vllm:inter_token_latency_seconds_count"] >= 4
    assert m["vllm:generation_tokens_total"] >= m["vllm:inter_token_latency_seconds_count"] + m["vllm:time_to_first_token_seconds_count"]
    h = httpx.get(server.base + "/health", timeout=10)
    assert h.status_code == 200


@pytest.mark.slow
def test_concurrent_streams_are_batched_together(client, server):
    """Four streams at once: the engine ran them in the same steps (more than one running at a time)."""
    seen = []
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            seen.append(server.metrics()["vllm:num_requests_running"])
            time.sleep(0.05)

    w = threading.Thread(target=watch)
    w.start()
    try:
        with ThreadPoolExecutor(4) as pool:
            outs = list(pool.map(lambda p: "".join(c.choices[0].text for c in client.completions.create(
                model="default", prompt=p, max_tokens=24, temperature=0, stream=True, extra_body={"ignore_eos": True})), PROMPTS + ["Hi"]))
    finally:
        stop.set()
        w.join()
    assert all(outs) and max(seen) >= 2, f"at most {max(seen)} request(s) were running at once"
