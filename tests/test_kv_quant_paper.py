"""`minipaged bench paper --kv-cache-dtype fp8|int8`: the prediction first, then 16-bit and 8-bit KV
on the simulated A100 (bench/gpu/kvdtype.py), and the stored run the README quotes."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from minipaged.bench.commands import main as bench_main
from minipaged.bench.gpu import kvdtype

ROOT = Path(__file__).resolve().parents[1]


def test_the_prediction_comes_from_the_memory_plan_and_refuses_auto():
    p = kvdtype.predict("a100-40gb", "opt-13b", "sharegpt", "fp8")
    assert p["kv_tokens"] == {"auto": 15455, "fp8": 30911}
    assert p["ranges"] == kvdtype.PAPER_PREDICTION  # written before the first run of the paper's setting
    assert "15,455 tokens at 16 bits" in p["why"]
    other = kvdtype.predict("a100-40gb", "opt-13b", "sharegpt", "int8", memory_gb=60)
    room = other["kv_tokens"]["int8"] / other["kv_tokens"]["auto"]
    assert other["ranges"]["kv_tokens_ratio"] == (round(room, 2), round(room, 2))
    assert other["ranges"]["vllm_max_rate_ratio"] == (1.0, round(room, 2))  # more room, never more than the room
    with pytest.raises(ValueError, match="not auto"):
        kvdtype.predict("a100-40gb", "opt-13b", "sharegpt", "auto")
    with pytest.raises(ValueError, match="fp8"):
        kvdtype.predict("a100-40gb", "opt-13b", "sharegpt", "fp4")


def test_the_prediction_is_said_before_any_simulation_runs():
    from minipaged.bench.gpu import paper

    said: list[str] = []

    def spy(*args, **kw):
        said.append(f"run {kw['kv_cache_dtype']}")
        return paper.reproduce(*args, **kw)

    res = kvdtype.compare(spy, kv_cache_dtype="int8", num_requests=120, workers=1, say=said.append)
    first_run = said.index("run auto")
    assert said[0].startswith("prediction (before the run)") and first_run > 1
    assert "run int8" in said[first_run + 1:]
    m = res["measured"]
    for key, v in m.items():  # every ratio is the 8-bit run over the 16-bit one, and held says so
        r = res["ratios"][f"{key}_ratio"]
        assert r == pytest.approx(v["int8"] / v["auto"])
        lo, hi = res["prediction"][f"{key}_ratio"]
        assert res["prediction_held"][f"{key}_ratio"] == (lo <= round(r, 2) <= hi)
    assert res["ratios"]["kv_tokens_ratio"] == pytest.approx(2.0, abs=1e-3)
    text = kvdtype.format_result(res)
    assert "kv_tokens: 16-bit 15,455, int8 30,911" in text and ("held" in text and "x (predicted" in text)


@pytest.mark.parametrize("extra,says", [
    (["--chatbot"], "does not combine with --chatbot"),
    (["--beam-width", "2"], "does not combine with --beam-width"),
    (["--plot", "x.png"], "--plot and --readme draw the 16-bit"),
])
def test_the_cli_refuses_what_the_comparison_cannot_do(extra, says, capsys):
    with pytest.raises(SystemExit) as e:
        bench_main(["paper", "--kv-cache-dtype", "fp8", "--no-progress", *extra])
    assert says in str(e.value)


def test_the_cli_writes_the_comparison(tmp_path, capsys):
    out = tmp_path / "fp8.json"
    assert bench_main(["paper", "--kv-cache-dtype", "fp8", "--num-requests", "120", "--workers", "1", "--no-progress",
                       "--json", str(out)]) in (0, None)
    text = capsys.readouterr().out
    assert text.index("prediction (before the run)") < text.index("kv_tokens_ratio: 2.00x")
    res = json.loads(out.read_text())
    assert res["kv_cache_dtype"] == "fp8" and res["arguments"]["kv_cache_dtype"] == "fp8"
    assert set(res["settings"]) == {"auto", "fp8"}


def test_the_readme_quotes_the_stored_run():
    res = json.loads((ROOT / "docs/figures/paper_fp8.json").read_text())
    assert res["arguments"]["kv_cache_dtype"] == "fp8" and res["num_requests"] == 10_000
    readme = (ROOT / "README.md").read_text()
    assert "minipaged bench paper --kv-cache-dtype fp8 --json docs/figures/paper_fp8.json" in readme
    m = res["measured"]
    vl = m["vllm_max_rate"]
    assert f"vLLM **{vl['auto']:.2f} to {vl['fp8']:.2f} req/s ({res['ratios']['vllm_max_rate_ratio']:.2f}x)**" in readme
    assert f"{m['kv_tokens']['auto']:,} to {m['kv_tokens']['fp8']:,} tokens" in readme
