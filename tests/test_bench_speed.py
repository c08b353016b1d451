"""`bench speed` and `bench profile`: their arithmetic, their verdicts and their timers, on a tiny model.

Speeds are not asserted here (they belong to the benches' output); what is asserted is that
the figures are computed by the stated rules and that the profiler leaves the engine as it was.
"""
from __future__ import annotations

import time

import pytest
import torch

from minipaged.bench import profile as prof
from minipaged.bench import speed
from minipaged.bench.commands import main as bench_main
from minipaged.bench.workloads import Request


def test_weights_and_flops_follow_the_stated_rule(tiny_model):
    model, _ = tiny_model
    cfg = model.config
    w = speed.model_weights(model)
    layers = sum(p.numel() for p in model.layers.parameters()) + model.norm.weight.numel()
    assert w == {"body": layers, "lm_head": cfg.vocab_size * cfg.hidden_size}
    reqs = [Request([1] * 10, 4), Request([1] * 3, 7)]
    # body: prompt + output - 1 tokens; head: output tokens only
    want = 2 * (w["body"] * ((10 + 4 - 1) + (3 + 7 - 1)) + w["lm_head"] * (4 + 7))
    assert speed.workload_flops(model, reqs) == want


def test_gemm_rate_is_a_positive_rate():
    assert speed.gemm_rate(n=64, seconds=0.05) > 1e6


def _res(mp=300.0, hf=100.0, ceil=400.0, b1=40.0, lc=50.0) -> dict:
    return {"systems": {"minipaged": {"output_tokens_per_s": mp}, "transformers": {"output_tokens_per_s": hf, "batch_size": 64},
                        "minipaged_batch1": {"output_tokens_per_s": b1}, "llama_cpp_batch1": {"output_tokens_per_s": lc}},
            "ceiling": {"tokens_per_s": ceil}}


def test_the_median_run_is_reported_with_every_run_beside_it():
    runs = [{"output_tokens_per_s": v, "seconds": 1.0 / v, "output_tokens": 1} for v in (30.0, 10.0, 20.0)]
    med = speed._median_run(runs)
    assert med["output_tokens_per_s"] == 20.0 and med["runs_tokens_per_s"] == [30.0, 10.0, 20.0]
    assert speed._median_run(runs[:2])["output_tokens_per_s"] == 10.0  # even count: the lower middle, not a flattering pick
    res = _res()
    res.update(ratios=speed.ratios(res), workload={"description": "test"})
    res["ceiling"]["gemm_gflops"] = 1.0
    for name in res["systems"]:
        res["systems"][name].update(output_tokens=1, seconds=1.0)
    res["systems"]["minipaged"]["runs_tokens_per_s"] = [290.0, 300.0, 310.0]
    assert "median of 3 runs: 290.0, 300.0, 310.0" in speed.format_summary(res)
    with pytest.raises(ValueError, match="repeats must be an int >= 1"):
        speed.run_speed(repeats=0)


def test_ratios_and_each_goal_verdict():
    r = speed.ratios(_res())
    assert r["x_transformers"] == pytest.approx(3.0) and r["fraction_of_ceiling"] == pytest.approx(0.75)
    assert r["llama_cpp_batch1_slowdown"] == pytest.approx(1.25)
    assert r["goals_met"] == {"x_transformers": True, "fraction_of_ceiling": True, "llama_cpp_batch1": True}
    # each goal fails on its own breach only
    assert speed.ratios(_res(hf=160.0))["goals_met"] == {"x_transformers": False, "fraction_of_ceiling": True, "llama_cpp_batch1": True}
    assert speed.ratios(_res(ceil=600.0))["goals_met"] == {"x_transformers": True, "fraction_of_ceiling": False, "llama_cpp_batch1": True}
    assert speed.ratios(_res(lc=70.0))["goals_met"] == {"x_transformers": True, "fraction_of_ceiling": True, "llama_cpp_batch1": False}


def test_a_skipped_system_gives_no_ratio_and_no_verdict():
    res = _res()
    res["systems"]["llama_cpp_batch1"] = {"skipped": "llama-cpp-python is not installed"}
    r = speed.ratios(res)
    assert "llama_cpp_batch1_slowdown" not in r and "llama_cpp_batch1" not in r["goals_met"]
    res["ratios"] = r
    res["workload"] = {"description": "test"}
    res["ceiling"]["gemm_gflops"] = 1.0
    for name in res["systems"]:
        res["systems"][name].setdefault("output_tokens", 1)
        res["systems"][name].setdefault("seconds", 1.0)
    assert "llama_cpp_batch1   skipped: llama-cpp-python is not installed" in speed.format_summary(res)
    assert "memory-bound" not in speed.format_summary(res)
    res["batch1_bound"] = {"read_gbps": 20.0, "fp32_weight_bytes": 500e6, "fp32_tokens_per_s": 40.0,
                           "gguf_bytes": 100e6, "gguf_tokens_per_s": 200.0,
                           "minipaged_reads": "GGUF blocks (integers + fp32 scales)", "minipaged_weight_bytes": 125e6}
    line = speed.format_summary(res).splitlines()[-1]
    assert line == ("batch 1 is memory-bound: 20.0 GB/s read / 125 MB of weights (GGUF blocks (integers + fp32 scales)) "
                    "= at most 160 tok/s for minipaged (with the fp32 copies: 40); "
                    "llama.cpp reads 100 MB of quantized weights: at most 200 tok/s"), line


def test_on_amx_tiles_the_summary_says_the_fp32_ceiling_does_not_bound_minipaged():
    res = _res(mp=500.0)
    res.update(ratios=speed.ratios(res), workload={"description": "test"})
    res["ceiling"]["gemm_gflops"] = 1.0
    for name in res["systems"]:
        res["systems"][name].update(output_tokens=1, seconds=1.0)
    note = "its GGUF matmul ran on AMX tiles"
    for kernel, shown in (("AMX tiles", True), ("AVX-512", False), (None, False)):
        res["machine"] = {"gguf_matmul": kernel}
        assert (note in speed.format_summary(res)) is shown, kernel
    assert speed.gguf_matmul_kernel() in ("AMX tiles", "AVX-512", "portable loop", "none")


def test_the_gguf_matmul_gain_is_minipaged_over_its_fp32_run():
    res = {"systems": {"minipaged": {"output_tokens_per_s": 600.0}, "minipaged_fp32": {"output_tokens_per_s": 480.0}},
           "ceiling": {"tokens_per_s": 1000.0}}
    assert speed.ratios(res)["gguf_matmul_gain"] == pytest.approx(1.25)
    del res["systems"]["minipaged_fp32"]
    assert "gguf_matmul_gain" not in speed.ratios(res)


def test_timers_count_nested_time_once():
    t = prof.Timers()
    inner = t.wrap("inner", lambda: time.sleep(0.02))

    def outer_body():
        time.sleep(0.01)
        inner()

    t.wrap("outer", outer_body)()
    assert t.seconds["inner"] >= 0.02
    assert 0.01 <= t.seconds["outer"] < 0.02 + 0.01, t.seconds  # the inner call's 20 ms are not the outer's
    assert t.calls == {"inner": 1, "outer": 1}


def test_profile_engine_accounts_for_every_step_and_restores_the_engine(tiny_model):
    model, tok = tiny_model
    reqs = [Request(tok.encode("hello there, how are you"), 6) for _ in range(3)]
    r = prof.profile_engine(model, tok, reqs, max_num_seqs=3, max_num_batched_tokens=64, attention="torch")
    assert set(r["share"]) == set(prof.CATEGORIES)
    assert sum(r["share"].values()) == pytest.approx(1.0, abs=1e-6)
    for cat in ("linear layers", "attention", "LM head", "sampling", "scheduler", "runner", "detokenizing"):
        assert r["seconds"][cat] > 0, f"{cat} was never timed: {r['calls']}"
    assert r["calls"]["LM head"] == r["steps"]  # one head matmul per step, over the sampling rows only
    assert r["calls"]["detokenizing"] > 0
    # nothing of the profiler is left behind
    assert "decode" not in vars(tok)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_markdown_table_has_every_category_and_batch():
    runs = [{"batch": b, "share": {c: 1 / len(prof.CATEGORIES) for c in prof.CATEGORIES}, "step_seconds": 1.0, "steps": 10,
             "output_tokens_per_s": 5.0} for b in (1, 16)]
    md = prof.format_markdown({"runs": runs})
    lines = md.splitlines()
    assert lines[0] == "| share of step time | batch 1 | batch 16 |"
    assert all(any(line.startswith(f"| {c} |") for line in lines) for c in prof.CATEGORIES)
    assert "| ms per step, timed | 100.0 | 100.0 |" in lines
    assert not any(line.startswith("| ms per step, untimed") for line in lines)  # no untimed run given
    for r, ms in zip(runs, (40.0, 60.0)):
        r["untimed"] = {"ms_per_step": ms, "output_tokens_per_s": 7.0}
    lines = prof.format_markdown({"runs": runs}).splitlines()
    assert "| ms per step, untimed | 40.0 | 60.0 |" in lines and "| output tok/s, untimed | 7.0 | 7.0 |" in lines


def test_the_untimed_run_serves_every_token(tiny_model):
    model, tok = tiny_model
    reqs = [Request(tok.encode("hello there, how are you"), 6) for _ in range(3)]
    u = prof.untimed_steps(model, tok, reqs, max_num_seqs=3, max_num_batched_tokens=64, attention="torch")
    assert u["steps"] >= 6 and u["ms_per_step"] == pytest.approx(u["wall_seconds"] / u["steps"] * 1e3)
    assert u["output_tokens_per_s"] == pytest.approx(18 / u["wall_seconds"])


@pytest.mark.parametrize("argv, msg", [(["--batches", "1,x"], "comma-separated integers"), (["--batches", "0"], "at least one size"),
                                       (["--threads", "0"], "--threads must be >= 1")])
def test_profile_cli_refuses_bad_arguments(argv, msg, capsys):
    with pytest.raises(SystemExit):
        bench_main(["profile", *argv])
    assert msg in capsys.readouterr().err


@pytest.mark.parametrize("argv, msg", [(["--num-requests", "0"], "--num-requests must be >= 1"),
                                       (["--systems", "minipaged,vllm"], "unknown system(s) ['vllm']")])
def test_speed_cli_refuses_bad_arguments(argv, msg, capsys):
    with pytest.raises(SystemExit):
        bench_main(["speed", *argv])
    assert msg in capsys.readouterr().err


def test_a_failing_llama_cpp_run_is_reported_not_fatal(tmp_path):
    """llama.cpp runs in a child process: its failure (here: no such file) becomes a 'skipped' entry."""
    d = speed.run_batch1_llama_cpp(tmp_path / "missing.gguf", [Request([1, 2], 4)], threads=1, timeout_s=120)
    assert "output_tokens_per_s" not in d and "exit status 1" in d["skipped"]
    with pytest.raises(ValueError, match="one max_tokens"):
        speed.run_batch1_llama_cpp(tmp_path / "missing.gguf", [Request([1], 4), Request([1], 5)], threads=1)


def test_both_systems_run_the_same_requests_to_the_same_length(tiny_model):
    from conftest import tiny_hf_model

    model, tok = tiny_model
    reqs = [Request(tok.encode("hello there"), 5), Request(tok.encode("a longer prompt than that one"), 5)]
    mp = speed.run_minipaged(model, tok, reqs, max_num_seqs=2, max_num_batched_tokens=64, attention="torch")
    assert mp["output_tokens"] == 10 and [len(t) for t in mp["token_ids"]] == [5, 5]
    hf = speed.run_transformers(tiny_hf_model(), reqs, batch_size=2)
    assert hf["output_tokens"] == 10 and hf["batch_size"] == 2 and hf["output_tokens_per_s"] > 0


@pytest.mark.parametrize("argv, msg", [(["bench", "speed", "--batch-size", "0"], "--batch-size must be >= 1"),
                                       (["bench", "profile", "--batches", ""], "at least one size")])
def test_the_cli_reaches_both_benches(argv, msg, capsys):
    from minipaged.cli import main

    with pytest.raises(SystemExit):
        main(argv)
    assert msg in capsys.readouterr().err
