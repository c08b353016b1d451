"""`minipaged bench`: what paging and continuous batching each buy, on one workload and one KV budget.

Owns the experiment: one seeded workload; four systems from the factorial {contiguous, paged}
memory x {static, continuous} batching, all given the same KV blocks; naive (one at a time) and
transformers' ``generate`` beside them; the attribution of each ratio to its cause; an online
sweep (Poisson arrivals at several rates: throughput, TTFT, TPOT, goodput under a stated SLO);
this machine's bandwidth, GEMM rate and decode roofline. Prints a table, writes JSON and PNGs.
The systems themselves are in ``baselines.py``; it only measures and reports them.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .. import parts
from ..kv_cache import kv_bytes_per_token
from . import hardware, text_table
from .baselines import FACTORIAL, ServeResult, load_hf_peer, run_hf, run_system
from .clock import LinearStepCost, RequestSeconds, StaticBatching, StepSeconds, poisson_arrivals, run_clock
from .workloads import Workload, chat_prompt_ids, synthetic

SYSTEMS = ("naive", *FACTORIAL, "hf")
ATTRIBUTION = {
    # name: (numerator, denominator, what the ratio isolates)
    "paging_at_static": ("static_paged", "static_contiguous", "paging, batching fixed to static"),
    "paging_at_continuous": ("continuous_paged", "continuous_contiguous", "paging, batching fixed to continuous"),
    "refill_at_contiguous": ("continuous_contiguous", "static_contiguous", "refilling seats, memory fixed to contiguous"),
    "refill_at_paged": ("continuous_paged", "static_paged", "refilling seats, memory fixed to paged"),
    "both": ("continuous_paged", "static_contiguous", "paging and refilling together"),
}
# Workload shapes. Lengths are ShareGPT-like log-normals (workloads.DISTRIBUTIONS) with each
# median multiplied by a scale. The quick run keeps the full shape's medians, caps outputs at 192
# (long enough that paged waste stays near 4% at block size 16) and serves 32 requests; it runs
# naive and the two corner systems (static_contiguous, continuous_paged), the full run all six.
QUICK = dict(num_requests=32, static_batch=16, prompt_scale=1.0, output_scale=1.0, max_prompt=512, max_output=192,
             naive_requests=4, online_requests=0, shared_prefix=False,
             systems=("naive", "static_contiguous", "continuous_paged"))
FULL = dict(num_requests=64, static_batch=16, prompt_scale=1.0, output_scale=1.0, max_prompt=512, max_output=384,
            naive_requests=16, online_requests=16, shared_prefix=True,
            systems=("naive", "static_contiguous", "static_paged", "continuous_contiguous", "continuous_paged", "hf"))
# The online sweep serves its own, shorter requests (medians 48 and 29 tokens, another seed): a run at a low
# rate costs about what serving them one at a time does, and the sweep runs 4 systems x 3 rates.
ONLINE_SHAPE = dict(prompt_scale=0.5, output_scale=0.3, max_prompt=512, max_output=96)
RATE_FACTORS = (0.5, 1.5, 4.0)  # online request rates, in units of naive's capacity on those requests


def flops_per_token(model: torch.nn.Module, context_len: float) -> float:
    """Matmul FLOPs to generate one token: 2 per weight used (the embedding lookup is free,
    the output projection is not, tied or not) plus attention over ``context_len`` tokens."""
    cfg = model.config
    n = sum(p.numel() for name, p in model.named_parameters() if "embed" not in name)
    if cfg.tie_word_embeddings:
        n += cfg.vocab_size * cfg.hidden_size
    attn = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * context_len
    return 2 * n + attn


def gemm_gflops(n: int = 1024, repeats: int = 8) -> float:
    return hardware.gemm_gflops(n, repeats)


# -- reading a run -----------------------------------------------------------------------
def _pct(xs: list[float], q: float) -> float | None:
    return float(np.percentile(xs, q)) if xs else None


def latency_summary(res: ServeResult, requests: list, ids: list[int]) -> dict:
    """Throughput and per-request latencies of ``ids`` (all of them must have finished)."""
    missing = [i for i in ids if i not in res.finish]
    if missing:
        raise RuntimeError(f"{res.system}: {len(missing)} request(s) never finished (first: {missing[0]})")
    got = sum(len(res.outputs[i]) for i in ids)
    want = sum(requests[i][1] for i in ids)
    if got != want:
        raise RuntimeError(f"{res.system} generated {got} tokens where {want} were asked for")
    ttft = [res.first_token[i] - res.arrival[i] for i in ids]
    lat = [res.finish[i] - res.arrival[i] for i in ids]
    tpot = [(res.finish[i] - res.first_token[i]) / (requests[i][1] - 1) for i in ids if requests[i][1] > 1]
    in_tok = sum(len(requests[i][0]) for i in ids)
    return {
        "num_requests": len(ids), "output_tokens": want, "seconds": res.seconds,
        "output_tokens_per_s": want / res.seconds, "total_tokens_per_s": (want + in_tok) / res.seconds,
        "ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99),
        "tpot_p50_s": _pct(tpot, 50), "tpot_p99_s": _pct(tpot, 99),
        "latency_p50_s": _pct(lat, 50), "latency_p99_s": _pct(lat, 99),
    }


def memory_summary(res: ServeResult, bytes_per_token: int) -> dict:
    """KV reserved vs used, read from what the system's own pool held at every step."""
    eng, tr = res.engine, res.trace
    r = np.array([s.reserved_slots for s in tr.steps] or [0])
    u = np.array([s.used_slots for s in tr.steps] or [0])
    bs = eng.allocator.block_size
    return {
        "kv_blocks": eng.allocator.num_blocks, "kv_mib": eng.allocator.num_blocks * bs * bytes_per_token / 2**20,
        "kv_reserved_peak_mib": float(r.max() * bytes_per_token / 2**20),
        "kv_used_peak_mib": float(u.max() * bytes_per_token / 2**20),
        "kv_waste": float(tr.kv_waste()), "peak_concurrent_seqs": int(tr.peak_concurrency),
        "peak_blocks_used": tr.peak_blocks_used, "preemptions": int(eng.scheduler.num_preemptions),
    }


def naive_extrapolated(res: ServeResult, requests: list, served: list[int]) -> dict:
    """Naive's latencies for the whole workload from the subset it served (labelled as such).

    Model-free: no performance model of the machine, only the measured mean seconds per output
    token of the served requests; request ``i`` then takes its output tokens times that, FCFS
    behind every request before it (all arrive at 0 in the offline run).
    """
    per_token = sum(res.finish[i] - (res.finish[served[k - 1]] if k else 0.0) for k, i in enumerate(served))
    per_token /= sum(requests[i][1] for i in served)
    first = float(np.mean([res.first_token[i] - (res.finish[served[k - 1]] if k else 0.0) for k, i in enumerate(served)]))
    done = np.cumsum([requests[i][1] * per_token for i in range(len(requests))])
    start = np.concatenate([[0.0], done[:-1]])
    return {
        "latency_p50_s": float(np.percentile(done, 50)), "latency_p99_s": float(np.percentile(done, 99)),
        "ttft_p50_s": float(np.percentile(start + first, 50)), "ttft_p99_s": float(np.percentile(start + first, 99)),
        "latency_note": f"latency and TTFT extrapolated to all {len(requests)} requests from the {len(served)} served "
                        f"({per_token * 1e3:.1f} ms per output token measured; model-free: FCFS, one at a time)",
    }


def compare_tokens(outputs: dict[str, dict[int, list[int]]], ref: str) -> dict[str, dict]:
    """Per system: on how many of the requests both served, its greedy tokens equal ``ref``'s."""
    out = {}
    base = outputs[ref]
    for name, o in outputs.items():
        common = sorted(set(o) & set(base))
        same = [i for i in common if o[i] == base[i]]
        out[name] = {"compared": len(common), "equal": len(same),
                     "first_different": next((i for i in common if o[i] != base[i]), None)}
    return out


def attribution(S: dict) -> dict:
    att = {}
    for key, (num, den, what) in ATTRIBUTION.items():
        if num in S and den in S:
            att[key] = {"ratio": S[num]["output_tokens_per_s"] / S[den]["output_tokens_per_s"], "of": f"{num} / {den}",
                        "isolates": what}
    return att


# -- the online sweep ----------------------------------------------------------------------
def slo_met(res: ServeResult, requests: list, ids: list[int], slo: dict) -> int:
    """How many of ``ids`` met the SLO (TTFT and TPOT both within it)."""
    ok = 0
    for i in ids:
        ttft = res.first_token[i] - res.arrival[i]
        n = requests[i][1]
        tpot = (res.finish[i] - res.first_token[i]) / (n - 1) if n > 1 else 0.0
        ok += ttft <= slo["ttft_s"] and tpot <= slo["tpot_s"]
    return ok


def goodput(res: ServeResult, requests: list, ids: list[int], slo: dict, window_s: float | None = None) -> float:
    """Requests per second that met the SLO (TTFT and TPOT both within it).

    Divided by ``window_s``, the offered window (``n / rate``: the time over which the load was
    offered), when given, so goodput is the offered rate times the fraction that met the SLO and
    can never exceed the offered rate; else by the run's length (the older definition)."""
    return slo_met(res, requests, ids, slo) / (window_s if window_s else res.seconds)


def online_sweep(model, requests: list, rates: list[float], slo: dict, systems: tuple[str, ...], seed: int,
                 progress: bool = False, **engine_kw: Any) -> dict:
    ids = list(range(len(requests)))
    out: dict = {"rates_per_s": rates, "num_requests": len(requests), "slo": slo, "systems": {}}
    for name in systems:
        rows = []
        for k, rate in enumerate(rates):
            arr = poisson_arrivals(len(requests), rate, seed + k)
            res = run_system(model, name, requests, arrivals=arr, progress=False, **engine_kw)
            d = latency_summary(res, requests, ids)
            frac = slo_met(res, requests, ids, slo) / len(ids)
            # goodput over the offered window (len(ids) / rate): the rate times the fraction, never above the rate
            d.update(rate_per_s=rate, goodput_req_per_s=rate * frac, slo_fraction=frac, offered_window_s=len(ids) / rate,
                     busy_fraction=res.busy_seconds / res.seconds if res.seconds else None)
            rows.append(d)
            if progress:
                print(f"  online {name:<22} {rate:6.3f} req/s: {d['output_tokens_per_s']:7.1f} tok/s, TTFT p50 "
                      f"{d['ttft_p50_s']:.2f}s, TPOT p50 {d['tpot_p50_s']:.3f}s, goodput {d['goodput_req_per_s']:.3f} req/s",
                      file=sys.stderr)
        out["systems"][name] = rows
    return out


# -- online load on a virtual clock: the real scheduler, a fitted step cost ---------------------
def step_cost(fixed_s: float, per_seat_s: float, per_prefill_token_s: float) -> LinearStepCost:
    """A step's seconds as ``fixed + per_seat * sequences in the step + per_token * prompt tokens``:
    the three numbers a lesson fits to the steps it timed (lesson 06); ``.params`` gives them back."""
    return LinearStepCost(fixed_s, per_seat_s, per_prefill_token_s)


def simulate_online(requests: list[tuple[int, int]], arrivals: list[float], cost: StepSeconds, *, static: bool = False,
                    num_blocks: int, block_size: int = 16, max_num_seqs: int = 16, max_num_batched_tokens: int = 256,
                    enable_chunked_prefill: bool = True, arrival_overhead: RequestSeconds | float | None = None,
                    response_overhead: float = 0.0) -> dict:
    """Serve ``requests`` ((prompt_len, output_len), EOS ignored) arriving at ``arrivals`` (seconds)
    with minipaged's own Scheduler and BlockAllocator (no prefix caching), on the virtual clock
    (:func:`minipaged.bench.clock.run_clock`): each step costs ``cost(scheduled)`` (e.g.
    :func:`step_cost`), the clock jumps over idle gaps. No model runs. ``arrival_overhead``:
    seconds charged once per request between its arrival and the scheduler (HTTP and tokenizing;
    a number, or ``f(prompt_len, output_len)``), inside its TTFT but outside every step.
    ``response_overhead``: seconds from the step that made a token to the client's having it (the
    server's streaming path back over HTTP), charged once per request, at its first token: every
    token of a request reaches the client that much later, so it adds to TTFT and latency and
    leaves the gaps between tokens (TPOT) as they were. The times returned are the client's.

    ``static=True`` is static batching: new requests are admitted only when the running batch has
    drained, up to ``max_num_seqs`` (set it to what contiguous reservations fit). Returns per
    request ``arrival``, ``first_token``, ``finish`` and ``token_times`` (when each output token
    was produced), plus ``preemptions``, ``recomputed_tokens`` (KV computed again after a
    preemption) and ``steps``."""
    from ..block_allocator import BlockAllocator
    from ..config import EngineConfig
    from ..scheduler import Scheduler

    config = EngineConfig(block_size=block_size, num_blocks=num_blocks, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=max_num_batched_tokens, enable_chunked_prefill=enable_chunked_prefill)
    sched = Scheduler(BlockAllocator(num_blocks, block_size), config=config)
    parts = StaticBatching(sched, max_num_seqs) if static else sched
    run = run_clock(parts, requests, arrivals, cost, arrival_overhead=arrival_overhead, keep_token_times=True)
    rejected = run.rejected + [(s.seq_id, s.reject_reason) for s in getattr(parts, "rejected", [])]
    if rejected:
        i, why = rejected[0]
        p, o = requests[i]
        raise ValueError(f"request {i} ({p}+{o} tokens) can never fit: {why}")
    n = len(requests)
    if response_overhead < 0:
        raise ValueError(f"response_overhead is seconds (>= 0) from a step to the client, got {response_overhead}")
    late = float(response_overhead)
    token_times = {i: [t + late for t in tt] for i, tt in run.token_times.items()}
    assert all(len(token_times[i]) == requests[i][1] for i in range(n)), "every request gets its output_len tokens"
    recomputed = sum(c - (p + o - 1) for c, (p, o) in zip(run.computed_tokens, requests))
    return {"arrival": list(arrivals), "first_token": {i: t + late for i, t in enumerate(run.first_token)},
            "finish": {i: t + late for i, t in enumerate(run.finish)}, "token_times": token_times,
            "preemptions": sched.num_preemptions, "recomputed_tokens": int(recomputed), "steps": run.num_steps,
            "seconds": max(run.finish) + late - min(arrivals)}


def online_summary(sim: dict, requests: list[tuple[int, int]], rate: float, slo: dict,
                   ids: list[int] | None = None) -> dict:
    """TTFT, TPOT, the longest gap between two tokens, and goodput over the offered window
    (``len(ids) / rate`` seconds, so goodput <= rate always) for ``ids`` (default: all)."""
    ids = list(range(len(requests))) if ids is None else ids
    ttft = [sim["first_token"][i] - sim["arrival"][i] for i in ids]
    tpot = [(sim["finish"][i] - sim["first_token"][i]) / (requests[i][1] - 1) for i in ids if requests[i][1] > 1]
    gaps = [b - a for i in ids for a, b in zip(sim["token_times"][i], sim["token_times"][i][1:])]
    ok = sum(1 for i in ids if sim["first_token"][i] - sim["arrival"][i] <= slo["ttft_s"] and
             (requests[i][1] <= 1 or (sim["finish"][i] - sim["first_token"][i]) / (requests[i][1] - 1) <= slo["tpot_s"]))
    out_tokens = sum(requests[i][1] for i in ids)
    return {"rate_per_s": rate, "num_requests": len(ids),
            "ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99), "tpot_p50_s": _pct(tpot, 50),
            "tpot_p99_s": _pct(tpot, 99), "max_gap_s": max(gaps, default=0.0),
            "goodput_req_per_s": rate * (ok / len(ids)), "slo_fraction": ok / len(ids),
            "output_tokens_per_s": out_tokens / sim["seconds"], "preemptions": sim["preemptions"]}


# -- the whole benchmark -------------------------------------------------------------------
def run_bench(
    quick: bool = False,
    workload: str = "sharegpt",
    num_requests: int | None = None,
    static_batch: int | None = None,
    naive_requests: int | None = None,
    online_requests: int | None = None,
    rate_factors: tuple[float, ...] = RATE_FACTORS,
    block_size: int = 16,
    max_output: int | None = None,
    prompt_scale: float | None = None,
    output_scale: float | None = None,
    systems: tuple[str, ...] | None = None,
    model: Any = None,
    model_path: str | None = None,
    attention: str = "auto",
    chat_prompts: bool = False,
    max_num_batched_tokens: int = 1024,
    roofline_batches: tuple[int, ...] | None = None,
    shared_prefix: bool | None = None,
    seed: int = 0,
    progress: bool = True,
    gguf_blocks: bool | None = None,
    engine: dict | None = None,
    ceilings_cache_s: float | None = None,
) -> dict:
    """Run every system on one workload with one KV budget: exactly what ``static_batch``
    contiguous max-length reservations take. ``naive_requests=None`` serves every request naively.
    ``systems`` defaults to the shape's (QUICK or FULL). ``engine``: EngineConfig settings every
    minipaged system gets (the command line's engine flags), over the bench's own choices.
    ``ceilings_cache_s``: the roofline's ceilings from ``hardware.ceilings(cache_s=...)`` (a lesson
    reads the ones its sitting measured); default: measured now."""
    if systems is None:
        systems = (QUICK if quick else FULL)["systems"]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        raise ValueError(f"unknown system(s) {unknown}: choose from {', '.join(SYSTEMS)}")
    shape = dict(QUICK if quick else FULL)
    for key, val in (("num_requests", num_requests), ("static_batch", static_batch), ("max_output", max_output),
                     ("online_requests", online_requests), ("prompt_scale", prompt_scale), ("output_scale", output_scale)):
        if val is not None:
            shape[key] = val
    if naive_requests is not None:
        shape["naive_requests"] = naive_requests
    if shared_prefix is not None:
        shape["shared_prefix"] = shared_prefix
    torch.manual_seed(seed)
    t = time.perf_counter()
    tokenizer = None
    if model is None:
        from ..model import load_model

        model, tokenizer = load_model(model_path, device="cuda" if torch.cuda.is_available() else "cpu")
    load_s = time.perf_counter() - t
    cfg = model.config
    # keep every request (prompt + output) inside the model's context
    max_out = min(shape["max_output"], cfg.max_position_embeddings // 2)
    max_prompt = min(shape["max_prompt"], cfg.max_position_embeddings - max_out)
    real = chat_prompt_ids(tokenizer) if chat_prompts and tokenizer is not None else None
    wl = synthetic(workload, shape["num_requests"], seed, vocab_size=cfg.vocab_size, max_output=max_out,
                   max_prompt=max_prompt, real_prompts=real, prompt_scale=shape["prompt_scale"],
                   output_scale=shape["output_scale"])
    reqs = [(r.prompt_token_ids, r.max_tokens) for r in wl.requests]
    n = len(reqs)
    reserve_len = max(len(p) for p, _ in reqs) + max(o for _, o in reqs)
    bpt = kv_bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, next(model.parameters()).dtype)
    budget_blocks = shape["static_batch"] * parts.cdiv(reserve_len, block_size)
    engine_kw = dict(num_blocks=budget_blocks, reserve_tokens=reserve_len, block_size=block_size,
                     max_num_seqs=max(n, 1), max_num_batched_tokens=max_num_batched_tokens, attention=attention,
                     gguf_blocks=gguf_blocks)
    overrides = dict(engine or {})
    for key in ("max_num_seqs", "max_num_batched_tokens", "gguf_blocks"):  # run_system's own arguments
        if key in overrides:
            engine_kw[key] = overrides.pop(key)
    gguf_blocks = engine_kw["gguf_blocks"]
    if overrides:
        engine_kw["engine"] = overrides
    result: dict = {
        "engine_flags": dict(engine or {}),
        "quick": quick,
        "gguf_blocks": gguf_blocks,  # None: the engine's default (on where it can be); False: fp32 weights only
        "workload": dict(wl.summary(), scaling=shape),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                    "threads": torch.get_num_threads()},
        "model": {"name": cfg.name, "load_seconds": load_s},
        "kv_budget": {
            "blocks": budget_blocks, "block_size": block_size, "mib": budget_blocks * block_size * bpt / 2**20,
            "reserve_len": reserve_len,
            "note": f"what {shape['static_batch']} contiguous reservations of {reserve_len} tokens (the workload's longest "
                    "prompt + longest output) take; every minipaged system gets exactly these blocks",
        },
        "systems": {},
    }
    # -- the machine
    ceil = hardware.ceilings(quick=quick, cache_s=ceilings_cache_s)
    bw = {"read_GBps": ceil["read_GBps"], "copy_GBps": ceil["copy_GBps"]}
    gf = ceil["gemm_gflops"]
    fpt = flops_per_token(model, float(np.mean([len(p) + o / 2 for p, o in reqs])))
    result["ceiling"] = {"gemm_gflops": gf, "flops_per_token": fpt, "compute_bound_tokens_per_s": gf * 1e9 / fpt}
    rb = roofline_batches or ((1, 4, 16, 64) if quick else (1, 2, 4, 8, 16, 32, 64, 128))
    result["roofline"] = hardware.roofline(model, rb, bw=bw, gflops=gf, repeats=2 if quick else 3)

    S = result["systems"]
    runs: dict[str, ServeResult] = {}
    if "naive" in systems:
        k = shape["naive_requests"]
        served = list(range(n)) if k is None or k >= n else [round(j * (n - 1) / max(k - 1, 1)) for j in range(k)]
        sub = [reqs[i] for i in served]
        res = run_system(model, "naive", sub, progress=progress, **engine_kw)
        # give the results the workload's request numbers back
        for d in (res.outputs, res.arrival, res.first_token, res.finish):
            d.update({served[j]: d.pop(j) for j in sorted(d, reverse=True)})
        runs["naive"] = res
        S["naive"] = latency_summary(res, reqs, served)
        S["naive"].update(memory_summary(res, bpt))
        if len(served) < n:
            S["naive"].update(naive_extrapolated(res, reqs, served))
            S["naive"]["note"] = (f"served {len(served)} of the {n} requests (every {n / len(served):.1f}th), one at a time; "
                                  "its rate does not depend on how many")
    for name in FACTORIAL:
        if name in systems:
            res = run_system(model, name, reqs, progress=progress, **engine_kw)
            runs[name] = res
            S[name] = latency_summary(res, reqs, list(range(n)))
            S[name].update(memory_summary(res, bpt))
            S[name]["num_batches"] = len(res.batches) if res.batches else None
    if "hf" in systems:
        hf = load_hf_peer(model_path) if model_path or tokenizer is not None else None
        if hf is not None:
            hf = hf.to(next(model.parameters()).device)
            res = run_hf(hf, reqs, shape["static_batch"], progress=progress)
            runs["hf"] = res
            S["hf"] = latency_summary(res, reqs, list(range(n)))
            # generate returns a batch's tokens all at once: its first token and TPOT are not observable
            S["hf"].update(ttft_p50_s=None, ttft_p99_s=None, tpot_p50_s=None, tpot_p99_s=None)
            S["hf"].update(peak_concurrent_seqs=shape["static_batch"], kv_waste=None,
                           note=f"batch {shape['static_batch']}: the most left-padded rows of the workload's longest "
                                "prompt + output the same KV memory holds")
            del hf
    for name, d in S.items():
        d["fraction_of_compute_bound"] = d["output_tokens_per_s"] / result["ceiling"]["compute_bound_tokens_per_s"]
        if "naive" in S and name != "naive":
            d["x_naive"] = d["output_tokens_per_s"] / S["naive"]["output_tokens_per_s"]
    result["attribution"] = attribution(S)
    ref = "naive" if "naive" in runs else next(iter(runs), None)
    if ref is not None:
        result["tokens"] = {"reference": ref, "systems": compare_tokens({k: r.outputs for k, r in runs.items()}, ref)}
    if "static_contiguous" in S and "continuous_paged" in S:
        result["concurrency_ratio"] = S["continuous_paged"]["peak_concurrent_seqs"] / S["static_contiguous"]["peak_concurrent_seqs"]

    # -- online arrivals
    m = shape["online_requests"]
    online_systems = tuple(s for s in FACTORIAL if s in systems)
    if m and online_systems and "naive" in runs:
        base = runs["naive"]
        served = sorted(base.finish)
        prev = {i: (base.finish[served[k - 1]] if k else 0.0) for k, i in enumerate(served)}
        per_token = sum(base.finish[i] - prev[i] for i in served) / sum(reqs[i][1] for i in served)
        alone_ttft = float(np.median([base.first_token[i] - prev[i] for i in served]))
        tpots = [(base.finish[i] - base.first_token[i]) / (reqs[i][1] - 1) for i in served if reqs[i][1] > 1]
        slo = {"ttft_s": 10.0 * alone_ttft, "tpot_s": 3.0 * float(np.median(tpots)),
               "rule": "TTFT within 10x naive's median time to first token of a request served alone, and TPOT "
                       "within 3x naive's median time per output token (both measured in this run)"}
        owl = synthetic(workload, m, seed + 1, vocab_size=cfg.vocab_size, real_prompts=real,
                        max_prompt=min(ONLINE_SHAPE["max_prompt"], max_prompt), max_output=min(ONLINE_SHAPE["max_output"], max_out),
                        prompt_scale=ONLINE_SHAPE["prompt_scale"], output_scale=ONLINE_SHAPE["output_scale"])
        sub = [(r.prompt_token_ids, r.max_tokens) for r in owl.requests]
        # naive's capacity on these requests, from its measured time per output token
        per_req = per_token * float(np.mean([o for _, o in sub]))
        rates = [f / per_req for f in rate_factors]
        okw = dict(engine_kw, reserve_tokens=max(len(p) for p, _ in sub) + max(o for _, o in sub))  # same blocks
        result["online"] = online_sweep(model, sub, rates, slo, online_systems, seed, progress=progress, **okw)
        result["online"].update(naive_capacity_req_per_s=1.0 / per_req, rate_factors=list(rate_factors),
                                workload=owl.summary())
    # The shared-prefix workload: prefix caching off vs on (TTFT, KV blocks), once the engine has it.
    result["shared_prefix"] = measure_shared_prefix(model, block_size, seed, attention=attention, gguf_blocks=gguf_blocks) if shape["shared_prefix"] else {
        "measured": False, "why": "not part of this run (the full bench measures it)"}
    result["_runs"] = runs
    return result


def shared_prefix_requests(num_requests: int, system_len: int, user_len: tuple[int, int], max_tokens: int,
                           vocab_size: int, seed: int = 0) -> list:
    """Requests that all start with the same ``system_len``-token system prompt, then their own question."""
    rng = np.random.default_rng(seed)
    system = rng.integers(100, vocab_size - 100, system_len).tolist()
    lo, hi = user_len
    return [(system + rng.integers(100, vocab_size - 100, int(rng.integers(lo, hi + 1))).tolist(), max_tokens)
            for _ in range(num_requests)]


def measure_shared_prefix(model: Any, block_size: int, seed: int, num_requests: int = 12, system_len: int = 256,
                  user_len: tuple[int, int] = (16, 48), max_tokens: int = 16, settings: tuple | None = None,
                  attention: Any = "auto", gguf_blocks: bool | None = None) -> dict:
    """Requests sharing a long system prompt, served with prefix caching off and on: TTFT and KV blocks.

    One request runs first (it fills the cache, when there is one), then the others arrive
    together, through the same driver as every other system. Measured when the engine has an
    ``enable_prefix_caching`` setting (issue 13); until then the JSON says why not. ``settings``
    (two dicts of engine settings, off then on) replaces the default pair, for tests.
    """
    from ..config import CONFIG_FIELDS
    from .baselines import build_engine, serve

    if settings is None:
        if "enable_prefix_caching" not in CONFIG_FIELDS:
            return {"measured": False, "why": "this engine has no prefix caching (no EngineConfig.enable_prefix_caching)"}
        settings = ({"enable_prefix_caching": False}, {"enable_prefix_caching": True})
    cfg = model.config
    system_len = min(system_len, cfg.max_position_embeddings - user_len[1] - max_tokens)
    reqs = shared_prefix_requests(num_requests, system_len, user_len, max_tokens, cfg.vocab_size, seed)
    num_blocks = num_requests * parts.cdiv(system_len + user_len[1] + max_tokens, block_size)
    out = {"measured": True, "num_requests": num_requests, "system_prompt_tokens": system_len, "max_tokens": max_tokens}
    outputs = {}
    for label, extra in zip(("off", "on"), settings):
        from ..engine import LLMEngine

        eng = LLMEngine(model, None, attention=attention, block_size=block_size, num_blocks=num_blocks,
                        max_num_seqs=num_requests, gguf_blocks=gguf_blocks, **extra)
        serve(eng, reqs[:1], id_prefix="warm")  # the first request fills the cache (when there is one)
        res = serve(eng, reqs[1:], id_prefix="r")  # then the rest, all at once
        ids = list(range(num_requests - 1))
        d = latency_summary(res, reqs[1:], ids)
        d["peak_blocks_used"] = res.trace.peak_blocks_used
        d["settings"] = dict(extra)
        out[label] = d
        outputs[label] = res.outputs
    out["greedy_tokens_equal"] = outputs["off"] == outputs["on"]
    out["ttft_p50_ratio_off_over_on"] = out["off"]["ttft_p50_s"] / out["on"]["ttft_p50_s"]
    return out


def format_table(result: dict) -> str:
    rows = [("system", "out tok/s", "x naive", "TTFT p50", "TPOT p50", "lat p50", "lat p99", "KV waste", "peak seqs", "preempt")]
    for name, d in result["systems"].items():
        f = lambda k, fmt: (fmt.format(d[k]) if d.get(k) is not None else "-")  # noqa: E731
        rows.append((
            name, f("output_tokens_per_s", "{:.1f}"), f("x_naive", "{:.2f}"), f("ttft_p50_s", "{:.2f}s"),
            f("tpot_p50_s", "{:.3f}s"), f("latency_p50_s", "{:.2f}s"), f("latency_p99_s", "{:.2f}s"),
            (f"{d['kv_waste'] * 100:.1f}%" if d.get("kv_waste") is not None else "-"),
            str(d.get("peak_concurrent_seqs", "-")), str(d.get("preemptions", "-")),
        ))
    return "\n".join(text_table(rows, rule=True))


def format_attribution(result: dict) -> str:
    lines = []
    for key, a in result.get("attribution", {}).items():
        lines.append(f"{key:<22} {a['ratio']:5.2f}x  ({a['of']}: {a['isolates']})")
    return "\n".join(lines)


def offered_goodput(d: dict, num_requests: int) -> float:
    """One online row's goodput over the offered window (``num_requests / rate``). A row from an
    older bench JSON (goodput divided by the run's ``seconds``) is converted: the requests that met
    the SLO are ``goodput x seconds``."""
    if "slo_fraction" in d:
        return d["goodput_req_per_s"]
    good = round(d["goodput_req_per_s"] * d["seconds"])
    return good * d["rate_per_s"] / num_requests


def format_online(result: dict) -> str:
    on = result.get("online")
    if not on:
        return ""
    slo = on["slo"]
    rows = [("system", "req/s", "out tok/s", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "goodput")]
    for name, rs in on["systems"].items():
        for d in rs:
            rows.append((name, f"{d['rate_per_s']:.3f}", f"{d['output_tokens_per_s']:.1f}", f"{d['ttft_p50_s']:.2f}s",
                         f"{d['ttft_p99_s']:.2f}s", f"{d['tpot_p50_s']:.3f}s", f"{d['tpot_p99_s']:.3f}s",
                         f"{offered_goodput(d, on['num_requests']):.3f}"))
    lines = [f"online: {on['num_requests']} requests ({on['workload']['description'] if on.get('workload') else ''}), "
             f"Poisson arrivals at {', '.join(f'{x:g}' for x in on.get('rate_factors', []))}x naive's capacity; SLO TTFT <= {slo['ttft_s']:.2f}s and "
             f"TPOT <= {slo['tpot_s']:.3f}s ({slo['rule']}); goodput = requests meeting both / the offered window "
             f"({on['num_requests']} requests / the rate), never above the rate"]
    lines += text_table(rows, rule=True)
    return "\n".join(lines)


def save_plots(result: dict, folder: Path) -> list[Path]:
    """PNG plots of a result (needs matplotlib: the `course` extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        from .. import viz
        from . import plots
    except ImportError:
        return []
    folder.mkdir(parents=True, exist_ok=True)
    paths = []

    def save(fig, name: str) -> None:
        paths.append(folder / name)
        fig.savefig(paths[-1], dpi=110, bbox_inches="tight")

    S = result["systems"]
    save(viz.plot_throughput(S), "throughput.png")
    if all(k in S for k in FACTORIAL):
        save(plots.plot_factorial(result), "attribution.png")
    if result.get("online"):
        save(plots.plot_online(result), "online.png")
    if result.get("roofline"):
        save(plots.plot_roofline(result["roofline"]), "roofline.png")
    traces = {k: r.trace for k, r in result.get("_runs", {}).items() if k in ("static_contiguous", "continuous_paged")}
    if len(traces) == 2:
        save(viz.plot_timeline(traces), "timeline.png")
    if traces:
        save(viz.plot_kv_usage(traces), "kv_usage.png")
    if "continuous_paged" in traces:
        save(viz.plot_page_table(traces["continuous_paged"]), "page_table.png")
    plt.close("all")
    return paths


def to_json(result: dict) -> dict:
    out = {k: v for k, v in result.items() if not k.startswith("_")}
    out["timelines"] = {n: r.trace.timeline() for n, r in result.get("_runs", {}).items() if r.trace is not None}
    return out


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--quick", action="store_true", help="a small workload that finishes in under two minutes")
    ap.add_argument("--workload", default="sharegpt", choices=["sharegpt", "alpaca"])
    ap.add_argument("--chat-prompts", action="store_true", help="use real chat prompts (the demo model's template) instead of random tokens")
    ap.add_argument("--num-requests", type=int)
    ap.add_argument("--static-batch", type=int, help="contiguous reservations the KV budget holds (sets the budget every system gets)")
    ap.add_argument("--naive-requests", type=int, help="serve only this many requests naively and extrapolate its latency (labelled)")
    ap.add_argument("--online-requests", type=int, help="requests in the online sweep (0: no sweep)")
    ap.add_argument("--rates", default=None, help="online rates as multiples of naive's capacity, comma-separated (default 0.5,1.5,4)")
    ap.add_argument("--max-output", type=int)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--systems", default=None, help="comma-separated subset of " + ",".join(SYSTEMS) + " (default: all; --quick runs naive,static_contiguous,continuous_paged)")
    ap.add_argument("--model", default=None, help="a GGUF file or local Hugging Face folder")
    ap.add_argument("--attention", default="auto", choices=["auto", "torch", "triton"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="write the figures here")
    ap.add_argument("--plots", type=Path, help="write PNG plots into this folder")
    ap.add_argument("--no-shared-prefix", action="store_true", help="skip the shared-system-prompt workload (prefix caching off vs on)")
    ap.add_argument("--fp32-weights", action="store_true",
                    help="every minipaged system multiplies with the fp32 weights only (gguf_blocks=False): "
                         "batching as it pays when each step streams 4-byte weights")
    ap.add_argument("--no-progress", action="store_true")
    from ..flags import add_engine_flags

    add_engine_flags(ap, skip=BENCH_DECIDES, title="engine options for every minipaged system (minipaged.config.EngineConfig)")


# EngineConfig fields the bench sets itself, and why (every other field is a flag).
BENCH_DECIDES = {
    "block_size": "the bench's own --block-size",
    "num_blocks": "the KV budget every system shares, set by --static-batch",
    "kv_cache_bytes": "the KV budget every system shares, set by --static-batch",
    "record_trace": "always on: the memory figures are read from the trace",
}


def run(a: argparse.Namespace, ap: argparse.ArgumentParser | None = None) -> int:
    from ..flags import engine_kwargs

    ap = ap or getattr(a, "_parser", None) or argparse.ArgumentParser()
    rates = RATE_FACTORS
    if a.rates:
        try:
            rates = tuple(float(x) for x in a.rates.split(",") if x.strip())
        except ValueError:
            ap.error(f"--rates takes numbers separated by commas, e.g. 0.5,1.5,4; got {a.rates!r}")
        if not rates or min(rates) <= 0:
            ap.error(f"--rates must be positive multiples of naive's capacity, got {a.rates!r}")
    systems = tuple(s.strip() for s in a.systems.split(",") if s.strip()) if a.systems else None
    bad = [s for s in systems or () if s not in SYSTEMS]
    if bad:
        ap.error(f"unknown system(s) {', '.join(bad)}: choose from {', '.join(SYSTEMS)}")
    t0 = time.perf_counter()
    res = run_bench(
        quick=a.quick, workload=a.workload, num_requests=a.num_requests, static_batch=a.static_batch,
        naive_requests=a.naive_requests, online_requests=a.online_requests, rate_factors=rates,
        block_size=a.block_size, max_output=a.max_output, systems=systems, model_path=a.model,
        attention=a.attention, chat_prompts=a.chat_prompts, seed=a.seed, progress=not a.no_progress,
        shared_prefix=False if a.no_shared_prefix else None, gguf_blocks=False if a.fp32_weights else None,
        engine=engine_kwargs(a, skip=BENCH_DECIDES),
    )
    res["bench_seconds"] = time.perf_counter() - t0
    res["command"] = " ".join(["minipaged bench", *sys.argv[2:]]) if sys.argv[1:2] == ["bench"] else "minipaged bench"
    print()
    print(f"workload: {res['workload']['description']}")
    kb = res["kv_budget"]
    print(f"KV budget for every system: {kb['blocks']} blocks x {kb['block_size']} = {kb['mib']:.0f} MiB ({kb['note']})")
    print(format_table(res))
    if res.get("attribution"):
        print("\nwhat each idea buys (output tokens/s ratios):")
        print(format_attribution(res))
    tok = res.get("tokens")
    if tok:
        bad = {k: v for k, v in tok["systems"].items() if v["equal"] != v["compared"]}
        print(f"\ngreedy tokens equal to {tok['reference']}'s: " + ("every system, every request compared" if not bad else
              "; ".join(f"{k}: {v['equal']}/{v['compared']} (first differs: request {v['first_different']})" for k, v in bad.items())))
    if res.get("online"):
        print()
        print(format_online(res))
    c, rf = res["ceiling"], res["roofline"]
    print(f"\nthis machine: fp32 GEMM {c['gemm_gflops']:.0f} GFLOP/s, read {rf['bandwidth']['read_GBps']:.1f} GB/s, copy "
          f"{rf['bandwidth']['copy_GBps']:.1f} GB/s -> ridge {rf['ridge_flops_per_byte']:.1f} flops/byte; decode turns "
          f"compute-bound at batch ~{rf['predicted_compute_bound_batch']:.0f} (predicted), "
          + (f"~{rf['measured_compute_bound_batch']:.0f} (measured)" if rf["measured_compute_bound_batch"] else "not within the batches measured"))
    print(f"compute-bound limit {c['compute_bound_tokens_per_s']:.0f} tokens/s for this model:")
    for name, d in res["systems"].items():
        print(f"  {name:<22} {d['fraction_of_compute_bound'] * 100:5.1f}% of that limit" + (f"  ({d['note']})" if d.get("note") else ""))
    if "concurrency_ratio" in res:
        print(f"same KV memory: continuous_paged held {res['concurrency_ratio']:.1f}x the sequences static_contiguous could")
    print(f"bench took {res['bench_seconds']:.0f} s")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(to_json(res), indent=1))
        print(f"wrote {a.json}")
    if a.plots:
        for p in save_plots(res, a.plots):
            print(f"wrote {p}")
    return 0
