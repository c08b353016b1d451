"""The KV connector seam and the host-memory tier (minipaged/kv_connector.py): the calls the engine
makes at each step, in order; host-tier hits that give exactly a clean engine's tokens with no block
leaked; a full host store that evicts; a load that fails; a learner's connector; /metrics."""
from __future__ import annotations

import random

import pytest

from minipaged import parts
from minipaged.engine import LLMEngine
from minipaged.interfaces import KVConnector
from minipaged.kv_connector import HostKVStore, HostOffloadConnector, KVLayout
from minipaged.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
SMALL = dict(block_size=8, num_blocks=10, max_num_seqs=1)  # one 45-token prompt + 3 tokens: 6 of 10 blocks


def _prompts(n_prefixes=4, n=12, seed=0):
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 500) for _ in range(40)] for _ in range(n_prefixes)]
    return [prefixes[i % n_prefixes] + [rng.randrange(3, 500) for _ in range(5)] for i in range(n)]


def _clean(model, tok, prompts, params=GREEDY):
    """Each prompt alone on a fresh engine with a large pool: nothing cached, nothing loaded."""
    out = []
    for p in prompts:
        eng = LLMEngine(model, tok, block_size=8, num_blocks=64)
        rid = eng.add_request({"prompt_token_ids": p}, params)
        out.append(eng.run()[rid].outputs[0].token_ids)
    return out


def _no_leak(eng):
    parts.check_scheduler(eng.scheduler)
    assert eng.allocator.num_free_blocks == eng.allocator.num_blocks, "a block is still held after every request ended"
    assert not eng.connector._held


def _one_by_one(eng, prompts, params=GREEDY):
    out = []
    for p in prompts:
        rid = eng.add_request({"prompt_token_ids": p}, params)
        out.append(eng.run()[rid].outputs[0].token_ids)
    return out


class Recording(HostOffloadConnector):
    """The host tier, logging every call the engine makes to it."""

    log: list = []

    def get_num_new_matched_tokens(self, seq, num_computed_tokens):
        n = super().get_num_new_matched_tokens(seq, num_computed_tokens)
        self.log.append(("get_num_new_matched_tokens", seq.seq_id, num_computed_tokens, n))
        return n

    def update_state_after_alloc(self, seq, block_ids, num_external_tokens):
        self.log.append(("update_state_after_alloc", seq.seq_id, len(block_ids), num_external_tokens))
        super().update_state_after_alloc(seq, block_ids, num_external_tokens)

    def request_finished(self, seq):
        self.log.append(("request_finished", seq.seq_id))
        super().request_finished(seq)

    def start_load_kv(self, kv_cache):
        self.log.append(("start_load_kv", len(self._loads)))
        super().start_load_kv(kv_cache)

    def save_kv(self, kv_cache, scheduled):
        self.log.append(("save_kv", tuple(s.seq.seq_id for s in scheduled)))
        super().save_kv(kv_cache, scheduled)


def test_the_connectors_calls_in_order_over_a_step_sequence(tiny_model):
    model, tok = tiny_model
    a, b1, b2 = _prompts(n_prefixes=3, n=3, seed=1)
    eng = LLMEngine(model, tok, kv_offloading_size=0.01, kv_connector=Recording, **SMALL)
    Recording.log = log = []
    for rid, p in (("a", a), ("b1", b1), ("b2", b2), ("again", a)):  # b1, b2 push a's blocks out of the pool
        eng.add_request(rid, {"prompt_token_ids": p}, GREEDY)
        while eng.has_unfinished_requests():
            log.append("step")
            eng.step()
    again = log[log.index(("get_num_new_matched_tokens", "again", 0, 40)) - 1:]
    assert again == [
        "step",  # scheduler side, then the load, all before the schedule; the save after the forward
        ("get_num_new_matched_tokens", "again", 0, 40),  # 5 whole blocks of 8 before the last of 45 tokens
        ("update_state_after_alloc", "again", 5, 40),
        ("start_load_kv", 5),
        ("save_kv", ("again",)),  # the prefill of the 5 other tokens, and the first token
        "step", ("save_kv", ("again",)),
        "step", ("save_kv", ("again",)), ("request_finished", "again"),  # the third token ends it
    ]
    first = log[: log.index(("request_finished", "a")) + 1]
    assert first == ["step", ("get_num_new_matched_tokens", "a", 0, 0), ("save_kv", ("a",)),
                     "step", ("save_kv", ("a",)), "step", ("save_kv", ("a",)), ("request_finished", "a")]
    assert [e for e in log if e != "step" and e[0] == "request_finished"] == [
        ("request_finished", r) for r in ("a", "b1", "b2", "again")]
    st = eng.stats()["kv_connector"]
    assert st["host_hit_tokens"] == 40 and st["device_hit_tokens"] == 0 and st["loaded_blocks"] == 5
    assert "Recording" in eng.plan.routes["kv_connector"]
    _no_leak(eng)


def test_host_tier_hits_give_exactly_a_clean_engines_tokens_with_no_block_leak(tiny_model):
    model, tok = tiny_model
    prompts = _prompts()
    want = _clean(model, tok, prompts)
    off = LLMEngine(model, tok, **SMALL)
    on = LLMEngine(model, tok, kv_offloading_size=0.01, **SMALL)
    assert _one_by_one(off, prompts) == want
    assert _one_by_one(on, prompts) == want
    st_off, st_on = off.stats(), on.stats()
    assert st_off["prefix_hit_tokens"] == 0, "the workload's prefixes must not fit the device pool"
    tiers = st_on["kv_connector"]
    assert tiers["host_hit_tokens"] == 8 * 40 and tiers["external_hits"] == 8 * 40
    assert st_on["prefix_hit_tokens"] == tiers["host_hit_tokens"] + tiers["device_hit_tokens"]
    _no_leak(on)


def test_concurrent_requests_with_preemption_and_host_hits_keep_their_tokens(tiny_model):
    model, tok = tiny_model
    prompts = _prompts(n=10, seed=3)
    want = _clean(model, tok, prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    eng = LLMEngine(model, tok, kv_offloading_size=0.01, block_size=8, num_blocks=16, max_num_seqs=3)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    got = []
    for wave in (prompts[:5], prompts[5:]):
        ids = [eng.add_request({"prompt_token_ids": p}, params) for p in wave]
        done = eng.run()
        got += [done[i].outputs[0].token_ids for i in ids]
    assert got == want
    assert eng.stats()["kv_connector"]["host_hit_tokens"] > 0
    _no_leak(eng)


class TinyStore(HostOffloadConnector):
    def __init__(self, layout, config):
        super().__init__(layout, config, capacity_blocks=3)


def test_a_full_host_store_evicts_and_never_fails_a_request(tiny_model):
    model, tok = tiny_model
    prompts = _prompts()
    eng = LLMEngine(model, tok, kv_connector=TinyStore, **SMALL)
    assert _one_by_one(eng, prompts) == _clean(model, tok, prompts)
    st = eng.stats()
    assert st["errors"] == 0 and st["kv_connector"]["host_evictions"] > 0
    assert st["kv_connector"]["host_blocks"] == 3
    _no_leak(eng)


def test_host_store_lru_keeps_the_most_recently_used():
    store = HostKVStore(KVLayout(1, 2, 1, 2, __import__("torch").float32), capacity=2)
    sa, sb = store.put(b"a"), store.put(b"b")
    assert sa != sb and store.put(b"a") == sa  # stored already: same slot, now most recent
    assert store.get(b"b") == sb  # b is the most recent now
    sc = store.put(b"c")  # full: a (least recently used) goes
    assert sc == sa and b"a" not in store and store.lru_order() == [b"b", b"c"] and store.num_evictions == 1


class FailingLoad(HostOffloadConnector):
    fail = True

    def start_load_kv(self, kv_cache):
        if FailingLoad.fail:
            FailingLoad.fail = False
            self._loads = []
            raise ConnectionError("planted: the host copy failed")
        super().start_load_kv(kv_cache)


def test_a_load_that_raises_frees_its_blocks_and_the_request_recomputes(tiny_model):
    model, tok = tiny_model
    prompts = _prompts()
    FailingLoad.fail = True
    eng = LLMEngine(model, tok, kv_offloading_size=0.01, kv_connector=FailingLoad, **SMALL)
    assert _one_by_one(eng, prompts) == _clean(model, tok, prompts)
    st = eng.stats()["kv_connector"]
    assert st["load_failures"] == 1 and "planted" in eng.connector.last_load_error
    assert st["host_hit_tokens"] == 7 * 40  # the one that failed recomputed its prefix
    _no_leak(eng)


class LacksSave:
    def __init__(self, layout, config): ...
    def get_num_new_matched_tokens(self, seq, n): return 0
    def update_state_after_alloc(self, seq, blocks, n): ...
    def request_finished(self, seq): ...
    def start_load_kv(self, kv_cache): ...


def test_a_connector_is_checked_like_every_other_part(tiny_model):
    model, tok = tiny_model
    with pytest.raises(TypeError, match="KV connector LacksSave has no `save_kv`"):
        LLMEngine(model, tok, kv_connector=LacksSave, **SMALL)
    assert isinstance(HostOffloadConnector(KVLayout(1, 2, 1, 2, __import__("torch").float32), capacity_blocks=1), KVConnector)
    with pytest.raises(ValueError, match="prefix caching on"):
        LLMEngine(model, tok, kv_offloading_size=0.01, enable_prefix_caching=False, **SMALL)
    with pytest.raises(ValueError, match="kv_offloading_size"):
        LLMEngine(model, tok, kv_offloading_size=0, **SMALL)
    with pytest.raises(ValueError, match="holds no KV block"):
        LLMEngine(model, tok, kv_offloading_size=1e-9, **SMALL)
    plain = LLMEngine(model, tok, **SMALL)
    assert plain.connector is None and "kv_connector" not in plain.plan.routes and "kv_connector" not in plain.stats()


def test_metrics_count_external_prefix_cache_hits_under_vllms_names(tiny_model):
    from minipaged.server.engine_loop import LoopStats, prefix_cache_counts
    from minipaged.server.metrics import ServerMetrics, parse_metrics

    model, tok = tiny_model
    eng = LLMEngine(model, tok, kv_offloading_size=0.01, **SMALL)
    _one_by_one(eng, _prompts(n=6))
    m = ServerMetrics("tiny")
    m.on_step(LoopStats(num_blocks=10, extra=prefix_cache_counts(eng)))
    got = parse_metrics(m.render()[0].decode())
    assert got["vllm:external_prefix_cache_hits_total"] == eng.connector.tiers["external_hits"] == 2 * 40
    assert got["vllm:external_prefix_cache_queries_total"] == eng.connector.tiers["external_queries"] > 0


def test_llm_and_serve_take_the_host_tier_size(tiny_model):
    import argparse

    from minipaged.llm import LLM
    from minipaged.server.cli import add_serve_parser, engine_kwargs

    model, tok = tiny_model
    llm = LLM(model, tok, kv_offloading_size=0.01, **SMALL)
    assert isinstance(llm.engine.connector.connector, HostOffloadConnector)
    ap = argparse.ArgumentParser()
    add_serve_parser(ap.add_subparsers(dest="cmd"))
    args = ap.parse_args(["serve", "--kv-offloading-size", "0.5"])
    assert engine_kwargs(args)["kv_offloading_size"] == 0.5


def test_bench_offload_reports_both_runs_with_the_same_tokens(tiny_model):
    from minipaged.bench.offload import bench_offload, format_offload

    model, tok = tiny_model
    rng = random.Random(0)
    docs = [[rng.randrange(3, 500) for _ in range(40)] for _ in range(3)]
    reqs = [(c, t, docs[c] + [7, 8, 9] * (t + 1)) for t in range(2) for c in range(3)]
    r = bench_offload(model, tok, block_size=8, offload_gib=0.01, requests=reqs)
    assert r["same_tokens"] and r["workload"]["device_blocks"] * 8 < 3 * 40
    # turn 2 of each conversation finds its 5 document blocks in the host store, not the device pool
    assert r["on"]["kv_connector"]["host_hit_tokens"] == 3 * 40 and r["off"]["prefix_hit_tokens"] == 0
    assert r["off"]["prompt_tokens_computed"] - r["on"]["prompt_tokens_computed"] == 3 * 40
    assert "host store" in format_offload(r)


def test_eight_bit_pages_with_a_connector_are_refused_saying_why() -> None:
    """A connector copies pages without the 8-bit scales stored beside them: the config refuses the pair."""
    from minipaged.config import EngineConfig

    for fields in ({"kv_offloading_size": 0.1}, {"kv_transfer_config": {"kv_connector": "TorchDistributedConnector",
                                                                           "kv_role": "kv_both"}}):
        for dtype in ("int8", "fp8"):
            with pytest.raises(ValueError, match="kv_cache_dtype='auto' with the connector"):
                EngineConfig(kv_cache_dtype=dtype, **fields)
        EngineConfig(kv_cache_dtype="auto", **fields)
