"""The shared-prefix workload: requests that share a long system prompt, with the prefix cache on and off.

Owns this one measurement: the same chat requests (one system prompt, a different question
each) served by two engines that differ only in ``enable_prefix_caching``, and what each
computed, held and took: TTFT, throughput, prompt tokens computed, peak KV blocks and bytes,
hit rate. Also parallel sampling: one prompt with ``n`` samples against ``n`` separate
requests, in peak KV blocks. It prints and returns figures; it asserts nothing about speed.

    minipaged bench prefix [--requests 8] [--max-tokens 16] [--block-size 16]
"""
from __future__ import annotations

import argparse
import time
from typing import Any

from . import off_on_rows, save_run, text_table

SYSTEM_PROMPT = (
    "You are a patient teaching assistant for a course on how large language model servers work. "
    "The course covers the key-value cache, paged memory in blocks, block tables that map a sequence's "
    "logical blocks to physical ones, the paged attention kernel, continuous batching with a token budget, "
    "preemption by recomputation, and sharing blocks between requests with a prefix cache and copy-on-write. "
    "Answer in at most two short sentences, use plain words, and when a number matters, give the number. "
    "If a question is outside the course, say so politely and suggest which lesson to read instead. "
    "Never invent an API that the course does not show, and prefer a small example to a long definition."
)
QUESTIONS = [
    "What is a KV block?", "Why do block tables exist?", "What does preemption cost?",
    "When is a prefix cache hit possible?", "What is copy-on-write?", "Why chain the block hashes?",
    "What is the token budget?", "Why recompute the last prompt token?", "What does TTFT measure?",
    "Why are full blocks immutable?", "What is continuous batching?", "What limits concurrency?",
]


def shared_prefix_prompts(tokenizer, num_requests: int = 8) -> list[list[int]]:
    """``num_requests`` chat prompts (token ids): the same system prompt, a different question each."""
    out = []
    for i in range(num_requests):
        q = QUESTIONS[i % len(QUESTIONS)] + ("" if i < len(QUESTIONS) else f" (variant {i // len(QUESTIONS)})")
        msgs = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": q}]
        out.append(tokenizer.encode(tokenizer.apply_chat_template(msgs, add_generation_prompt=True)))
    return out


def _serve(model, tokenizer, prompts, params, first_alone: bool = False, **engine_kw) -> dict:
    """Serve ``prompts``; with ``first_alone`` the first one runs to the end before the others
    arrive together (a server that has answered one user when the rest come), and TTFT and
    throughput are those of the others."""
    from ..engine import LLMEngine

    eng = LLMEngine(model, tokenizer, **engine_kw)
    first = []
    if first_alone:
        rid = eng.add_request({"prompt_token_ids": prompts[0]}, params)
        first = [eng.run()[rid]]
        prompts = prompts[1:]
    from .gpu.validate import record_steps

    with record_steps(eng) as rec:  # what each step scheduled, untimed: a cost model prices the same steps
        t0 = time.perf_counter()
        ids = [eng.add_request({"prompt_token_ids": p} if isinstance(p, list) else p, params) for p in prompts]
        done = eng.run()
        wall = time.perf_counter() - t0
    outs = [done[i] for i in ids]
    ttft = [o.metrics["first_token_time"] - o.metrics["arrival_time"] for o in outs]
    gen = sum(sum(len(c.token_ids) for c in getattr(o, "outputs", None) or [o]) for o in outs)
    trace = eng.trace
    prefill = sum(s.prefill_tokens for s in trace.steps) if trace is not None else None
    peak = trace.peak_blocks_used if trace is not None else None
    block_bytes = eng.kv_cache.nbytes // eng.allocator.num_blocks
    stats = getattr(eng.scheduler, "prefix_stats", None)
    return {
        "outputs": [list(o.token_ids) for o in first + outs],
        "samples": [[list(c.token_ids) for c in o.outputs] for o in outs],
        "ttft_mean_s": sum(ttft) / len(ttft),
        "ttft_max_s": max(ttft),
        "seconds": wall,
        "output_tokens_per_s": gen / wall if wall > 0 else 0.0,
        "prompt_tokens": sum(len(p) for p in prompts) + sum(len(o.prompt_token_ids) for o in first),
        "prompt_tokens_computed": prefill,
        "peak_blocks_used": peak,
        "peak_kv_mib": peak * block_bytes / 2**20 if peak is not None else None,
        "hit_rate": stats.hit_rate if stats is not None else 0.0,
        "evictions": getattr(getattr(eng.scheduler, "allocator", None), "num_evictions", 0),
        "steps": eng.num_steps,
        "scheduled_steps": [list(step) for step in rec.steps],  # the timed part's steps: (start, num_new) per sequence
    }


def bench_shared_prefix(model=None, tokenizer=None, num_requests: int = 8, max_tokens: int = 16,
                        block_size: int = 16, max_num_batched_tokens: int = 512, **engine_kw: Any) -> dict:
    """Serve the shared-prefix workload with the prefix cache off, then on; return both runs' figures.

    The first request runs alone, then the other ``num_requests - 1`` arrive together; TTFT and
    throughput are theirs, prompt tokens computed and peak KV blocks cover the whole run.
    Greedy, so both runs must produce the same tokens (``same_tokens`` says whether they did).
    """
    from ..sampling import SamplingParams

    if model is None:
        from ..model import load_model

        model, tokenizer = load_model(None)
    prompts = shared_prefix_prompts(tokenizer, num_requests)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    kw = dict(block_size=block_size, max_num_batched_tokens=max_num_batched_tokens, **engine_kw)
    _serve(model, tokenizer, prompts[:1], SamplingParams(max_tokens=2, temperature=0), **kw)  # warm-up, not measured
    off = _serve(model, tokenizer, prompts, params, first_alone=True, enable_prefix_caching=False, **kw)
    on = _serve(model, tokenizer, prompts, params, first_alone=True, enable_prefix_caching=True, **kw)
    return {"workload": {"requests": num_requests, "prompt_tokens_each": [len(p) for p in prompts],
                         "max_tokens": max_tokens, "block_size": block_size,
                         "max_num_batched_tokens": max_num_batched_tokens},
            "off": {k: v for k, v in off.items() if k != "outputs"},
            "on": {k: v for k, v in on.items() if k != "outputs"},
            "same_tokens": off["outputs"] == on["outputs"]}


def bench_parallel_sampling(model=None, tokenizer=None, n: int = 4, max_tokens: int = 32, block_size: int = 16,
                            seed: int = 0, **engine_kw: Any) -> dict:
    """One prompt with ``SamplingParams(n=n)`` against ``n`` separate requests (seeds seed..seed+n-1),
    prefix cache off in both so that only the fork shares: peak KV blocks of each."""
    from ..sampling import SamplingParams

    if model is None:
        from ..model import load_model

        model, tokenizer = load_model(None)
    prompt = shared_prefix_prompts(tokenizer, 1)[0]
    kw = dict(block_size=block_size, enable_prefix_caching=False, **engine_kw)
    forked = _serve(model, tokenizer, [prompt], SamplingParams(n=n, max_tokens=max_tokens, temperature=0.8, seed=seed,
                                                               ignore_eos=True), **kw)
    from ..engine import LLMEngine

    eng = LLMEngine(model, tokenizer, **kw)
    ids = [eng.add_request({"prompt_token_ids": prompt},
                           SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=seed + i, ignore_eos=True))
           for i in range(n)]
    done = eng.run()
    separate_peak = eng.trace.peak_blocks_used
    return {"n": n, "prompt_tokens": len(prompt), "max_tokens": max_tokens, "block_size": block_size,
            "forked_peak_blocks": forked["peak_blocks_used"], "separate_peak_blocks": separate_peak,
            "saving": 1 - forked["peak_blocks_used"] / separate_peak,
            "forked_outputs": forked["samples"][0], "separate_outputs": [list(done[i].token_ids) for i in ids],
            "forked_texts": [tokenizer.decode(t) for t in forked["samples"][0]]}


def format_shared_prefix(r: dict) -> str:
    wl = r["workload"]
    head = (f"shared-prefix workload: {wl['requests']} requests (the first alone, then the rest together), prompts of {min(wl['prompt_tokens_each'])}-"
            f"{max(wl['prompt_tokens_each'])} tokens sharing one system prompt, {wl['max_tokens']} new tokens each, "
            f"block size {wl['block_size']}; same greedy tokens: {r['same_tokens']}")
    rows = [("", "cache off", "cache on"), *off_on_rows(r["off"], r["on"], [
        ("mean TTFT of the rest (s)", "ttft_mean_s", ".3f"), ("wall time of the rest (s)", "seconds", ".2f"),
        ("output tokens/s (the rest)", "output_tokens_per_s", ".1f"), ("prompt tokens computed", "prompt_tokens_computed", ""),
        ("peak KV blocks", "peak_blocks_used", ""), ("peak KV MiB", "peak_kv_mib", ".2f"),
        ("hit rate (prompt tokens)", "hit_rate", ".0%")])]
    return "\n".join([head, *text_table(rows, min_width=10)])


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--json", help="also write the figures to this file")


def run(a: argparse.Namespace, p: argparse.ArgumentParser | None = None) -> int:
    p = p or getattr(a, "_parser", None) or argparse.ArgumentParser()
    r = bench_shared_prefix(num_requests=a.requests, max_tokens=a.max_tokens, block_size=a.block_size)
    print(format_shared_prefix(r))
    save_run(r, a)
    return 0
