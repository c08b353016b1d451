"""`minipaged bench`: naive vs static vs continuous batching (and transformers) on the same requests.

Owns the measurement: one seeded workload, every system on it in one run, the same KV
budget for static and continuous, figures read from each system's own allocator state.
Prints a table, writes JSON and PNG plots.
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

from ..baselines import BatchRun, run_naive, run_static
from ..engine import LLMEngine
from ..kv_cache import kv_bytes_per_token
from ..sampling import SamplingParams
from .workloads import Workload, chat_prompt_ids, synthetic


# -- the machine's ceiling -----------------------------------------------------------------
def gemm_gflops(n: int = 1024, repeats: int = 8) -> float:
    """fp32 matmul rate of this machine (GFLOP/s), best of a few runs."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best / 1e9


def flops_per_token(model: torch.nn.Module, context_len: float) -> float:
    """Matmul FLOPs to generate one token: 2 per weight used (the embedding lookup is free,
    the output projection is not, tied or not) plus attention over ``context_len`` tokens."""
    cfg = model.config
    n = sum(p.numel() for name, p in model.named_parameters() if "embed" not in name)
    if cfg.tie_word_embeddings:
        n += cfg.vocab_size * cfg.hidden_size
    attn = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * context_len
    return 2 * n + attn


# -- the systems ---------------------------------------------------------------------------
def _summary(outputs_tokens: dict, ttft: dict, finish: dict, seconds: float, workload: Workload, ids: list[int]) -> dict:
    out_tok = sum(workload.requests[i].max_tokens for i in ids)
    in_tok = sum(len(workload.requests[i].prompt_token_ids) for i in ids)
    got = sum(min(len(outputs_tokens[i]), workload.requests[i].max_tokens) for i in ids)
    assert got == out_tok, f"a system generated {got} tokens where {out_tok} were asked for"
    lat = np.array([finish[i] for i in ids])
    tt = np.array([ttft[i] for i in ids])
    return {
        "num_requests": len(ids),
        "output_tokens": out_tok,
        "seconds": seconds,
        "output_tokens_per_s": out_tok / seconds,
        "total_tokens_per_s": (out_tok + in_tok) / seconds,
        "ttft_p50_s": float(np.percentile(tt, 50)),
        "ttft_p99_s": float(np.percentile(tt, 99)),
        "latency_p50_s": float(np.percentile(lat, 50)),
        "latency_p99_s": float(np.percentile(lat, 99)),
    }


def _memory(trace, bytes_per_token: int) -> dict:
    """KV reserved vs used, read from what the system's own allocator held at every step."""
    r = np.array([s.reserved_slots for s in trace.steps] or [0])
    u = np.array([s.used_slots for s in trace.steps] or [0])
    return {
        "kv_reserved_peak_mib": float(r.max() * bytes_per_token / 2**20),
        "kv_reserved_mean_mib": float(r.mean() * bytes_per_token / 2**20),
        "kv_used_peak_mib": float(u.max() * bytes_per_token / 2**20),
        "kv_used_mean_mib": float(u.mean() * bytes_per_token / 2**20),
        "kv_waste": float(trace.kv_waste()),
        "peak_concurrent_seqs": int(trace.peak_concurrency),
    }


def summarize_batch_run(run: BatchRun, workload: Workload, ids: list[int], bytes_per_token: int) -> dict:
    d = _summary(run.outputs, run.first_token_time, run.finish_time, run.seconds, workload, ids)
    d.update(_memory(run.trace, bytes_per_token))
    return d


def run_continuous(
    model: torch.nn.Module,
    workload: Workload,
    num_blocks: int,
    block_size: int = 16,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 1024,
    attention: Any = "auto",
    progress: bool = False,
) -> tuple[dict, LLMEngine]:
    """minipaged: continuous batching over the paged cache, greedy, EOS ignored."""
    eng = LLMEngine(
        model,
        None,
        attention=attention,
        block_size=block_size,
        num_blocks=num_blocks,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
    )
    ids = [eng.add_request(r.prompt_token_ids, SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True)) for r in workload.requests]
    eng.t0 = time.perf_counter()
    for s in (r.seq for r in eng.requests.values()):
        s.arrival_time = 0.0
    done = eng.run(progress=progress, desc="continuous batching")
    seconds = time.perf_counter() - eng.t0
    rej = [o for o in done.values() if o.finish_reason == "rejected"]
    if rej:
        raise RuntimeError(f"{len(rej)} request(s) rejected by the engine: {rej[0].error}")
    outs = {int(i): done[i].token_ids for i in ids}
    ttft = {int(i): done[i].metrics["first_token_time"] for i in ids}
    fin = {int(i): done[i].metrics["finish_time"] for i in ids}
    d = _summary(outs, ttft, fin, seconds, workload, list(range(len(ids))))
    d.update(_memory(eng.trace, eng.kv_bytes_per_token))
    d["peak_blocks_used"] = int(eng.trace.peak_blocks_used)
    d["preemptions"] = eng.scheduler.num_preemptions
    return d, eng


def load_hf_peer(model_path: str | None = None):
    """transformers' LlamaForCausalLM on the same weights, or None if transformers is absent."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return None
    from transformers import AutoModelForCausalLM

    from ..model import default_model_path

    path = Path(model_path) if model_path else default_model_path()
    if path.suffix == ".gguf":
        return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, torch_dtype=torch.float32).eval()
    return AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=torch.float32).eval()


@torch.inference_mode()
def run_hf(hf_model, workload: Workload, batch_size: int, pad_id: int = 0, progress: bool = False) -> dict:
    """``transformers.generate`` on padded batches of ``batch_size``: the static-batching peer."""
    reqs = workload.requests
    ttft, fin, outs = {}, {}, {}
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(reqs), desc="transformers.generate", unit="req")
    t0 = time.perf_counter()
    for b0 in range(0, len(reqs), batch_size):
        batch = list(range(b0, min(b0 + batch_size, len(reqs))))
        width = max(len(reqs[i].prompt_token_ids) for i in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, i in enumerate(batch):
            p = reqs[i].prompt_token_ids
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        n = max(reqs[i].max_tokens for i in batch)
        start = time.perf_counter() - t0
        dev = next(hf_model.parameters()).device
        gen = hf_model.generate(
            input_ids=ids.to(dev), attention_mask=mask.to(dev), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=pad_id
        )
        now = time.perf_counter() - t0
        for row, i in enumerate(batch):
            outs[i] = gen[row, width:].tolist()[: reqs[i].max_tokens]
            fin[i] = now
            ttft[i] = start  # generate returns all at once: the first token is not observable
        if bar is not None:
            bar.update(len(batch))
    if bar is not None:
        bar.close()
    d = _summary(outs, ttft, fin, time.perf_counter() - t0, workload, list(range(len(reqs))))
    d["peak_concurrent_seqs"] = batch_size
    d["kv_waste"] = None  # transformers' dynamic cache is not measured here
    return d


# -- the whole benchmark -------------------------------------------------------------------
def run_bench(
    quick: bool = False,
    workload: str = "sharegpt",
    num_requests: int | None = None,
    static_batch: int | None = None,
    naive_requests: int | None = None,
    block_size: int = 16,
    max_output: int | None = None,
    systems: tuple[str, ...] = ("naive", "static", "continuous", "hf"),
    model: Any = None,
    model_path: str | None = None,
    attention: str = "auto",
    chat_prompts: bool = False,
    seed: int = 0,
    progress: bool = True,
) -> dict:
    """Run every system on one workload. Static and continuous get the same KV budget:
    exactly what ``static_batch`` contiguous max-length reservations take."""
    torch.manual_seed(seed)
    num_requests = num_requests or (24 if quick else 64)
    static_batch = static_batch or (8 if quick else 16)
    naive_requests = naive_requests or (3 if quick else 8)
    max_output = max_output or (96 if quick else 384)
    max_prompt = 128 if quick else 512
    scale = 0.4 if quick else 1.0
    t = time.perf_counter()
    tokenizer = None
    if model is None:
        from ..model import load_model

        model, tokenizer = load_model(model_path, device="cuda" if torch.cuda.is_available() else "cpu")
    load_s = time.perf_counter() - t
    cfg = model.config
    # keep every request (prompt + output) inside the model's context
    max_output = min(max_output, cfg.max_position_embeddings // 2)
    max_prompt = min(max_prompt, cfg.max_position_embeddings - max_output)
    real = chat_prompt_ids(tokenizer) if chat_prompts and tokenizer is not None else None
    wl = synthetic(workload, num_requests, seed, vocab_size=cfg.vocab_size, max_output=max_output, max_prompt=max_prompt, real_prompts=real, scale=scale)
    reqs = [(r.prompt_token_ids, r.max_tokens) for r in wl.requests]
    reserve_len = max(len(r.prompt_token_ids) for r in wl.requests) + max(r.max_tokens for r in wl.requests)
    bpt = kv_bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, next(model.parameters()).dtype)
    budget_blocks = static_batch * -(-reserve_len // block_size)
    result: dict = {
        "workload": wl.summary(),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__, "threads": torch.get_num_threads()},
        "model": {"name": cfg.name, "load_seconds": load_s},
        "kv_budget": {
            "blocks": budget_blocks,
            "block_size": block_size,
            "mib": budget_blocks * block_size * bpt / 2**20,
            "reserve_len": reserve_len,
            "note": f"the memory {static_batch} contiguous reservations of {reserve_len} tokens take; static and continuous both get it",
        },
        "systems": {},
    }
    gf = gemm_gflops()
    fpt = flops_per_token(model, np.mean([len(r.prompt_token_ids) + r.max_tokens / 2 for r in wl.requests]))
    result["ceiling"] = {"gemm_gflops": gf, "flops_per_token": fpt, "compute_bound_tokens_per_s": gf * 1e9 / fpt}
    S = result["systems"]
    traces: dict = {}
    result["_traces"] = traces
    if "naive" in systems:
        sub = Workload(wl.name, wl.requests[:naive_requests], seed, wl.description)
        run = run_naive(model, reqs[:naive_requests], reserve_len, block_size=block_size, attention=attention, progress=progress)
        S["naive"] = summarize_batch_run(run, sub, list(range(naive_requests)), bpt)
        traces["naive"] = run.trace
        S["naive"]["note"] = f"measured on the first {naive_requests} requests (one at a time: its rate does not depend on how many)"
    if "static" in systems:
        run = run_static(model, reqs, static_batch, reserve_len, block_size=block_size, attention=attention, progress=progress)
        S["static"] = summarize_batch_run(run, wl, list(range(len(reqs))), bpt)
        traces["static"] = run.trace
    if "continuous" in systems:
        d, eng = run_continuous(model, wl, budget_blocks, block_size, attention=attention, progress=progress)
        S["continuous"] = d
        traces["continuous"] = eng.trace
    if "hf" in systems:
        hf = load_hf_peer(model_path)
        if hf is not None:
            hf = hf.to(next(model.parameters()).device)
        if hf is not None:
            S["hf"] = run_hf(hf, wl, static_batch, progress=progress)
            del hf
    for name, d in S.items():
        d["fraction_of_compute_bound"] = d["output_tokens_per_s"] / result["ceiling"]["compute_bound_tokens_per_s"]
        for ref in ("naive", "static"):
            if ref in S and ref != name:
                d[f"x_{ref}"] = d["output_tokens_per_s"] / S[ref]["output_tokens_per_s"]
    if "static" in S and "continuous" in S:
        result["concurrency_ratio"] = S["continuous"]["peak_concurrent_seqs"] / S["static"]["peak_concurrent_seqs"]
    return result


def format_table(result: dict) -> str:
    rows = [("system", "out tok/s", "x naive", "x static", "TTFT p50", "lat p50", "lat p99", "KV waste", "peak seqs")]
    for name, d in result["systems"].items():
        f = lambda k, fmt: (fmt.format(d[k]) if d.get(k) is not None else "-")  # noqa: E731
        rows.append((
            name, f("output_tokens_per_s", "{:.1f}"), f("x_naive", "{:.2f}"), f("x_static", "{:.2f}"),
            f("ttft_p50_s", "{:.2f}s"), f("latency_p50_s", "{:.2f}s"), f("latency_p99_s", "{:.2f}s"),
            (f"{d['kv_waste'] * 100:.1f}%" if d.get("kv_waste") is not None else "-"), str(d.get("peak_concurrent_seqs", "-")),
        ))
    w = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w[i]) if i else c.ljust(w[i]) for i, c in enumerate(r)) for r in rows]
    lines.insert(1, "  ".join("-" * x for x in w))
    return "\n".join(lines)


def save_plots(result: dict, folder: Path) -> list[Path]:
    """PNG plots of a result (needs matplotlib: the `course` extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        from .. import viz
    except ImportError:
        return []
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    S = result["systems"]
    fig = viz.plot_throughput(S)
    paths.append(folder / "throughput.png")
    fig.savefig(paths[-1], dpi=110, bbox_inches="tight")
    # naive ran a subset of the requests: leave it out of the pictures of the whole workload
    traces = {k: t for k, t in result.get("_traces", {}).items() if k in ("static", "continuous")}
    if "static" in traces and "continuous" in traces:
        fig = viz.plot_timeline(traces)
        paths.append(folder / "timeline.png")
        fig.savefig(paths[-1], dpi=110, bbox_inches="tight")
    if traces:
        fig = viz.plot_kv_usage(traces)
        paths.append(folder / "kv_usage.png")
        fig.savefig(paths[-1], dpi=110, bbox_inches="tight")
    if "continuous" in traces:
        fig = viz.plot_page_table(traces["continuous"])
        paths.append(folder / "page_table.png")
        fig.savefig(paths[-1], dpi=110, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close("all")
    return paths


def to_json(result: dict) -> dict:
    out = {k: v for k, v in result.items() if not k.startswith("_")}
    out["timelines"] = {n: t.timeline() for n, t in result.get("_traces", {}).items()}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="minipaged bench", description=__doc__)
    ap.add_argument("--quick", action="store_true", help="a small workload that finishes in under two minutes")
    ap.add_argument("--workload", default="sharegpt", choices=["sharegpt", "alpaca"])
    ap.add_argument("--chat-prompts", action="store_true", help="use real chat prompts (the demo model's template) instead of random tokens")
    ap.add_argument("--num-requests", type=int)
    ap.add_argument("--static-batch", type=int, help="static batch size; also sets the KV budget both systems get")
    ap.add_argument("--naive-requests", type=int, help="how many requests the naive server runs (its rate)")
    ap.add_argument("--max-output", type=int)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--systems", default="naive,static,continuous,hf", help="comma-separated subset")
    ap.add_argument("--model", default=None, help="a GGUF file or local Hugging Face folder")
    ap.add_argument("--attention", default="auto", choices=["auto", "torch", "triton"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="write the figures here")
    ap.add_argument("--plots", type=Path, help="write PNG plots into this folder")
    ap.add_argument("--no-progress", action="store_true")
    a = ap.parse_args(argv)
    res = run_bench(
        quick=a.quick, workload=a.workload, num_requests=a.num_requests, static_batch=a.static_batch,
        naive_requests=a.naive_requests, block_size=a.block_size, max_output=a.max_output,
        systems=tuple(s.strip() for s in a.systems.split(",") if s.strip()), model_path=a.model,
        attention=a.attention, chat_prompts=a.chat_prompts, seed=a.seed, progress=not a.no_progress,
    )
    res["command"] = " ".join(["minipaged bench", *(argv if argv is not None else sys.argv[1:])])
    print()
    print(f"workload: {res['workload']['description']}")
    kb = res["kv_budget"]
    print(f"KV budget for static and continuous: {kb['blocks']} blocks x {kb['block_size']} = {kb['mib']:.0f} MiB ({kb['note']})")
    print(format_table(res))
    c = res["ceiling"]
    print(f"\nthis machine: fp32 GEMM {c['gemm_gflops']:.0f} GFLOP/s -> compute-bound limit {c['compute_bound_tokens_per_s']:.0f} tokens/s for this model")
    for name, d in res["systems"].items():
        print(f"  {name:<10} {d['fraction_of_compute_bound'] * 100:5.1f}% of that limit" + (f"  ({d['note']})" if d.get("note") else ""))
    if "concurrency_ratio" in res:
        print(f"same KV memory: continuous+paged held {res['concurrency_ratio']:.1f}x the sequences static batching could")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(to_json(res), indent=1))
        print(f"wrote {a.json}")
    if a.plots:
        for p in save_plots(res, a.plots):
            print(f"wrote {p}")
    return 0
