"""`minipaged bench serve`: arrivals, the report's arithmetic, and a run against a real server.

The load generator speaks only the OpenAI API, so the end-to-end test drives it at a
``minipaged serve`` child process (the tiny random model) exactly as it would drive vLLM.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from minipaged.bench.serve import Result, arrival_times, comparison_table, find_knee, make_requests, summarize

ROOT = Path(__file__).resolve().parent.parent
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
REPORT_FIELDS = ("num_requests", "completed", "failed", "duration_s", "request_throughput", "output_throughput",
                 "total_token_throughput", "ttft_ms", "tpot_ms", "itl_ms", "e2el_ms", "slo", "goodput", "goodput_fraction", "settings")


def test_arrivals_have_the_asked_shape():
    t = arrival_times(4000, 5.0, "poisson", seed=1)
    gaps = np.diff(t)
    assert len(t) == 4000 and t[0] == 0 and (gaps >= 0).all()
    assert abs(gaps.mean() - 0.2) < 0.02 and abs(gaps.std() - 0.2) < 0.03  # exponential: mean = std = 1/rate
    assert arrival_times(4000, 5.0, "poisson", seed=1) == t  # seeded
    assert arrival_times(4, 2.0, "constant") == [0.0, 0.5, 1.0, 1.5]
    assert arrival_times(7, 4.0, "burst", burst_size=3) == [0.0, 0.0, 0.0, 0.75, 0.75, 0.75, 1.5]
    assert arrival_times(3, math.inf) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="rate"):
        arrival_times(3, 0.0)
    with pytest.raises(ValueError, match="arrival"):
        arrival_times(3, 1.0, "gaussian")


def test_requests_follow_the_workload_lengths():
    reqs = make_requests("sharegpt-like", 64, seed=3, scale=0.5, max_output=64)
    assert len(reqs) == 64 and all(1 <= r.output_len <= 64 for r in reqs)
    assert all(len(r.prompt) == r.prompt_len for r in reqs) and len({r.prompt_len for r in reqs}) > 10
    fixed = make_requests("fixed", 3, fixed=(10, 5), prompt_format="text")
    assert all(r.prompt_len == 10 and r.output_len == 5 and isinstance(r.prompt, str) for r in fixed)
    with pytest.raises(ValueError, match="unknown dataset"):
        make_requests("imagenet", 3)


def test_summary_arithmetic_and_goodput():
    rs = [
        Result(ok=True, prompt_len=10, output_len=11, send=0.0, ttft=0.1, e2e=1.1, itl=[0.1] * 10),  # tpot 0.1
        Result(ok=True, prompt_len=10, output_len=11, send=0.5, ttft=0.5, e2e=3.5, itl=[0.3] * 10),  # tpot 0.3
        Result(ok=True, prompt_len=10, output_len=1, send=1.0, ttft=0.2, e2e=0.2),  # one token: no tpot
        Result(ok=False, error="HTTP 503: overloaded"),
    ]
    r = summarize(rs, duration=4.0, slo_ttft_ms=300, slo_tpot_ms=200)
    assert (r["completed"], r["failed"], r["errors"]) == (3, 1, {"HTTP 503: overloaded": 1})
    assert r["total_output_tokens"] == 23 and r["output_throughput"] == 23 / 4.0 and r["request_throughput"] == 0.75
    assert r["ttft_ms"]["p50"] == pytest.approx(200) and r["tpot_ms"]["mean"] == pytest.approx(200)
    assert r["itl_ms"]["mean"] == pytest.approx(200) and r["e2el_ms"]["p99"] == pytest.approx(np.percentile([1100, 3500, 200], 99))
    # goodput: requests 1 (ttft 100, tpot 100) and 3 (ttft 200, no tpot) meet the SLO; 2 misses both.
    # Without a rate (everything at once) there is no offered window: divided by the run's 4 s.
    assert r["goodput"] == pytest.approx(2 / 4.0) and r["goodput_fraction"] == pytest.approx(2 / 4)
    assert r["goodput_window"] == "run" and r["goodput_window_s"] == 4.0
    assert summarize(rs, 4.0, 300, 200, rate=float("inf"))["goodput_window"] == "run"
    # At 2 requests/s the 4 requests were offered over 4 / 2 = 2 s: goodput = 2 good / 2 s = the rate x the fraction.
    at2 = summarize(rs, duration=4.0, slo_ttft_ms=300, slo_tpot_ms=200, rate=2.0)
    assert at2["goodput_window"] == "offered" and at2["goodput_window_s"] == pytest.approx(2.0)
    assert at2["goodput"] == pytest.approx(2 / 2.0) == pytest.approx(2.0 * at2["goodput_fraction"])
    # A short run (the last end soon after the last arrival) no longer lifts goodput above the offered rate.
    quick = summarize(rs, duration=0.5, slo_ttft_ms=300, slo_tpot_ms=200, rate=2.0)
    assert quick["goodput"] == at2["goodput"] <= 2.0 and quick["request_throughput"] > 2.0


def test_goodput_never_exceeds_the_offered_rate():
    from minipaged.bench.serve import offered_window

    rng = np.random.default_rng(0)
    for rate in (0.5, 2.0, 8.0):
        for n in (1, 7, 40):
            rs = [Result(ok=True, prompt_len=4, output_len=5, send=float(i) / rate, ttft=float(rng.uniform(0, 0.4)),
                         e2e=0.5) for i in range(n)]
            r = summarize(rs, duration=float(rng.uniform(0.01, 10)), slo_ttft_ms=200, slo_tpot_ms=1000, rate=rate)
            assert 0 <= r["goodput"] <= rate and r["goodput"] == pytest.approx(rate * r["goodput_fraction"])
            assert r["goodput_window_s"] == pytest.approx(offered_window(n, rate)) == pytest.approx(n / rate)
            every = summarize(rs, duration=1.0, slo_ttft_ms=1e9, slo_tpot_ms=1e9, rate=rate)
            assert every["goodput"] == rate, "every request met the SLO: exactly the offered rate, not an ulp above"
    assert offered_window(5, float("inf")) is None and offered_window(5, None) is None and offered_window(0, 2.0) is None


def test_bootstrap_intervals_hold_the_estimate():
    from minipaged.bench.serve import intervals

    rng = np.random.default_rng(1)
    rs = [Result(ok=True, prompt_len=4, output_len=9, send=i / 2.0, ttft=float(t), e2e=float(t) + 0.8)
          for i, t in enumerate(rng.uniform(0.05, 0.5, 40))]
    rep = summarize(rs, duration=25.0, slo_ttft_ms=300, slo_tpot_ms=200, rate=2.0)
    rep["_results"] = rs
    iv = intervals(rep)
    lo, hi = iv["ttft_p50_ms"]
    assert lo <= rep["ttft_ms"]["p50"] <= hi and hi - lo < 200
    glo, ghi = iv["goodput"]
    assert 0 <= glo <= rep["goodput"] <= ghi <= 2.0, "resampled goodput stays within the offered rate"
    assert iv["tpot_p50_ms"] == pytest.approx((100.0, 100.0))
    assert intervals(rep) == iv, "seeded"


def test_comparison_table_leaves_missing_rows_to_others():
    rs = [Result(ok=True, prompt_len=4, output_len=3, send=0.0, ttft=0.1, e2e=0.3, itl=[0.1, 0.1])]
    rep = summarize(rs, 1.0, 2000, 200)
    rep["settings"] = {"dataset": "fixed", "rate": 2.0}
    table = comparison_table({"minipaged serve (CPU)": rep, "vllm serve (GPU)": None})
    lines = table.splitlines()
    assert len(lines) == 4 and "| minipaged serve (CPU) | 1/1 (fixed) | 2.0 | 3.0 | 100 / 100 | 100 | 300 |" in lines[2]
    assert "not measured here" in lines[3] and "GPU" in lines[3]


def test_knee_is_where_latency_leaves_its_floor():
    rep = lambda rate, p50: {"settings": {"rate": rate}, "ttft_ms": {"p50": p50}}  # noqa: E731
    assert find_knee([rep(0.5, 100), rep(1, 120), rep(2, 250), rep(4, 900)]) == 4
    assert find_knee([rep(0.5, 100), rep(1, 110)]) is None
    assert find_knee([rep(0.5, 700), rep(1, 200), rep(2, 650), rep(4, 900)]) == 2  # the floor is the lowest so far


@pytest.fixture(scope="module")
def server(tiny_hf_dir):
    pytest.importorskip("fastapi")
    from minipaged.server.launch import ServerProcess

    with ServerProcess(tiny_hf_dir, env={"PYTHONPATH": ENV["PYTHONPATH"]}, max_num_seqs=16, num_blocks=128, attention="torch") as srv:
        yield srv


def _bench(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """``minipaged bench serve ARGS`` through the command line's own entry point, in this process."""
    import contextlib
    import io

    from minipaged.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["bench", "serve", *args])
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


@pytest.mark.timeout(300)
def test_bench_serve_command_writes_the_report_and_plot(server, tmp_path):
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    r = _bench("--url", server.url, "--rate", "20", "--num-requests", "12", "--dataset", "sharegpt-like", "--scale", "0.2",
               "--max-prompt", "60", "--max-output", "16", "--vocab-size", "512", "--json", str(out), "--plot", str(png))
    assert r.returncode == 0, r.stdout + r.stderr
    rep = json.loads(out.read_text())
    for f in REPORT_FIELDS:
        assert f in rep, f"the report has no {f}"
    for f in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        assert set(rep[f]) == {"mean", "p50", "p90", "p99"} and rep[f]["p50"] > 0
    assert rep["completed"] == 12 and rep["failed"] == 0 and rep["settings"]["model"] == "tiny_llama0"
    # ignore_eos: the server generated exactly what was asked (no --seed: a fresh one, kept in the report)
    seed = rep["settings"]["seed"]
    assert isinstance(seed, int) and f"seed {seed}" in r.stdout
    asked = sum(x.output_len for x in make_requests("sharegpt-like", 12, seed, 512, 0.2, 60, 16))
    assert rep["total_output_tokens"] == asked
    assert png.stat().st_size > 10_000
    assert "TTFT" in r.stdout and "goodput" in r.stdout


@pytest.mark.timeout(300)
def test_bench_serve_is_bounded_in_time_and_counts_failures(server, tmp_path):
    out = tmp_path / "r.json"
    r = _bench("--url", server.url, "--rate", "4", "--arrival", "constant", "--num-requests", "1000", "--duration", "1.0",
               "--dataset", "fixed", "--input-len", "8", "--output-len", "4", "--vocab-size", "512", "--json", str(out), "--no-progress")
    assert r.returncode == 0, r.stderr
    rep = json.loads(out.read_text())
    assert rep["num_requests"] == 5, "with --duration 1 at 4 req/s, constant: requests at 0, .25, .5, .75, 1.0"
    assert rep["goodput_window"] == "offered" and rep["goodput_window_s"] == pytest.approx(5 / 4) and rep["goodput"] <= 4.0
    assert "over the offered window" in r.stdout
    bad = _bench("--url", server.url, "--model", "no-such-model", "--num-requests", "3", "--dataset", "fixed",
                 "--vocab-size", "512", "--json", str(out), "--no-progress")
    rep = json.loads(out.read_text())
    assert bad.returncode == 1 and rep["failed"] == 3 and "404" in next(iter(rep["errors"]))
    dead = _bench("--url", "http://127.0.0.1:9/v1", "--model", "m", "--num-requests", "2", "--no-progress", timeout=60)
    assert dead.returncode == 1 and "failed 2" in dead.stdout


@pytest.mark.timeout(300)
def test_bench_serve_can_launch_and_stop_its_own_server(tiny_hf_dir, tmp_path):
    pytest.importorskip("fastapi")
    out = tmp_path / "r.json"
    r = _bench("--launch", "--launch-model", str(tiny_hf_dir), "--launch-args", "--max-num-seqs 4 --attention torch",
               "--num-requests", "4", "--dataset", "fixed", "--input-len", "6", "--output-len", "3", "--vocab-size", "512",
               "--json", str(out), "--no-progress")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "--max-num-seqs 4" in r.stdout and json.loads(out.read_text())["completed"] == 4
    port = json.loads(out.read_text())["settings"]["url"].rsplit(":", 1)[1].split("/")[0]
    import socket

    with pytest.raises(OSError):  # the launched server is gone
        socket.create_connection(("127.0.0.1", int(port)), timeout=2).close()
