"""The benchmark harness: same work for every system, memory read from allocator state, JSON and plots."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minipaged.baselines import ContiguousTable, run_naive, run_static
from minipaged.block_allocator import BlockAllocator
from minipaged.parts import check_pool
from minipaged.bench.serving import format_table, gemm_gflops, run_bench, save_plots, to_json
from minipaged.bench.workloads import synthetic

ROOT = Path(__file__).resolve().parents[1]


def test_workloads_are_seeded_and_shaped():
    a, b = synthetic("sharegpt", 64, seed=3), synthetic("sharegpt", 64, seed=3)
    assert [r.max_tokens for r in a.requests] == [r.max_tokens for r in b.requests]
    assert [r.max_tokens for r in a.requests] != [r.max_tokens for r in synthetic("sharegpt", 64, seed=4).requests]
    out = sorted(r.max_tokens for r in a.requests)
    assert out[-1] > 2 * out[len(out) // 2], "ShareGPT-like outputs should be long-tailed"
    alp = synthetic("alpaca", 64, seed=3).summary()
    assert alp["output_len"]["mean"] < a.summary()["output_len"]["mean"]
    fx = synthetic("fixed", 5, fixed=(7, 9))
    assert {(len(r.prompt_token_ids), r.max_tokens) for r in fx.requests} == {(7, 9)}
    with pytest.raises(ValueError, match="unknown workload"):
        synthetic("nope")


def test_contiguous_table_reserves_up_front():
    alloc = BlockAllocator(10, 4)
    t = ContiguousTable(alloc, 17)
    assert len(t.blocks) == 5 and alloc.num_free_blocks == 5 and t.num_tokens == 0
    t.append_tokens(3)
    assert len(t.blocks) * t.block_size == 20 and int(t.slot_mapping(2, 3)) == t.blocks[0] * 4 + 2
    with pytest.raises(ValueError, match="cannot hold"):
        t.append_tokens(18)
    t.free()
    check_pool(alloc)
    assert alloc.num_free_blocks == 10


def test_static_and_naive_give_the_engines_greedy_tokens(tiny_model):
    model, _ = tiny_model
    from minipaged.engine import LLMEngine
    from minipaged.sampling import SamplingParams

    reqs = [([5, 6, 7], 4), ([9] * 11, 7), ([3, 4], 2)]
    eng = LLMEngine(model, None)
    ids = [eng.add_request(p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)) for p, n in reqs]
    done = eng.run()
    want = {i: done[r].token_ids for i, r in enumerate(ids)}
    st = run_static(model, reqs, batch_size=2, reserve_len=32, block_size=4)
    nv = run_naive(model, reqs, reserve_len=32, block_size=4)
    assert st.outputs == want and nv.outputs == want
    # static batching holds every slot until the batch's longest member ends
    tl = {iv["request"]: iv for iv in st.trace.timeline()}
    assert tl[0]["end"] == tl[1]["end"] and tl[0]["finish"] < tl[0]["end"]
    assert st.trace.peak_concurrency == 2 and nv.trace.peak_concurrency == 1
    assert 0.5 < st.trace.kv_waste() < 1


def test_run_bench_tiny(tiny_model, tmp_path):
    model, _ = tiny_model
    res = run_bench(quick=True, model=model, systems=("naive", "static", "continuous"), num_requests=12, max_output=24, progress=False)
    S = res["systems"]
    for name in ("naive", "static", "continuous"):
        for key in ("output_tokens_per_s", "kv_waste", "peak_concurrent_seqs", "latency_p99_s", "ttft_p50_s"):
            assert key in S[name], (name, key)
        assert S[name]["output_tokens_per_s"] > 0
    assert S["continuous"]["kv_waste"] < S["static"]["kv_waste"], "paging should waste less than max-length reservation"
    assert S["continuous"]["peak_concurrent_seqs"] > S["static"]["peak_concurrent_seqs"], "the same memory should hold more sequences"
    assert res["concurrency_ratio"] > 1 and "description" in res["workload"]
    js = to_json(res)
    json.dumps(js)
    assert set(js["timelines"]) == {"naive", "static", "continuous"}
    table = format_table(res)
    assert "continuous" in table and "KV waste" in table
    paths = save_plots(res, tmp_path)
    assert {p.name for p in paths} >= {"throughput.png", "timeline.png", "kv_usage.png", "page_table.png"}
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in paths)


def test_gemm_rate_is_measured():
    assert gemm_gflops(n=128, repeats=2) > 0.1


@pytest.mark.slow
def test_bench_cli_json(tmp_path, smollm2_path):
    out = tmp_path / "b.json"
    r = subprocess.run(
        [sys.executable, "-m", "minipaged", "bench", "--num-requests", "4", "--naive-requests", "1", "--static-batch", "2",
         "--max-output", "6", "--systems", "naive,static,continuous", "--no-progress", "--json", str(out)],
        capture_output=True, text=True, timeout=600,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    d = json.loads(out.read_text())
    assert set(d["systems"]) == {"naive", "static", "continuous"}
    assert all(0 <= d["systems"][s]["kv_waste"] < 1 for s in d["systems"])
    assert "KV waste" in r.stdout and "compute-bound" in r.stdout


def test_readme_generated_blocks_are_current():
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "update_readme.py"), "--check"], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
