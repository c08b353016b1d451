"""The benchmark harness: one workload and one KV budget for every system, the same greedy tokens
from all of them, each batching policy and memory layout doing what it says, attribution and the
online sweep computed from what was measured, and the machine's ceilings measured the right way."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minipaged import parts
from minipaged.bench import hardware
from minipaged.bench.baselines import (
    FACTORIAL, ContiguousBlockTable, contiguous_table, run_naive, run_static, run_system, serve, build_engine,
)
from minipaged.bench.serving import (
    ATTRIBUTION, attribution, compare_tokens, format_online, format_table, poisson_arrivals, run_bench, save_plots, to_json,
)
from minipaged.bench.workloads import synthetic
from minipaged.block_allocator import BlockAllocator, OutOfBlocksError

ROOT = Path(__file__).resolve().parents[1]
# prompt, output: long-tailed outputs, so contiguous reservations waste and static batches idle
REQS = [([5 + i % 7] * (3 + (i * 5) % 11), n) for i, n in enumerate([3, 20, 4, 6, 18, 2, 5, 9, 3, 16])]
RESERVE = max(len(p) for p, _ in REQS) + max(n for _, n in REQS)  # 33 tokens
BLOCKS = 3 * parts.cdiv(RESERVE, 4)  # three contiguous reservations of blocks of 4


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


def test_prompt_and_output_scale_separately_and_keep_the_tail():
    base = synthetic("sharegpt", 400, seed=1, max_prompt=4000, max_output=4000)
    s = synthetic("sharegpt", 400, seed=1, max_prompt=4000, max_output=4000, prompt_scale=2.0, output_scale=0.5)
    assert s.summary()["prompt_len"]["p50"] == pytest.approx(2 * base.summary()["prompt_len"]["p50"], rel=0.1)
    assert s.summary()["output_len"]["p50"] == pytest.approx(0.5 * base.summary()["output_len"]["p50"], rel=0.1)
    outs = sorted(r.max_tokens for r in s.requests)
    assert outs[-1] > 4 * outs[len(outs) // 2], "scaling keeps the long tail"
    assert "x 2" in s.description and "x 0.5" in s.description, "the description states the scaling"
    with pytest.raises(ValueError, match="output_scale"):
        synthetic("sharegpt", 4, output_scale=0)


def test_contiguous_table_reserves_up_front():
    alloc = BlockAllocator(10, 4)
    t = contiguous_table(17)(alloc)
    assert isinstance(t, ContiguousBlockTable) and t.blocks_needed(3) == 5, "the first append takes the whole reservation"
    assert t.append_tokens(3) == t.blocks and len(t.blocks) == 5 and alloc.num_free_blocks == 5
    assert t.blocks_needed(14) == 0 and t.append_tokens(14) == [], "growth inside the reservation takes no block"
    assert t.slot_mapping(16, 17).tolist() == [t.blocks[4] * 4]
    with pytest.raises(ValueError, match="cannot hold"):
        t.blocks_needed(1)
    t.free()
    parts.check_pool(alloc)
    assert alloc.num_free_blocks == 10
    # all or nothing: a reservation larger than what is free takes nothing
    big = contiguous_table(48)(alloc)
    with pytest.raises(OutOfBlocksError):
        big.append_tokens(1)
    assert alloc.num_free_blocks == 10 and big.blocks == []
    with pytest.raises(ValueError, match="reserve_tokens"):
        contiguous_table(0)


@pytest.fixture(scope="module")
def runs(tiny_model):
    model, _ = tiny_model
    kw = dict(num_blocks=BLOCKS, reserve_tokens=RESERVE, block_size=4, max_num_seqs=len(REQS), max_num_batched_tokens=64)
    return {name: run_system(model, name, REQS, **kw) for name in ("naive", *FACTORIAL)}


def test_every_system_gives_the_engines_greedy_tokens(tiny_model, runs):
    model, _ = tiny_model
    from minipaged.engine import LLMEngine
    from minipaged.sampling import SamplingParams

    eng = LLMEngine(model, None, num_blocks=200, block_size=4)
    ids = [eng.add_request(p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)) for p, n in REQS]
    done = eng.run()
    want = {i: done[r].token_ids for i, r in enumerate(ids)}
    for name, res in runs.items():
        assert res.outputs == want, f"{name} produced other greedy tokens than one plain engine run"
    cmp = compare_tokens({k: r.outputs for k, r in runs.items()}, "naive")
    assert all(v["equal"] == v["compared"] == len(REQS) for v in cmp.values())
    bad = dict(runs["naive"].outputs)
    bad[3] = [0] * len(bad[3])
    assert compare_tokens({"naive": runs["naive"].outputs, "x": bad}, "naive")["x"] == {"compared": 10, "equal": 9, "first_different": 3}


def test_every_system_gets_the_same_kv_bytes(runs):
    pools = {(r.engine.allocator.num_blocks, r.engine.allocator.block_size) for r in runs.values()}
    assert pools == {(BLOCKS, 4)}, pools
    sizes = {sum(t.numel() * t.element_size() for t in vars(r.engine.kv_cache).values() if torch.is_tensor(t))
             for r in runs.values() if hasattr(r.engine, "kv_cache")}
    assert len(sizes) <= 1, f"the KV caches differ in bytes: {sizes}"


def test_static_batches_drain_before_the_next_starts(runs):
    for name in ("static_contiguous", "static_paged"):
        res = runs[name]
        assert sorted(i for b in res.batches for i in b) == list(range(len(REQS)))
        for a, b in zip(res.batches, res.batches[1:]):
            assert max(res.finish[i] for i in a) <= min(res.first_token[i] for i in b), f"{name}: a batch started early"
    # the contiguous layout fits 3 reservations; paging fits more of these short requests at once
    assert max(len(b) for b in runs["static_contiguous"].batches) == 3
    assert len(runs["static_paged"].batches) < len(runs["static_contiguous"].batches)


def test_continuous_refills_and_the_layouts_limit_concurrency(runs):
    cc, cp = runs["continuous_contiguous"], runs["continuous_paged"]
    assert not cc.batches and not cp.batches
    assert cc.trace.peak_concurrency == 3, "three contiguous reservations: never more than 3 at once"
    assert cp.trace.peak_concurrency > 3, "pages fit more sequences in the same blocks"
    # refilling: some request starts while an earlier one is still running
    assert any(cc.first_token[j] < cc.finish[i] for i in range(3) for j in range(3, len(REQS)))
    assert cc.engine.scheduler.num_preemptions == 0, "a contiguous reservation never grows, so never preempts"
    waste = {k: r.trace.kv_waste() for k, r in runs.items()}
    assert waste["continuous_paged"] < waste["continuous_contiguous"] and waste["static_paged"] < waste["static_contiguous"]


def test_run_static_and_naive_keep_their_lesson_api(tiny_model, runs):
    model, _ = tiny_model
    st = run_static(model, REQS[:4], batch_size=2, reserve_len=RESERVE, block_size=4)
    nv = run_naive(model, REQS[:4], reserve_len=RESERVE, block_size=4)
    want = {i: runs["naive"].outputs[i] for i in range(4)}
    assert st.outputs == want and nv.outputs == want and st.seconds > 0
    assert st.trace.peak_concurrency == 2 and nv.trace.peak_concurrency == 1
    assert 0.3 < st.trace.kv_waste() < 1


def test_serve_respects_arrivals_and_refuses_bad_input(tiny_model):
    model, _ = tiny_model
    arr = [0.0, 0.0, 5.0, 5.0]
    eng = build_engine(model, "paged", 40, RESERVE, block_size=4)
    res = serve(eng, REQS[:4], arrivals=arr)
    for i, a in enumerate(arr):
        assert res.first_token[i] > a and res.arrival[i] == a
    assert res.seconds > 5.0 > res.busy_seconds, "the idle gap is skipped on the virtual clock, not slept"
    with pytest.raises(ValueError, match="one per request"):
        serve(build_engine(model, "paged", 40, RESERVE, block_size=4), REQS[:2], arrivals=[0.0])
    with pytest.raises(ValueError, match="policy"):
        serve(build_engine(model, "paged", 40, RESERVE, block_size=4), REQS[:2], policy="fifo")
    with pytest.raises(ValueError, match="batch_capacity"):
        serve(build_engine(model, "paged", 40, RESERVE, block_size=4), REQS[:2], policy="static")
    with pytest.raises(ValueError, match="unknown system"):
        run_system(model, "dynamic_paged", REQS[:2], 40, RESERVE)
    with pytest.raises(ValueError, match="does not fit"):
        run_system(model, "static_contiguous", REQS[:2], 2, RESERVE, block_size=4)


def test_poisson_arrivals_are_seeded_and_at_the_rate():
    a = poisson_arrivals(4000, rate=20.0, seed=1)
    assert a == poisson_arrivals(4000, rate=20.0, seed=1) and a[0] == 0.0
    assert all(x <= y for x, y in zip(a, a[1:]))
    assert (len(a) - 1) / a[-1] == pytest.approx(20.0, rel=0.08)
    with pytest.raises(ValueError, match="rate"):
        poisson_arrivals(3, 0)
    assert poisson_arrivals(0, 1.0) == [] and poisson_arrivals(1, 1.0) == [0.0]


def test_one_arrival_process_serves_the_sweep_the_load_generator_and_the_simulated_gpu():
    from minipaged.bench import gpu, serve

    assert gpu.poisson_arrivals is poisson_arrivals
    assert serve.arrival_times(50, 3.0, "poisson", seed=4) == poisson_arrivals(50, 3.0, seed=4)


def test_attribution_is_the_ratio_of_the_cells():
    S = {n: {"output_tokens_per_s": v} for n, v in zip(FACTORIAL, (10.0, 20.0, 15.0, 60.0))}
    att = attribution(S)
    assert set(att) == set(ATTRIBUTION)
    assert att["paging_at_static"]["ratio"] == 2.0 and att["refill_at_contiguous"]["ratio"] == 1.5
    assert att["refill_at_paged"]["ratio"] == 3.0 and att["paging_at_continuous"]["ratio"] == 4.0
    assert att["both"]["ratio"] == pytest.approx(att["paging_at_static"]["ratio"] * att["refill_at_paged"]["ratio"])
    assert "paging_at_static" not in attribution({"static_paged": S["static_paged"]})


def test_run_bench_tiny(tiny_model, tmp_path):
    model, _ = tiny_model
    res = run_bench(quick=True, model=model, systems=("naive", *FACTORIAL), num_requests=10, max_output=20, naive_requests=4,
                    online_requests=4, rate_factors=(0.5, 4.0), roofline_batches=(1, 8), progress=False)
    S = res["systems"]
    for name in ("naive", *FACTORIAL):
        for key in ("output_tokens_per_s", "kv_waste", "peak_concurrent_seqs", "latency_p99_s", "ttft_p50_s", "tpot_p50_s", "kv_blocks"):
            assert S[name].get(key) is not None, (name, key)
    assert {S[n]["kv_blocks"] for n in S} == {res["kv_budget"]["blocks"]}
    assert S["continuous_paged"]["kv_waste"] < S["static_contiguous"]["kv_waste"], "paging should waste less than max-length reservation"
    assert "extrapolated" in S["naive"]["latency_note"] and "served 4 of the 10" in S["naive"]["note"]
    assert set(res["attribution"]) == set(ATTRIBUTION)
    assert res["attribution"]["both"]["ratio"] == pytest.approx(
        S["continuous_paged"]["output_tokens_per_s"] / S["static_contiguous"]["output_tokens_per_s"])
    tok = res["tokens"]["systems"]
    assert all(v["compared"] >= 4 and v["equal"] == v["compared"] for v in tok.values()), tok
    on = res["online"]
    assert set(on["systems"]) == set(FACTORIAL) and len(on["rates_per_s"]) == 2
    for rows in on["systems"].values():
        for d in rows:
            # goodput over the offered window (requests / rate): the rate times the fraction that met the SLO
            assert 0 <= d["goodput_req_per_s"] <= d["rate_per_s"]
            assert d["goodput_req_per_s"] == pytest.approx(d["rate_per_s"] * d["slo_fraction"])
            assert d["offered_window_s"] == pytest.approx(on["num_requests"] / d["rate_per_s"])
            assert d["ttft_p50_s"] <= d["ttft_p99_s"] and d["tpot_p50_s"] <= d["tpot_p99_s"]
    assert on["slo"]["ttft_s"] > 0 and "naive" in on["slo"]["rule"]
    assert res["shared_prefix"] == {"measured": False, "why": "not part of this run (the full bench measures it)"}
    js = to_json(res)
    json.dumps(js)
    assert set(js["timelines"]) == {"naive", *FACTORIAL}
    table = format_table(res)
    assert "continuous_paged" in table and "KV waste" in table and "TPOT" in format_online(res)
    assert "offered window" in format_online(res)
    paths = save_plots(res, tmp_path)
    assert {p.name for p in paths} >= {"throughput.png", "attribution.png", "online.png", "roofline.png", "timeline.png",
                                       "kv_usage.png", "page_table.png"}
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in paths)
    with pytest.raises(ValueError, match="unknown system"):
        run_bench(quick=True, model=model, systems=("continuous",), progress=False)


def test_online_goodput_is_over_the_offered_window_also_for_older_json():
    from minipaged.bench.serving import format_online, offered_goodput

    # An older bench JSON divided by the run's length: 2 good requests in 3.49 s read 0.573 req/s at 9.69 offered.
    old = {"rate_per_s": 9.69, "goodput_req_per_s": 2 / 3.49, "seconds": 3.49}
    assert offered_goodput(old, 16) == pytest.approx(2 * 9.69 / 16)
    # ... and 16 good requests in a short run read more than the offered rate; over the window it is the rate.
    fast = {"rate_per_s": 1.2, "goodput_req_per_s": 16 / 9.0, "seconds": 9.0}
    assert offered_goodput(fast, 16) == pytest.approx(1.2)
    new = {"rate_per_s": 2.0, "goodput_req_per_s": 1.5, "slo_fraction": 0.75, "seconds": 9.0}
    assert offered_goodput(new, 16) == 1.5
    row = dict(fast, output_tokens_per_s=1.0, ttft_p50_s=0.1, ttft_p99_s=0.2, tpot_p50_s=0.01, tpot_p99_s=0.02)
    text = format_online({"online": {"num_requests": 16, "slo": {"ttft_s": 1.0, "tpot_s": 0.1, "rule": "r"},
                                     "systems": {"continuous_paged": [row]}}})
    assert "offered window" in text and text.splitlines()[-1].endswith("1.200")


def test_shared_prefix_place_and_measurement(tiny_model):
    from minipaged.bench.serving import measure_shared_prefix, shared_prefix_requests
    from minipaged.config import CONFIG_FIELDS

    model, _ = tiny_model
    reqs = shared_prefix_requests(4, 20, (3, 6), 5, 512, seed=1)
    assert len({tuple(p[:20]) for p, _ in reqs}) == 1 and len({tuple(p) for p, _ in reqs}) == 4
    d = measure_shared_prefix(model, 4, 0, num_requests=3, system_len=24, max_tokens=4)
    assert d["measured"] == ("enable_prefix_caching" in CONFIG_FIELDS)
    if not d["measured"]:
        assert "prefix caching" in d["why"]
    # the measurement path, with two identical settings standing in for off and on
    m = measure_shared_prefix(model, 4, 0, num_requests=3, system_len=24, max_tokens=4, settings=({}, {}))
    assert m["measured"] and m["greedy_tokens_equal"] and m["off"]["num_requests"] == 2
    assert m["off"]["peak_blocks_used"] == m["on"]["peak_blocks_used"] > 0


def test_bandwidth_copies_into_a_preallocated_buffer(monkeypatch):
    def no_clone(*a, **k):
        raise AssertionError("bandwidth must not time clone(): it allocates pages inside the timing")

    monkeypatch.setattr(torch.Tensor, "clone", no_clone)
    bw = hardware.bandwidth(mib=8, repeats=2)
    assert bw["read_GBps"] > 0.1 and bw["copy_GBps"] > 0.1
    assert hardware.gemm_gflops(n=128, repeats=2) > 0.1


def test_roofline_arithmetic():
    assert hardware.predicted_compute_bound_batch(gflops=100.0, gbps=10.0, bytes_per_param=4) == 20.0
    assert hardware.predicted_compute_bound_batch(gflops=100.0, gbps=10.0, bytes_per_param=2) == 10.0
    assert hardware.decode_intensity(1000, 8, 4.0) == 4.0  # 2 * 8 flops per weight over 4 bytes
    assert hardware.decode_intensity(1000, 8, 4.0, kv_bytes_per_seq=500) < 4.0
    # a floor of 1 s, then 0.1 s per sequence: the knee is at 10
    b = [1, 2, 4, 8, 16, 32, 64]
    t = [max(1.0, 0.1 * x) for x in b]
    assert hardware.measured_knee(b, t) == pytest.approx(10.0, rel=0.05)
    assert hardware.measured_knee([1, 2, 4], [1.0, 1.0, 1.01]) is None, "still on the floor: no knee measured"


def test_roofline_of_a_model(tiny_model):
    model, _ = tiny_model
    rf = hardware.roofline(model, (1, 4), bw={"read_GBps": 10.0, "copy_GBps": 10.0, "buffer_mib": 1.0}, gflops=50.0, repeats=1)
    n = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert rf["linear_params"] >= n and rf["predicted_compute_bound_batch"] == 10.0
    assert [r["batch"] for r in rf["by_batch"]] == [1, 4] and all(r["seconds"] > 0 for r in rf["by_batch"])


@pytest.mark.slow
def test_bench_cli_json(tmp_path, smollm2_path):
    out = tmp_path / "b.json"
    r = subprocess.run(
        [sys.executable, "-m", "minipaged", "bench", "--num-requests", "4", "--naive-requests", "2", "--static-batch", "2",
         "--max-output", "6", "--online-requests", "2", "--rates", "1,4",
         "--systems", "naive,static_contiguous,static_paged,continuous_contiguous,continuous_paged",
         "--no-progress", "--json", str(out)],
        capture_output=True, text=True, timeout=900,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    d = json.loads(out.read_text())
    assert set(d["systems"]) == {"naive", *FACTORIAL}
    assert all(0 <= d["systems"][s]["kv_waste"] < 1 for s in d["systems"])
    assert set(d["attribution"]) == set(ATTRIBUTION) and set(d["online"]["systems"]) == set(FACTORIAL)
    assert "KV waste" in r.stdout and "compute-bound" in r.stdout and "what each idea buys" in r.stdout
    bad = subprocess.run([sys.executable, "-m", "minipaged", "bench", "--systems", "continuous"], capture_output=True, text=True)
    assert bad.returncode != 0 and "unknown system" in bad.stderr


def test_readme_generated_blocks_are_current():
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "update_readme.py"), "--check"], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_bench_can_serve_on_the_fp32_weights_only():
    """``minipaged bench --fp32-weights`` (run_bench(gguf_blocks=False)) and the bench's engine
    settings reach every engine it builds: each engine's plan says so, and each serves."""
    from minipaged.bench.baselines import run_system
    from test_gguf_blocks import gguf_model

    model = gguf_model()  # a model "loaded from a GGUF file", whose blocks an engine could use
    reqs = [([1, 2, 3, 4, 5], 3), ([6, 7, 8], 2)]
    res = run_system(model, "continuous_paged", reqs, num_blocks=8, reserve_tokens=16, gguf_blocks=False)
    assert res.engine.plan.refused["gguf_blocks"] == "gguf_blocks=False", res.engine.plan
    assert not res.engine.plan.routes["linear"].startswith("gguf")
    assert sum(len(o) for o in res.outputs.values()) == 5
    naive = run_system(model, "naive", reqs, num_blocks=8, reserve_tokens=16, gguf_blocks=False,
                       engine={"whole_step_decode": False})
    assert naive.engine.plan.refused["gguf_blocks"] == "gguf_blocks=False"
    assert naive.engine.plan.refused["whole_step_decode"] == "whole_step_decode=False"
    plain = run_system(model, "static_contiguous", reqs, num_blocks=8, reserve_tokens=16, engine={"fast_paths": False})
    assert set(plain.engine.plan.refused) == {"fast_paths"}
    assert plain.outputs == res.outputs == naive.outputs


def test_save_run_writes_the_figures_and_the_arguments_to_a_path_given_as_text(tmp_path):
    """Every `minipaged bench ...` command ends with save_run; argparse gives `--json` as text."""
    import argparse
    import json

    from minipaged.bench import save_run

    out = tmp_path / "sub" / "figures.json"
    save_run({"x": 1}, argparse.Namespace(json=str(out), rates="1,2"))
    saved = json.loads(out.read_text(encoding="utf-8"))
    assert saved == {"x": 1, "arguments": {"json": str(out), "rates": "1,2"}}
    save_run({"y": 2}, argparse.Namespace(json=None))  # no --json: nothing written, nothing raised


def test_text_table_aligns_every_row_and_off_on_rows_format_both_sides():
    """The one table helper the benches print with: the first column left, the others right, each
    column as wide as its widest cell (a cell wider than ``min_width`` widens its column, not just its
    row); the off-vs-on rows format both sides by the same spec."""
    from minipaged.bench import off_on_rows, text_table

    rows = [("", "off", "on"), *off_on_rows({"t": 0.5, "n": 7}, {"t": 0.25, "n": 1234567890123}, [("time (s)", "t", ".3f"),
                                                                                                   ("tokens", "n", "")])]
    assert rows[1:] == [("time (s)", "0.500", "0.250"), ("tokens", "7", "1234567890123")]
    lines = text_table(rows, min_width=5)
    assert len({len(line) for line in lines}) == 1, lines  # the 13-digit cell widened the whole column
    assert lines[2] == "tokens        7  1234567890123" and lines[0].startswith("        ")
    ruled = text_table(rows, rule=True)
    assert ruled[1] == "--------  -----  -------------" and ruled[0] == " " * 8 + "    off" + " " * 13 + "on"
