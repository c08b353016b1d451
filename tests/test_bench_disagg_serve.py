"""`minipaged bench disagg-serve`: one colocated server against a producer, a consumer and the proxy, as real processes.

The quick tests check that a bad setting is refused with what to give instead, before any server
starts. The slow one runs the whole comparison on the tiny random model with four requests: both
columns, every request answered, the proxy's greedy text equal to the colocated server's, and
every process the bench started gone afterwards, its ports free.
"""
from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path

import pytest

from minipaged.bench.disagg_serve import check_arguments

ROOT = Path(__file__).resolve().parent.parent
GOOD = dict(num_requests=4, rate=1.0, max_prompt=64, max_output=8, slo_ttft_ms=2000.0, slo_tpot_ms=400.0, serve_args=[],
            startup_timeout_s=60.0)


def _cli(*args: str) -> tuple[int, str]:
    from minipaged.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(["bench", "disagg-serve", *args])
        except SystemExit as e:  # argparse's own errors
            code = e.code
    return code, err.getvalue()


@pytest.mark.parametrize("change, message", [
    ({"num_requests": 0}, "--num-requests must be an integer >= 1, got 0"),
    ({"rate": 0.0}, "--rate must be > 0 requests/s"),
    ({"max_prompt": 0}, "--max-prompt must be >= 1 token"),
    ({"max_output": 1}, "--max-output must be >= 2 tokens (TPOT needs a second token)"),
    ({"slo_tpot_ms": -5.0}, "--slo-tpot-ms must be a finite number of milliseconds > 0"),
    ({"slo_ttft_ms": float("inf")}, "--slo-ttft-ms must be a finite number of milliseconds > 0"),
    ({"startup_timeout_s": 0.0}, "--startup-timeout must be > 0 seconds"),
    ({"serve_args": ["--max-num-seqs", "8", "--port", "9000"]}, "--serve-args may not set --port"),
    ({"serve_args": ["--kv-transfer-config={}"]}, "--serve-args may not set --kv-transfer-config"),
])
def test_bad_settings_are_refused_saying_what_to_give(change, message):
    check_arguments(**GOOD)  # the good settings pass
    with pytest.raises(ValueError) as e:
        check_arguments(**{**GOOD, **change})
    assert message in str(e.value)


def test_the_command_line_refuses_bad_input_before_starting_anything(tmp_path):
    code, err = _cli("--num-requests", "0")
    assert code == 2 and "minipaged bench: error: --num-requests must be an integer >= 1, got 0" in err, err
    code, err = _cli("--serve-args", "--host 0.0.0.0")
    assert code == 2 and "--serve-args may not set --host" in err and "give the model with --model" in err, err
    code, err = _cli("--serve-args", '"--max-num-seqs 8')
    assert code == 2 and "--serve-args is not a valid command line" in err, err
    code, err = _cli("--model", str(tmp_path / "missing.gguf"))
    assert code == 2 and "missing.gguf" in err, err
    code, err = _cli("--rate", "0")
    assert code == 2 and "rate must be > 0" in err, err


def test_the_command_is_in_the_bench_menu_with_its_help():
    from minipaged.cli import build_parser

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--help"])
    assert "disagg-serve" in out.getvalue()
    args = build_parser().parse_args(["bench", "disagg-serve"])
    assert (args.num_requests, args.rate, args.seed, args.max_output) == (12, 1.0, 0, 32)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_comparison_runs_both_setups_with_equal_greedy_text_and_leaves_no_process(tiny_hf_dir):
    pytest.importorskip("fastapi")
    from minipaged.bench.disagg_serve import COLOCATED, DISAGG, LABELS, compare, format_result

    env = {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    res = compare(model=str(tiny_hf_dir), num_requests=4, rate=8.0, scale=0.2, max_prompt=60, max_output=8,
                  vocab_size=512, serve_args=["--block-size", "8", "--attention", "torch"], env=env, progress=False,
                  startup_timeout_s=120.0, log=lambda *a: None)
    assert set(res["runs"]) == {COLOCATED, DISAGG}
    for name, r in res["runs"].items():
        assert (r["completed"], r["failed"]) == (4, 0), (name, r["errors"])
        assert r["ttft_ms"]["p50"] > 0 and r["tpot_ms"]["p50"] > 0 and r["goodput"] >= 0
    c, d = res["runs"][COLOCATED]["settings"], res["runs"][DISAGG]["settings"]
    assert (c["seed"], c["rate"], c["num_requests"]) == (d["seed"], d["rate"], d["num_requests"])  # the same requests
    assert res["same_greedy_text"] == {"compared": 4, "equal": 4, "differing_requests": []}
    tr = res["transfer"]
    assert tr["prefill_failures"] == 0 and tr["tokens_received_by_consumer"] > 0
    assert tr["tokens_received_by_consumer"] + tr["consumer_prompt_tokens_computed"] == tr["prompt_tokens"]
    # every process the bench started is gone, with its process group, and its ports are free
    assert [p["role"] for p in res["processes"]] == [COLOCATED, "kv_producer", "kv_consumer", "proxy"]
    assert res["all_stopped"] and res["ports_free"]
    for p in res["processes"]:
        assert not Path(f"/proc/{p['pid']}").exists(), f"{p['role']} (pid {p['pid']}) survived"
        with pytest.raises(ProcessLookupError):
            os.killpg(p["pid"], 0)
    text = format_result(res)
    assert LABELS[COLOCATED] in text and LABELS[DISAGG] in text and "TTFT p50 / p99" in text and "goodput" in text
    assert "cannot appear here" in text and "crosses no real link" in text
