"""Speculative decoding on ``/metrics``, under vLLM's names: ``vllm:spec_decode_num_drafts``,
``..._num_draft_tokens``, ``..._num_accepted_tokens`` and ``..._num_accepted_tokens_per_pos``
(label ``position``), fed from the engine's totals (``engine.stats()["spec_decode"]``) or from
finished requests' counts, never both; and over HTTP from a server with speculation on."""
from __future__ import annotations

import pytest

pytest.importorskip("prometheus_client")

from minipaged.engine import LLMEngine  # noqa: E402
from minipaged.sampling import SamplingParams  # noqa: E402
from minipaged.server.engine_loop import LoopStats  # noqa: E402
from minipaged.server.metrics import ServerMetrics, parse_metrics, spec_decode_counts  # noqa: E402

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
PROMPTS = [[5, 9, 17, 5, 9, 17, 5, 9], [60, 61, 60, 61, 60]]  # the tiny model's answers repeat them: drafts are kept
NAMES = ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
         "vllm:spec_decode_num_accepted_tokens_total")
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"


def _served(tiny_model):
    model, tok = tiny_model
    eng = LLMEngine(model, tok, speculative_config=SPEC, attention="torch", record_trace=False)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    ids = [eng.add_request(p, params) for p in PROMPTS]
    done = eng.run()
    return eng, [done[i] for i in ids]


def _spec_values(metrics: ServerMetrics) -> dict:
    m = parse_metrics(metrics.render()[0].decode())
    pos = {k.split('position="')[1].split('"')[0]: v for k, v in m.items() if k.startswith(PER_POS + "{")}
    return {**{n: m.get(n) for n in NAMES}, "per_pos": [pos[str(i)] for i in range(len(pos))]}


def _expected(s: dict) -> dict:
    return {NAMES[0]: s["num_drafts"], NAMES[1]: s["num_draft_tokens"], NAMES[2]: s["num_accepted_tokens"],
            "per_pos": [float(x) for x in s["accepted_per_pos"]]}


def test_metrics_carry_the_engines_spec_decode_totals(tiny_model):
    eng, _ = _served(tiny_model)
    s = eng.stats()["spec_decode"]
    assert s["num_drafts"] > 0 and s["num_accepted_tokens"] > 0, s
    assert spec_decode_counts(eng) == {"spec_decode": s}
    metrics = ServerMetrics("tiny")
    assert "spec_decode" not in metrics.render()[0].decode(), "spec-decode series before any draft"
    for _ in range(2):  # the same totals twice: counted once
        metrics.on_step(LoopStats(num_blocks=8, extra=spec_decode_counts(eng)))
    got = _spec_values(metrics)
    assert got == _expected(s)
    assert all(v > 0 for k, v in got.items() if k != "per_pos") and got["per_pos"][0] > 0
    assert sum(got["per_pos"]) == got[NAMES[2]]
    assert "vllm:prefix_cache_queries_total" not in parse_metrics(metrics.render()[0].decode()), \
        "spec-decode counts in LoopStats.extra must not register the prefix-cache counters"


def test_without_the_engines_totals_finished_requests_feed_the_same_counts(tiny_model):
    eng, outs = _served(tiny_model)
    metrics = ServerMetrics("tiny")
    for o in outs:
        metrics.on_finish(o, 1.0)
    assert _spec_values(metrics) == _expected(eng.stats()["spec_decode"])
    # once the loop gives the engine's totals, they alone count: nothing is counted twice
    metrics.on_step(LoopStats(num_blocks=8, extra=spec_decode_counts(eng)))
    for o in outs:
        metrics.on_finish(o, 1.0)
    assert _spec_values(metrics) == _expected(eng.stats()["spec_decode"])


def test_no_spec_decode_series_without_speculation(tiny_model):
    model, tok = tiny_model
    eng = LLMEngine(model, tok, attention="torch", record_trace=False)
    eng.add_request(PROMPTS[0], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    out = list(eng.run().values())[0]
    metrics = ServerMetrics("tiny")
    metrics.on_step(LoopStats(num_blocks=8, extra=spec_decode_counts(eng)))
    metrics.on_finish(out, 1.0)
    assert spec_decode_counts(eng) == {} and "spec_decode" not in metrics.render()[0].decode()


def test_a_server_with_speculation_on_reports_them_on_metrics(tiny_model):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from minipaged.server.app import ServerConfig, create_app

    model, tok = tiny_model
    app = create_app(lambda: LLMEngine(model, tok, speculative_config=SPEC, attention="torch", record_trace=False),
                     ServerConfig(model_names=("tiny",)))
    with TestClient(app) as client:
        for p in PROMPTS:
            r = client.post("/v1/completions", json={"prompt": p, "max_tokens": 30, "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
        text = client.get("/metrics").text
        s = app.state.engine_loop.call(lambda e: e.stats()["spec_decode"])
    m = parse_metrics(text)
    assert s["num_drafts"] > 0 and s["num_accepted_tokens"] > 0, s
    for name, key in zip(NAMES, ("num_drafts", "num_draft_tokens", "num_accepted_tokens")):
        assert m.get(name) == s[key] and m[name] > 0, (name, m.get(name), s)
    assert m[f'{PER_POS}{{engine="0",model_name="tiny",position="0"}}'] > 0
    assert sum(v for k, v in m.items() if k.startswith(PER_POS + "{")) == s["num_accepted_tokens"]
