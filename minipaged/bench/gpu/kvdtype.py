"""The paper experiment with 8-bit KV pages against 16-bit, the prediction stated before the run.

``minipaged bench paper --kv-cache-dtype fp8`` (or ``int8``, ``fp8_e5m2``) runs this: it prints what
it predicts from the memory plan alone, then simulates vLLM and Orca (Oracle) once with the
weights' 16 bits and once with the 8-bit pages, on the same trace, and reports each ratio beside
its prediction: the KV room, vLLM's mean batched requests at the Fig. 13 rate, and the max rates.

The predictions are ranges, and why each is what it is (``why``):

* KV room: exact. The weights and activations leave the same bytes; a value takes 1 byte
  instead of 2, so the room holds ``bytes_16 / bytes_8`` times the tokens (int8's per-block
  scales are ignored by the simulator: 0.4% of a block).
* vLLM's max rate: more than 1x (its knee is where the room fills), less than the room's
  ratio (each step still reads every weight, and a larger batch makes each step slower).
  For the paper's setting (OPT-13B, A100-40GB, ShareGPT) the range was written down before the
  first run: 1.3-1.7x.
* vLLM's batched requests at the Fig. 13 rate: at a fixed arrival rate Little's law bounds the
  batch (arrivals x time in the system), so it grows only by the queueing it removes: 1.0-1.5x.
* Orca (Oracle)'s max rate: reservations waste the same share of a room twice as large: 1.3x up
  to the room's ratio.
"""
from __future__ import annotations

import time
from typing import Any, Callable

# Written before the first run of the paper's setting (git history of scripts/kvquant_paper.py).
PAPER_SETTING = ("a100-40gb", "opt-13b", "sharegpt")
PAPER_PREDICTION = {
    "kv_tokens_ratio": (2.0, 2.0),
    "vllm_max_rate_ratio": (1.3, 1.7),
    "vllm_batched_requests_ratio": (1.0, 1.5),
    "orca_oracle_max_rate_ratio": (1.3, 1.9),
}
SYSTEMS = ("orca_oracle", "vllm")


def predict(gpu: str, model: str, dataset: str, kv_cache_dtype: str, memory_gb: float | None = None) -> dict:
    """What the memory plan alone says: the ranges each ratio (8-bit over 16-bit) should fall in,
    and why. Nothing is simulated."""
    from ...config import check_kv_cache_dtype
    from .cost import memory_plan
    from .simulator import Setting
    from .specs import get_gpu, get_model

    if check_kv_cache_dtype(kv_cache_dtype) == "auto":
        raise ValueError("the 8-bit comparison needs kv_cache_dtype fp8, fp8_e4m3, fp8_e5m2 or int8, not auto")
    g, m = get_gpu(gpu), get_model(model)
    mem = None if memory_gb is None else int(memory_gb * (1 << 30))
    plans = {d: memory_plan(g, Setting(g.name, m.name, dataset, 16, mem, kv_cache_dtype=d).spec(), mem)
             for d in ("auto", kv_cache_dtype)}
    room = plans[kv_cache_dtype].kv_tokens / plans["auto"].kv_tokens
    if (g.name, m.name, dataset) == PAPER_SETTING and memory_gb is None:
        ranges = dict(PAPER_PREDICTION)
    else:
        ranges = {"kv_tokens_ratio": (round(room, 2), round(room, 2)),
                  "vllm_max_rate_ratio": (1.0, round(room, 2)),
                  "vllm_batched_requests_ratio": (1.0, 1.5),
                  "orca_oracle_max_rate_ratio": (1.3, round(room, 2))}
    why = (f"{m.name} on {g.name} leaves {plans['auto'].kv_bytes / 1e9:.1f} GB for KV: "
           f"{plans['auto'].kv_tokens:,} tokens at 16 bits, {plans[kv_cache_dtype].kv_tokens:,} at 8 bits ({room:.2f}x). "
           "vLLM's knee is where that room fills, so its max rate should rise, but by less than the room: each "
           "step still reads every weight, and a larger batch makes each step slower. At the Fig. 13 rate the "
           "batch is bounded by arrivals x time in the system, so it grows only by the queueing it removes. "
           "Orca (Oracle) wastes the same share of a larger room.")
    return {"ranges": ranges, "why": why, "kv_tokens": {d: p.kv_tokens for d, p in plans.items()}}


def compare(reproduce: Callable[..., dict], gpu: str = "a100-40gb", model: str = "opt-13b", dataset: str = "sharegpt",
            kv_cache_dtype: str = "fp8", num_requests: int = 10_000, memory_gb: float | None = None, seed: int = 0,
            workers: int | None = None, progress: bool = False, say: Callable[[str], Any] = print) -> dict:
    """The prediction (said through ``say`` before any simulation), then both runs (``reproduce``:
    paper.reproduce, which calls this module from its CLI) and the verdicts."""
    pred = predict(gpu, model, dataset, kv_cache_dtype, memory_gb)
    say(f"prediction (before the run), {kv_cache_dtype} over 16-bit KV:")
    for k, (lo, hi) in pred["ranges"].items():
        say(f"  {k}: {lo:g}x" + ("" if lo == hi else f" to {hi:g}x"))
    say("  why: " + pred["why"])
    t0 = time.time()
    runs = {d: reproduce(gpu, model, dataset, SYSTEMS, num_requests, memory_gb=memory_gb, seed=seed, workers=workers,
                         progress=progress, kv_cache_dtype=d)
            for d in ("auto", kv_cache_dtype)}
    got = {
        "kv_tokens": {d: r["settings"]["memory_plan"]["kv_tokens"] for d, r in runs.items()},
        "vllm_max_rate": {d: r["systems"]["vllm"]["max_rate"] for d, r in runs.items()},
        "vllm_batched_requests": {d: r["systems"]["vllm"]["mean_batched_requests"] for d, r in runs.items()},
        "orca_oracle_max_rate": {d: r["systems"]["orca_oracle"]["max_rate"] for d, r in runs.items()},
    }
    ratios = {f"{k}_ratio": (v[kv_cache_dtype] / v["auto"] if v["auto"] else float("inf")) for k, v in got.items()}
    held = {k: lo <= round(ratios[k], 2) <= hi for k, (lo, hi) in pred["ranges"].items()}  # to 2 decimals
    return {"prediction": {k: list(v) for k, v in pred["ranges"].items()}, "why": pred["why"], "measured": got,
            "ratios": ratios, "prediction_held": held, "kv_cache_dtype": kv_cache_dtype,
            "fig13_rate": runs["auto"]["settings"]["fig13_rate"], "num_requests": num_requests,
            "wall_seconds": round(time.time() - t0, 1),
            "settings": {d: r["settings"] for d, r in runs.items()}}


def format_result(res: dict) -> str:
    d = res["kv_cache_dtype"]
    lines = []
    for k, r in res["ratios"].items():
        lo, hi = res["prediction"][k]
        lines.append(f"{k}: {r:.2f}x (predicted {lo:g}" + ("" if lo == hi else f"-{hi:g}") +
                     f"x: {'held' if res['prediction_held'][k] else 'missed'})")
    for k, v in res["measured"].items():
        show = lambda x: f"{x:,}" if isinstance(x, int) else f"{x:,.2f}"  # noqa: E731
        lines.append(f"  {k}: 16-bit {show(v['auto'])}, {d} {show(v[d])}")
    return "\n".join(lines)


def run_cli(a: Any, reproduce: Callable[..., dict]) -> int:
    res = compare(reproduce, a.gpu, a.model or "opt-13b", a.dataset or "sharegpt", a.kv_cache_dtype,
                  10_000 if a.num_requests is None else a.num_requests, a.memory_gb, a.seed, a.workers,
                  not a.no_progress)
    print(format_result(res))
    from .. import save_run

    save_run(res, a)
    return 0


__all__ = ["PAPER_PREDICTION", "predict", "compare", "format_result", "run_cli"]
