"""`minipaged bench speed`: how close the engine gets to this machine's fp32 GEMM limit, side by side.

Owns one measurement, all in one run so that every figure shares the machine's state:
64 real chat requests x 64 new tokens (greedy, EOS ignored, fp32), served by minipaged at
batch 64 and by transformers' ``generate`` at batch 64 on the same requests and weights; the
machine's fp32 GEMM rate; and, if ``llama-cpp-python`` is installed, single-stream (batch 1)
speed of llama.cpp against minipaged on the same GGUF file. It prints a summary and writes JSON.
It never changes the engine; it only drives it through ``LLMEngine``'s public API.

The ceiling counts 2 FLOPs per weight per token (the decoder's weights for every token that
goes through the body: prompt tokens and all but the last output token; the LM head's only for
the output tokens, where it runs) and divides by the GEMM rate measured in the same run:

    ceiling tok/s = output tokens / (FLOPs / GEMM FLOP/s)

Attention's own FLOPs are not counted (a generous ceiling: the engine must do them too).
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

import torch

from ..cpu.build import gguf_matmul_kernel
from ..sampling import SamplingParams
from . import save_run
from .commands import add_threads_argument, apply_threads
from .workloads import Request, Workload, chat_prompt_ids

GOALS = {"x_transformers": 2.0, "fraction_of_ceiling": 0.60, "llama_cpp_batch1_slowdown_max": 1.5}


# -- the ceiling ------------------------------------------------------------------------------
def gemm_rate(n: int = 1024, seconds: float = 1.0) -> float:
    """This machine's fp32 matmul rate in FLOP/s: the best of repeated n x n x n products over ~``seconds``."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    c = torch.empty(n, n)
    torch.mm(a, b, out=c)
    best, t_end = float("inf"), time.perf_counter() + seconds
    while True:
        t = time.perf_counter()
        torch.mm(a, b, out=c)
        best = min(best, time.perf_counter() - t)
        if time.perf_counter() > t_end:
            break
    return 2 * n**3 / best


def model_weights(model: torch.nn.Module) -> dict[str, int]:
    """Weights a token multiplies through: the decoder body (every layer and the final norm) and the LM head."""
    cfg = model.config
    body = sum(p.numel() for name, p in model.named_parameters() if name.startswith(("layers.", "norm.")))
    head = cfg.vocab_size * cfg.hidden_size  # tied or not, the head is one (vocab x hidden) matmul
    return {"body": body, "lm_head": head}


def workload_flops(model: torch.nn.Module, requests: list[Request]) -> float:
    """2 x weights FLOPs per token: the body for prompt + output - 1 tokens, the head for output tokens."""
    w = model_weights(model)
    body_tokens = sum(len(r.prompt_token_ids) + r.max_tokens - 1 for r in requests)
    head_tokens = sum(r.max_tokens for r in requests)
    return 2.0 * (w["body"] * body_tokens + w["lm_head"] * head_tokens)


def chat_workload(tokenizer, num_requests: int = 64, max_tokens: int = 64) -> Workload:
    """``num_requests`` real chat prompts (the 16 of workloads.CHAT_PROMPTS in turn), each ``max_tokens`` long."""
    ids = chat_prompt_ids(tokenizer)
    reqs = [Request(list(ids[i % len(ids)]), max_tokens) for i in range(num_requests)]
    return Workload("chat", reqs, 0, f"{num_requests} chat requests x {max_tokens} new tokens, greedy, EOS ignored, fp32")


# -- the systems ------------------------------------------------------------------------------
def run_minipaged(model, tokenizer, requests: list[Request], max_num_seqs: int, max_num_batched_tokens: int,
                  block_size: int = 16, attention: Any = "auto", **switches: Any) -> dict:
    """Serve every request at once (continuous batching, at most ``max_num_seqs`` together).
    ``switches`` are EngineConfig's fast-path fields (``gguf_blocks=False``: every matmul on the
    fp32 weights, the "fp32" system: what the GGUF matmul buys; ``fast_paths=False``: the plain route)."""
    from ..engine import LLMEngine

    longest = max(len(r.prompt_token_ids) + r.max_tokens for r in requests)
    num_blocks = min(len(requests), max_num_seqs) * -(-longest // block_size) + 1
    eng = LLMEngine(
        model, tokenizer, attention=attention, block_size=block_size, num_blocks=num_blocks,
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, record_trace=False,
        # The workload repeats 16 prompts: with prefix caching a later copy would skip its cached
        # blocks, which transformers and the ceiling (every prompt token counted) do not. Off, so
        # all three compute the same tokens.
        enable_prefix_caching=False, **switches,
    )
    t0 = time.perf_counter()
    ids = [eng.add_request(r.prompt_token_ids, SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True))
           for r in requests]
    done = eng.run()
    seconds = time.perf_counter() - t0
    outs = [done[i] for i in ids]
    got = sum(len(o.token_ids) for o in outs)
    want = sum(r.max_tokens for r in requests)
    if any(len(o.token_ids) != r.max_tokens for o, r in zip(outs, requests)):
        raise RuntimeError(f"minipaged generated {got} tokens where {want} were asked for: the bench needs EOS ignored")
    return {"seconds": seconds, "output_tokens": got, "output_tokens_per_s": got / seconds, "steps": eng.num_steps,
            "plan": eng.plan.as_dict(), "routes": dict(eng.route_counts),
            "weight_bytes_per_token": eng.executor.weight_bytes_read(), "token_ids": [o.token_ids for o in outs]}


def run_transformers(hf_model, requests: list[Request], batch_size: int, pad_id: int = 0) -> dict:
    """transformers' ``generate`` on left-padded batches of ``batch_size``, greedy, exactly max_tokens each."""
    from .baselines import run_hf

    res = run_hf(hf_model, [(r.prompt_token_ids, r.max_tokens) for r in requests], batch_size, pad_id=pad_id)
    got = sum(len(res.outputs[i]) for i in range(len(requests)))
    return {"seconds": res.seconds, "output_tokens": got, "output_tokens_per_s": got / res.seconds, "batch_size": batch_size}


def run_batch1_minipaged(model, tokenizer, requests: list[Request], attention: Any = "auto", **switches: Any) -> dict:
    """One request at a time through the engine: single-stream decode speed."""
    out = run_minipaged(model, tokenizer, requests[:1], 1, 512, attention=attention, **switches)  # warm-up
    tokens, seconds = 0, 0.0
    for r in requests:
        out = run_minipaged(model, tokenizer, [r], 1, 512, attention=attention, **switches)
        tokens += out["output_tokens"]
        seconds += out["seconds"]
    return {"requests": len(requests), "output_tokens": tokens, "seconds": seconds, "output_tokens_per_s": tokens / seconds}


def llama_cpp_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


_LLAMA_CPP_SCRIPT = r"""
import json, sys, time
from llama_cpp import Llama

args = json.loads(sys.argv[1])
prompts, max_tokens = args["prompts"], args["max_tokens"]
llm = Llama(model_path=args["path"], n_ctx=max(len(p) for p in prompts) + max_tokens + 8, n_threads=args["threads"],
            n_batch=512, verbose=False, seed=0)

def one(prompt):
    llm.reset()
    n = 0
    for _ in llm.generate(prompt, temp=0.0, top_k=1, reset=True):  # generate() never stops on EOS by itself
        n += 1
        if n == max_tokens:
            break
    return n

one(prompts[0])  # warm-up
t = time.perf_counter()
tokens = sum(one(p) for p in prompts)
print(json.dumps({"output_tokens": tokens, "seconds": time.perf_counter() - t}))
"""


def run_batch1_llama_cpp(gguf_path: Path, requests: list[Request], threads: int, timeout_s: float = 600.0) -> dict:
    """llama.cpp (llama-cpp-python) on the same GGUF file, one request at a time, greedy, EOS ignored.

    It runs in a child process: a crash inside llama.cpp (a native library) must not take the
    other figures of the run with it; it is reported as skipped, with the exit status."""
    import subprocess

    if len({r.max_tokens for r in requests}) != 1:
        raise ValueError("the batch-1 comparison wants one max_tokens for every request")
    args = json.dumps({"path": str(gguf_path), "prompts": [list(r.prompt_token_ids) for r in requests],
                       "max_tokens": requests[0].max_tokens, "threads": threads})
    try:
        p = subprocess.run([sys.executable, "-c", _LLAMA_CPP_SCRIPT, args], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"skipped": f"llama.cpp did not finish within {timeout_s:.0f} s"}
    if p.returncode != 0:
        why = f"signal {-p.returncode}" if p.returncode < 0 else f"exit status {p.returncode}"
        tail = (p.stderr or "").strip().splitlines()[-1:] or [""]
        return {"skipped": f"llama-cpp-python is installed but its run failed ({why}) {tail[0]}".strip()}
    d = json.loads(p.stdout.strip().splitlines()[-1])
    d.update(requests=len(requests), output_tokens_per_s=d["output_tokens"] / d["seconds"], threads=threads,
             weights=f"{gguf_path.name} as stored (llama.cpp computes on the quantized blocks; minipaged on fp32 copies)")
    return d


# -- the whole run ----------------------------------------------------------------------------
def _say(name: str, d: dict) -> None:
    """One line per finished system on stderr, so a long run shows its figures as they come."""
    if "output_tokens_per_s" in d:
        print(f"[bench speed] {name}: {d['output_tokens_per_s']:.1f} tok/s ({d['output_tokens']} tokens in {d['seconds']:.1f} s)",
              file=sys.stderr, flush=True)


def run_speed(num_requests: int = 64, max_tokens: int = 64, batch_size: int = 64, max_num_batched_tokens: int = 2048,
              batch1_requests: int = 4, systems: tuple[str, ...] = ("minipaged", "transformers", "batch1"),
              attention: str = "auto", check_outputs: bool = True, repeats: int = 1) -> dict:
    """Everything in one run; figures and ratios in one dict (see the module docstring)."""
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
    from ..model import default_model_path, load_model

    t = time.perf_counter()
    model, tok = load_model(None, dtype=torch.float32, device="cpu")
    load_s = time.perf_counter() - t
    wl = chat_workload(tok, num_requests, max_tokens)
    flops = workload_flops(model, wl.requests)
    out_tokens = sum(r.max_tokens for r in wl.requests)
    res: dict = {
        "workload": wl.summary(),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                    "threads": torch.get_num_threads(), "gguf_matmul": gguf_matmul_kernel()},
        "model": {"name": model.config.name, "load_seconds": load_s, "weights": model_weights(model), "dtype": "float32"},
        "goals": dict(GOALS),
        "systems": {},
    }
    gemm_before = gemm_rate()
    S = res["systems"]
    hf = None
    if "transformers" in systems:
        from .baselines import load_hf_peer

        hf = load_hf_peer(str(default_model_path()))
        if hf is None:
            S["transformers"] = {"skipped": "transformers is not installed (pip install 'minipaged[course]')"}
    if "minipaged" in systems:
        run_minipaged(model, tok, wl.requests[:2], 2, 512, attention=attention)  # warm-up: first-call costs are not serving
    # The two systems take turns, ``repeats`` times, so that a slow spell of the machine hits both;
    # each reports its median run (every run is kept under "runs_tokens_per_s").
    mp_runs, fp32_runs, hf_runs, token_ids = [], [], [], None
    for _ in range(repeats):
        if "minipaged" in systems:
            d = run_minipaged(model, tok, wl.requests, batch_size, max_num_batched_tokens, attention=attention)
            token_ids = d.pop("token_ids")
            mp_runs.append(d)
        if "fp32" in systems:
            d = run_minipaged(model, tok, wl.requests, batch_size, max_num_batched_tokens, attention=attention,
                              gguf_blocks=False)
            d.pop("token_ids")
            fp32_runs.append(d)
        if hf is not None:
            hf_runs.append(run_transformers(hf, wl.requests, batch_size))
    if mp_runs:
        S["minipaged"] = dict(_median_run(mp_runs), batch_size=batch_size, max_num_batched_tokens=max_num_batched_tokens,
                              attention=attention)
        _say("minipaged", S["minipaged"])
    if fp32_runs:
        S["minipaged_fp32"] = dict(_median_run(fp32_runs), batch_size=batch_size,
                                   max_num_batched_tokens=max_num_batched_tokens, attention=attention)
        _say("minipaged_fp32", S["minipaged_fp32"])
    if hf_runs:
        S["transformers"] = _median_run(hf_runs)
        _say("transformers", S["transformers"])
        if check_outputs and token_ids is not None:
            # generate's min_new_tokens forbids EOS, while ignore_eos lets it be sampled and goes on:
            # the two runs are the same work, and their tokens agree up to minipaged's first EOS
            hf_ids = _hf_greedy_ids(hf, wl.requests[:1])[0]
            mine = token_ids[0]
            same = next((i for i, (a, b) in enumerate(zip(mine, hf_ids)) if a != b), len(mine))
            eos = set(model.config.eos_token_ids or ())
            first_eos = next((i for i, t in enumerate(mine) if t in eos), len(mine))
            S["transformers"]["greedy_check"] = {
                "equal_tokens": same, "minipaged_first_eos": first_eos, "agree_until_eos": same >= first_eos}
    del hf
    gemm_after = gemm_rate()
    gemm = max(gemm_before, gemm_after)
    res["ceiling"] = {
        "gemm_gflops": gemm / 1e9, "gemm_gflops_before": gemm_before / 1e9, "gemm_gflops_after": gemm_after / 1e9,
        "workload_gflop": flops / 1e9, "output_tokens": out_tokens,
        "tokens_per_s": out_tokens / (flops / gemm),
        "rule": "2 FLOPs per weight per token: body for prompt + output - 1 tokens, LM head for output tokens; "
                "attention FLOPs not counted; GEMM rate = best fp32 1024^3 matmul, measured before and after the systems",
    }
    if "batch1" in systems:
        from .hardware import bandwidth

        # One stream reads every weight once per token: at batch 1 the bound is memory, not GEMM.
        read = bandwidth()["read_GBps"] * 1e9
        w = model_weights(model)
        fp32_bytes = 4 * (w["body"] + w["lm_head"])
        gguf_bytes = default_model_path().stat().st_size
        reads = S["minipaged"]["weight_bytes_per_token"] if "minipaged" in S else None
        mine = reads or fp32_bytes
        res["batch1_bound"] = {
            "read_gbps": read / 1e9, "fp32_weight_bytes": fp32_bytes, "fp32_tokens_per_s": read / fp32_bytes,
            "gguf_bytes": gguf_bytes, "gguf_tokens_per_s": read / gguf_bytes,
            "minipaged_reads": "GGUF blocks (integers + fp32 scales)" if reads else "fp32 copies",
            "minipaged_weight_bytes": mine, "minipaged_tokens_per_s": read / mine,
            "rule": "one token at batch 1 reads every weight once: tokens/s <= read bandwidth / weight bytes "
                    "(minipaged: its GGUF blocks where it multiplies from them, else the fp32 copies; llama.cpp: "
                    "the GGUF file's quantized blocks)",
        }
        reqs = wl.requests[:batch1_requests]
        S["minipaged_batch1"] = run_batch1_minipaged(model, tok, reqs, attention=attention)
        _say("minipaged_batch1", S["minipaged_batch1"])
        if llama_cpp_available():
            S["llama_cpp_batch1"] = run_batch1_llama_cpp(default_model_path(), reqs, torch.get_num_threads())
            _say("llama_cpp_batch1", S["llama_cpp_batch1"])
        else:
            S["llama_cpp_batch1"] = {"skipped": "llama-cpp-python is not installed (pip install llama-cpp-python; it compiles llama.cpp)"}
    res["ratios"] = ratios(res)
    return res


def _median_run(runs: list[dict]) -> dict:
    """The run with the median throughput (the lower middle one for an even count), with every
    run's tokens/s beside it."""
    order = sorted(runs, key=lambda d: d["output_tokens_per_s"])
    return dict(order[(len(order) - 1) // 2], runs_tokens_per_s=[d["output_tokens_per_s"] for d in runs])


def _hf_greedy_ids(hf_model, requests: list[Request]) -> list[list[int]]:
    out = []
    with torch.inference_mode():
        for r in requests:
            ids = torch.tensor([r.prompt_token_ids])
            g = hf_model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=r.max_tokens,
                                  min_new_tokens=r.max_tokens, do_sample=False, pad_token_id=0)
            out.append(g[0, ids.shape[1]:].tolist())
    return out


def ratios(res: dict) -> dict:
    """The goal figures: x transformers, fraction of the ceiling, llama.cpp's single-stream lead."""
    S, r = res["systems"], {}
    mp = S.get("minipaged", {}).get("output_tokens_per_s")
    hf = S.get("transformers", {}).get("output_tokens_per_s")
    ceil = res.get("ceiling", {}).get("tokens_per_s")
    if mp and hf:
        r["x_transformers"] = mp / hf
    if mp and ceil:
        r["fraction_of_ceiling"] = mp / ceil
    if hf and ceil:
        r["transformers_fraction_of_ceiling"] = hf / ceil
    f32 = S.get("minipaged_fp32", {}).get("output_tokens_per_s")
    if mp and f32:
        r["gguf_matmul_gain"] = mp / f32  # what multiplying from the GGUF blocks buys at batch 64
    b1, lc = S.get("minipaged_batch1", {}).get("output_tokens_per_s"), S.get("llama_cpp_batch1", {}).get("output_tokens_per_s")
    if b1 and lc:
        r["llama_cpp_batch1_slowdown"] = lc / b1  # how many times faster llama.cpp is at batch 1
    met = {}
    if "x_transformers" in r:
        met["x_transformers"] = r["x_transformers"] >= GOALS["x_transformers"]
    if "fraction_of_ceiling" in r:
        met["fraction_of_ceiling"] = r["fraction_of_ceiling"] >= GOALS["fraction_of_ceiling"]
    if "llama_cpp_batch1_slowdown" in r:
        met["llama_cpp_batch1"] = r["llama_cpp_batch1_slowdown"] <= GOALS["llama_cpp_batch1_slowdown_max"]
    r["goals_met"] = met
    return r


def format_summary(res: dict) -> str:
    S, r, c = res["systems"], res["ratios"], res["ceiling"]
    lines = [f"workload: {res['workload']['description']}",
             f"fp32 GEMM: {c['gemm_gflops']:.0f} GFLOP/s -> ceiling {c['tokens_per_s']:.0f} output tok/s for this workload"]
    for name, d in S.items():
        if "skipped" in d:
            lines.append(f"  {name:<18} skipped: {d['skipped']}")
        else:
            runs = d.get("runs_tokens_per_s") or []
            spread = (f"; median of {len(runs)} runs: " + ", ".join(f"{v:.1f}" for v in runs)) if len(runs) > 1 else ""
            lines.append(f"  {name:<18} {d['output_tokens_per_s']:8.1f} tok/s  ({d['output_tokens']} tokens in {d['seconds']:.1f} s{spread})")
    if "x_transformers" in r:
        lines.append(f"minipaged / transformers.generate at batch {S['transformers']['batch_size']}: {r['x_transformers']:.2f}x "
                     f"(goal {GOALS['x_transformers']}x)")
    if "gguf_matmul_gain" in r:
        lines.append(f"the GGUF matmul: {r['gguf_matmul_gain']:.2f}x minipaged on its fp32 copy (minipaged_fp32)")
    if "fraction_of_ceiling" in r:
        lines.append(f"minipaged at {r['fraction_of_ceiling'] * 100:.0f}% of the fp32 GEMM ceiling (goal {GOALS['fraction_of_ceiling'] * 100:.0f}%)")
        if res.get("machine", {}).get("gguf_matmul") == "AMX tiles":
            lines.append("  (its GGUF matmul ran on AMX tiles, which the fp32 FMA rate does not bound: that ceiling is "
                         "transformers' here, not minipaged's)")
    if "llama_cpp_batch1_slowdown" in r:
        lines.append(f"batch 1: llama.cpp is {r['llama_cpp_batch1_slowdown']:.2f}x minipaged (goal at most {GOALS['llama_cpp_batch1_slowdown_max']}x)")
    b = res.get("batch1_bound")
    if b:
        mine = b.get("minipaged_weight_bytes", b["fp32_weight_bytes"])
        lines.append(f"batch 1 is memory-bound: {b['read_gbps']:.1f} GB/s read / {mine / 1e6:.0f} MB of weights "
                     f"({b.get('minipaged_reads', 'fp32 copies')}) = at most {b['read_gbps'] * 1e9 / mine:.0f} tok/s for "
                     f"minipaged (with the fp32 copies: {b['fp32_tokens_per_s']:.0f}); llama.cpp reads "
                     f"{b['gguf_bytes'] / 1e6:.0f} MB of quantized weights: at most {b['gguf_tokens_per_s']:.0f} tok/s")
    return "\n".join(lines)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=64, help="minipaged's max_num_seqs and transformers' batch")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--batch1-requests", type=int, default=4, help="requests served one at a time for the batch-1 figures")
    ap.add_argument("--systems", default="minipaged,transformers,batch1",
                    help="comma-separated subset of minipaged, fp32 (minipaged on its fp32 weights only, "
                         "without the GGUF matmul), transformers, batch1")
    ap.add_argument("--attention", default="auto", choices=["auto", "cpu", "torch", "reference"])
    ap.add_argument("--repeats", type=int, default=3,
                    help="runs of minipaged and transformers, taking turns; each reports its median run (default 3)")
    ap.add_argument("--json", type=Path, help="write the figures here")
    add_threads_argument(ap)


def run(a: argparse.Namespace, ap: argparse.ArgumentParser | None = None) -> int:
    ap = ap or getattr(a, "_parser", None) or argparse.ArgumentParser(prog="minipaged bench speed")
    apply_threads(a, ap)
    for name, v in (("--num-requests", a.num_requests), ("--max-tokens", a.max_tokens), ("--batch-size", a.batch_size),
                    ("--max-num-batched-tokens", a.max_num_batched_tokens), ("--batch1-requests", a.batch1_requests),
                    ("--repeats", a.repeats)):
        if v < 1:
            ap.error(f"{name} must be >= 1, got {v}")
    systems = tuple(s.strip() for s in a.systems.split(",") if s.strip())
    unknown = set(systems) - {"minipaged", "fp32", "transformers", "batch1"}
    if unknown:
        ap.error(f"unknown system(s) {sorted(unknown)}: choose from minipaged, transformers, batch1")
    res = run_speed(a.num_requests, a.max_tokens, a.batch_size, a.max_num_batched_tokens, a.batch1_requests, systems, a.attention,
                    repeats=a.repeats)
    print(format_summary(res))
    save_run(res, a)
    return 0
