"""Prefill and decode on separate engines (minipaged/disagg.py): the consumer decodes with the blocks the
producer sent over torch.distributed (gloo) and gives a single engine's greedy tokens; the handshake
refuses a mismatch naming both values; each fault (a producer that dies mid-transfer, a transfer that
times out, a consumer that restarts) is planted, and no block leaks on either side."""
from __future__ import annotations

import random
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from minipaged import parts
from minipaged.engine import LLMEngine
from minipaged.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PREFILL = SamplingParams(max_tokens=1, temperature=0.0)
KW = dict(block_size=8, num_blocks=32)


def _cfg(role, port, **extra):
    cfg = {"kv_connector": "TorchDistributedConnector", "kv_role": role, "kv_port": port}
    if extra:
        cfg["kv_connector_extra_config"] = extra
    return cfg


def _prompts(n=3, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(45)] for _ in range(n)]


def _single(model, tok, prompt, params=GREEDY):
    eng = LLMEngine(model, tok, **KW)
    rid = eng.add_request({"prompt_token_ids": prompt}, params)
    return eng.run()[rid].outputs[0].token_ids


def _run(eng, prompt, params=GREEDY):
    rid = eng.add_request({"prompt_token_ids": prompt}, params)
    out = eng.run()[rid]
    return out.outputs[0].token_ids


def _no_leak(eng):
    parts.check_scheduler(eng.scheduler)
    assert eng.allocator.num_free_blocks == eng.allocator.num_blocks


def _wait(cond, timeout=20.0):
    t = time.monotonic()
    while not cond():
        assert time.monotonic() - t < timeout, "timed out waiting"
        time.sleep(0.05)


@pytest.fixture()
def pair(tiny_model):
    """A producer (rank 0) and a consumer (rank 1) in this process, joined over gloo."""
    model, tok = tiny_model
    prod = LLMEngine(model, tok, kv_transfer_config=_cfg("kv_producer", 0), **KW)
    port = prod.connector.connector.port
    cons = LLMEngine(model, tok, kv_transfer_config=_cfg("kv_consumer", port), **KW)
    yield prod, cons, port
    cons.shutdown()
    prod.shutdown()


def test_the_consumer_decodes_with_the_producers_blocks_and_gives_a_single_engines_tokens(tiny_model, pair):
    model, tok = tiny_model
    prod, cons, _ = pair
    for p in _prompts():
        want = _single(model, tok, p)
        _run(prod, p, PREFILL)  # the prompt is computed there; its blocks are sent before the step ends
        assert _run(cons, p) == want
    sp, sc = prod.stats()["kv_connector"], cons.stats()["kv_connector"]
    assert sp["sent_requests"] == 3 and sp["sent_blocks"] == sc["received_blocks"] == 3 * 5
    assert sc["host_hit_tokens"] == 3 * 40  # each decode computed only the prompt's last 5 tokens
    assert "kv_producer" in prod.plan.routes["kv_connector"] and "kv_consumer" in cons.plan.routes["kv_connector"]
    _no_leak(prod)
    _no_leak(cons)


def test_the_handshake_refuses_a_mismatch_naming_both_values(tiny_model):
    model, tok = tiny_model
    prod = LLMEngine(model, tok, kv_transfer_config=_cfg("kv_producer", 0), **KW)
    try:
        with pytest.raises(ValueError, match=r"block_size: producer 8, consumer 4"):
            LLMEngine(model, tok, block_size=4, num_blocks=64,
                      kv_transfer_config=_cfg("kv_consumer", prod.connector.connector.port))
        assert "block_size" in prod.connector.connector.last_error
        # the producer goes on waiting, and a matching consumer is taken
        cons = LLMEngine(model, tok, kv_transfer_config=_cfg("kv_consumer", prod.connector.connector.port), **KW)
        p = _prompts(1)[0]
        _run(prod, p, PREFILL)
        assert _run(cons, p) == _single(model, tok, p)
        cons.shutdown()
    finally:
        prod.shutdown()


def test_bad_transfer_configs_are_refused_clearly(tiny_model):
    model, tok = tiny_model
    with pytest.raises(ValueError, match="kv_role must be one of kv_producer, kv_consumer, kv_both"):
        LLMEngine(model, tok, kv_transfer_config={"kv_connector": "TorchDistributedConnector", "kv_role": "prefill"}, **KW)
    with pytest.raises(ValueError, match="not one of minipaged's: TorchDistributedConnector"):
        LLMEngine(model, tok, kv_transfer_config={"kv_connector": "NixlConnector", "kv_role": "kv_producer"}, **KW)
    with pytest.raises(ValueError, match="one KV connector at a time"):
        LLMEngine(model, tok, kv_offloading_size=0.01, kv_transfer_config=_cfg("kv_producer", 0), **KW)
    with pytest.raises(RuntimeError, match="start the kv_producer first"):
        LLMEngine(model, tok, kv_transfer_config=_cfg("kv_consumer", _free_port(), connect_timeout_s=1), **KW)


def test_a_transfer_that_times_out_closes_the_link_and_a_restarted_consumer_is_taken_back(tiny_model):
    model, tok = tiny_model
    prod = LLMEngine(model, tok, kv_transfer_config=_cfg("kv_producer", 0, transfer_timeout_s=1), **KW)
    port = prod.connector.connector.port
    slow = LLMEngine(model, tok, kv_transfer_config=_cfg("kv_consumer", port, fault="no_ack"), **KW)
    try:
        a, b, c = _prompts()
        assert _run(prod, a, GREEDY) == _single(model, tok, a)  # the producer's own request is served
        st = prod.stats()["kv_connector"]
        assert st["transfer_failures"] == 1 and "sending" in st["last_error"]
        _no_leak(prod)
        # the link is down: the producer serves on, sends nothing, and waits for a consumer
        assert _run(prod, b, PREFILL) and prod.stats()["kv_connector"]["sent_requests"] == 0
        slow.shutdown()  # the consumer restarts
        fresh = LLMEngine(model, tok, kv_transfer_config=_cfg("kv_consumer", port), **KW)
        assert fresh.stats()["kv_connector"]["link_generation"] == 2
        _run(prod, c, PREFILL)
        assert _run(fresh, c) == _single(model, tok, c)
        assert fresh.stats()["kv_connector"]["host_hit_tokens"] == 40
        # b was never sent: the new consumer prefills it locally, with the same tokens
        assert _run(fresh, b) == _single(model, tok, b)
        _no_leak(fresh)
        _no_leak(prod)
        fresh.shutdown()
    finally:
        slow.shutdown()
        prod.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PRODUCER = textwrap.dedent("""
    import sys, time
    from minipaged.model import load_model
    from minipaged.engine import LLMEngine
    from minipaged.sampling import SamplingParams
    folder, port, prompt = sys.argv[1], int(sys.argv[2]), [int(t) for t in sys.argv[3].split(",")]
    model, tok = load_model(folder)
    cfg = {"kv_connector": "TorchDistributedConnector", "kv_role": "kv_producer", "kv_port": port,
           "kv_connector_extra_config": {"fault": "die_mid_transfer"}}
    eng = LLMEngine(model, tok, block_size=8, num_blocks=32, kv_transfer_config=cfg)
    while eng.connector.connector.link is None:
        time.sleep(0.05)
    eng.add_request({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, temperature=0.0))
    eng.run()
""")


def test_a_producer_that_dies_mid_transfer_leaves_the_consumer_to_prefill_locally(tiny_model, tiny_hf_dir):
    model, tok = tiny_model
    a, b = _prompts(2, seed=5)
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-c", PRODUCER, str(tiny_hf_dir), str(port), ",".join(map(str, a))],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    cons = None
    try:
        cons = LLMEngine(model, tok, kv_transfer_config=_cfg("kv_consumer", port, connect_timeout_s=60), **KW)
        assert proc.wait(timeout=120) == 17, proc.stdout.read().decode()[-2000:]  # died after the hashes
        conn = cons.connector.connector
        _wait(lambda: conn.stats()["transfer_failures"] == 1)
        st = conn.stats()
        assert st["received_blocks"] == 0 and st["host_blocks"] == 0 and not st["link_up"], st  # nothing partial kept
        assert _run(cons, a) == _single(model, tok, a)  # prefilled locally
        assert _run(cons, b) == _single(model, tok, b)  # and the others go on
        assert cons.stats()["kv_connector"]["host_hit_tokens"] == 0
        _no_leak(cons)
    finally:
        if proc.poll() is None:
            proc.kill()
        if cons is not None:
            cons.shutdown()


@pytest.mark.slow
def test_equal_greedy_tokens_through_producer_consumer_and_proxy(tiny_model, tiny_hf_dir):
    """Two `minipaged serve` processes joined by the connector, `minipaged proxy`'s app in front."""
    import json
    import os
    from pathlib import Path

    from fastapi.testclient import TestClient

    from minipaged.llm import LLM
    from minipaged.server.launch import ServerProcess
    from minipaged.server.proxy import create_proxy_app

    model, tok = tiny_model
    env = {"PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parent.parent), os.environ.get("PYTHONPATH", "")])}
    kv_port = _free_port()
    conf = lambda role: json.dumps({"kv_connector": "TorchDistributedConnector", "kv_role": role, "kv_port": kv_port})  # noqa: E731
    with ServerProcess(tiny_hf_dir, env=env, block_size=8, kv_transfer_config=conf("kv_producer")) as prod, \
            ServerProcess(tiny_hf_dir, env=env, block_size=8, kv_transfer_config=conf("kv_consumer")) as cons:
        llm = LLM(model, tok, block_size=8)
        with TestClient(create_proxy_app(prod.base, cons.base)) as proxy:
            models = proxy.get("/v1/models")
            assert models.status_code == 200, models.text
            name = models.json()["data"][0]["id"]
            for p in _prompts(3, seed=7):
                body = {"model": name, "prompt": p, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
                r = proxy.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                want = llm.generate([{"prompt_token_ids": p}], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
                                    use_tqdm=False)[0].outputs[0].text
                assert r.json()["choices"][0]["text"] == want
            assert proxy.app.state.counts["prefill_failures"] == 0
        got = cons.metrics()
        assert got["vllm:external_prefix_cache_hits_total"] == 3 * 40, cons.tail()
        assert prod.metrics().get("vllm:external_prefix_cache_hits_total", 0) == 0


def test_serve_and_proxy_command_lines():
    from minipaged.cli import build_parser
    from minipaged.server.cli import engine_kwargs
    from minipaged.server.proxy import prefill_body

    ap = build_parser()
    args = ap.parse_args(["serve", "--kv-transfer-config",
                          '{"kv_connector": "TorchDistributedConnector", "kv_role": "kv_consumer"}'])
    assert engine_kwargs(args)["kv_transfer_config"]["kv_role"] == "kv_consumer"
    args = ap.parse_args(["proxy", "--prefill", "http://127.0.0.1:8100", "--decode", "http://127.0.0.1:8200"])
    assert args.cmd == "proxy" and args.prefill.endswith("8100")
    body = {"prompt": "hi", "max_tokens": 50, "stream": True, "stream_options": {"include_usage": True}, "n": 1}
    assert prefill_body(body) == {"prompt": "hi", "max_tokens": 1}


def test_kv_both_engines_send_and_receive_each_others_prompts(tiny_model):
    model, tok = tiny_model
    a = LLMEngine(model, tok, kv_transfer_config={**_cfg("kv_both", 0), "kv_rank": 0}, **KW)
    b = LLMEngine(model, tok, kv_transfer_config={**_cfg("kv_both", a.connector.connector.port), "kv_rank": 1}, **KW)
    try:
        p, q = _prompts(2, seed=11)
        _run(a, p, PREFILL)
        assert _run(b, p) == _single(model, tok, p)  # a prefilled, b decodes
        _run(b, q, PREFILL)
        assert _run(a, q) == _single(model, tok, q)  # and the other way round
        assert b.stats()["kv_connector"]["host_hit_tokens"] == a.stats()["kv_connector"]["host_hit_tokens"] == 40
        _no_leak(a)
        _no_leak(b)
    finally:
        b.shutdown()
        a.shutdown()
