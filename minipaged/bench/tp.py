"""Where a tensor-parallel step's time goes: decode steps at N = 1 and the smallest split side by side.

The default model's 9 heads split over 3, not 2, so its default pair is N = 1 and N = 3.
For each N the same requests are served (greedy, EOS ignored) and every decode-only step is
timed. At N > 1 the driver's time splits into compute (its shard: half the heads and MLP columns)
and time inside the all-reduces (the transfer, plus waiting for the slower rank); the bytes
all-reduced per token are predicted from the shapes (two all-reduces per layer, each a row of
``hidden_size`` values per token) and measured from the calls. N = 1 is the plain route
(``fast_paths=False``), the same PyTorch maths each rank runs.

    minipaged bench tp --json docs/figures/tp.json
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from . import save_run


def _decode_steps(eng, batch: int, max_tokens: int, prompts: list[list[int]]) -> dict:
    from ..sampling import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        eng.add_request(prompts[i % len(prompts)], sp)
    times, shapes = [], []
    stats = getattr(eng.executor, "all_reduce", None)
    ar_seconds = ar_bytes = 0.0
    tokens = 0
    while eng.has_unfinished_requests():
        decodes = not eng.scheduler.waiting and all(s.num_computed_tokens >= s.num_tokens - 1 for s in eng.scheduler.running)
        before = dict(stats) if stats else None
        batch_now = len(eng.scheduler.running)  # every running sequence decodes one token this step
        shape = [(s.num_tokens - 1, 1) for s in eng.scheduler.running]  # (start, num_new), as a cost model reads a step
        t = time.perf_counter()
        eng.step()
        dt = time.perf_counter() - t
        if decodes and batch_now:
            times.append(dt)
            shapes.append(shape)
            tokens += batch_now
            if stats:
                ar_seconds += stats["seconds"] - before["seconds"]
                ar_bytes += stats["bytes"] - before["bytes"]
    total = sum(times)
    return {"decode_steps": len(times), "seconds_per_step": total / max(len(times), 1),
            "all_reduce_seconds_per_step": ar_seconds / max(len(times), 1),
            "compute_seconds_per_step": (total - ar_seconds) / max(len(times), 1),
            "all_reduce_bytes_per_token": ar_bytes / tokens if tokens else 0.0,
            "tokens_per_s": tokens / total if total else 0.0, "steps": shapes}


def smallest_split(cfg) -> int:
    """The smallest N > 1 the model's heads allow (SmolLM2-135M's 9 heads: 3, not 2)."""
    from ..distributed import shard_rule

    for n in range(2, cfg.num_heads + 1):
        try:
            shard_rule(cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size, n)
            return n
        except ValueError:
            continue
    raise ValueError(f"{cfg.name} cannot be split: {cfg.num_heads} heads")


def run_tp(model_path: str | None = None, batch: int = 8, max_tokens: int = 16, sizes: tuple[int, ...] | None = None,
           model: tuple | None = None) -> dict:
    """Decode steps of the same greedy requests at each tensor-parallel size: per size the mean step,
    its compute and all-reduce parts, the bytes all-reduced per token, and ``steps``, each timed
    step's ``(start, num_new)`` pairs (for a cost model to price the same steps). ``model``: an
    already loaded ``(model, tokenizer)`` instead of loading ``model_path``."""
    from ..engine import LLMEngine
    from ..model import load_model
    from .workloads import chat_prompt_ids

    model, tok = model if model is not None else load_model(model_path)
    prompts = chat_prompt_ids(tok)
    cfg = model.config
    sizes = sizes or (1, smallest_split(cfg))
    res = {"model": cfg.name, "batch": batch, "max_tokens": max_tokens, "threads": torch.get_num_threads(),
           "predicted_all_reduce_bytes_per_token": 2 * cfg.num_layers * cfg.hidden_size * next(model.parameters()).element_size(),
           "rule": "two all-reduces per layer (after o_proj and down_proj), each one row of hidden_size values per token",
           "by_size": {}}
    for n in sizes:
        kw = dict(fast_paths=False) if n == 1 else dict(tensor_parallel_size=n)
        eng = LLMEngine(model, tok, num_blocks=batch * 8 + 8, max_num_seqs=batch, enable_prefix_caching=False,
                        record_trace=False, **kw)
        try:
            _decode_steps(eng, 2, 2, prompts)  # warm-up
            res["by_size"][str(n)] = _decode_steps(eng, batch, max_tokens, prompts)
        finally:
            eng.shutdown()
    return res


def format_table(res: dict) -> str:
    lines = [f"| N | ms per decode step | compute | in all-reduce | tok/s | bytes all-reduced per token (predicted {res['predicted_all_reduce_bytes_per_token']:,}) |",
             "| ---: | ---: | ---: | ---: | ---: | ---: |"]
    for n, r in res["by_size"].items():
        lines.append(f"| {n} | {1e3 * r['seconds_per_step']:.1f} | {1e3 * r['compute_seconds_per_step']:.1f} | "
                     f"{1e3 * r['all_reduce_seconds_per_step']:.1f} | {r['tokens_per_s']:.1f} | {r['all_reduce_bytes_per_token']:,.0f} |")
    return "\n".join(lines)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default=None, help="a .gguf file or model folder (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--sizes", default=None, help="tensor_parallel_size values, comma-separated (default: 1 and the "
                    "smallest split the model's heads allow: 3 for SmolLM2-135M's 9 heads)")
    ap.add_argument("--json", type=Path, default=None)


def run(a: argparse.Namespace) -> int:
    res = run_tp(a.model, a.batch, a.max_tokens, tuple(int(x) for x in a.sizes.split(",")) if a.sizes else None)
    print(format_table(res))
    save_run(res, a)
    return 0
