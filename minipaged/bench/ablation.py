"""What each fast path buys: one process, one model, one engine per rung, each rung switching one
more optimisation on through EngineConfig (minipaged/cpu/executor.py's plan).

The ladder: plain (``fast_paths=False``: the Python model and PyTorch's SDPA, the route the
lessons teach), + the C kernels (paged decode attention, the K/V write, the element-wise ops),
+ the GGUF matmul, + the whole-step decode, + greedy-from-head (the default plan). Each rung is
timed at batch 1 (requests one at a time) and at batch ``--batch-size`` (all at once), greedy,
EOS ignored, and its share of the whole gain is printed. A rung whose plan equals the rung
before (the machine refuses that path: no AVX-512, no compiler) is not timed again: its row says
why, from the plan. Tokens are compared with the plain rung's.

    minipaged bench ablation --json docs/figures/ablation.json
"""
from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path
from typing import Any

import torch

from . import save_run

# (name, the EngineConfig switches of the rung): each adds one optimisation to the one before
LADDER = [
    ("plain", dict(fast_paths=False)),
    ("+ C kernels", dict(gguf_blocks=False, whole_step_decode=False, greedy_from_head=False, packed_gemm=False)),
    ("+ GGUF matmul", dict(whole_step_decode=False, greedy_from_head=False)),
    ("+ whole-step decode", dict(greedy_from_head=False)),
    ("+ greedy-from-head", dict()),
]
# the refusal that explains why a rung adds nothing here
WHY_KEY = {"+ C kernels": "c_kernels", "+ GGUF matmul": "gguf_blocks", "+ whole-step decode": "whole_step_decode",
           "+ greedy-from-head": "greedy_from_head"}


def run_ablation(num_requests: int = 64, max_tokens: int = 32, batch_size: int = 64, batch1_requests: int = 2,
                 model_path: str | None = None, progress: bool = True) -> dict:
    from ..model import load_model
    from .speed import chat_workload, run_batch1_minipaged, run_minipaged

    model, tok = load_model(model_path)
    wl = chat_workload(tok, num_requests, max_tokens)
    run_minipaged(model, tok, wl.requests[:2], 2, 512)  # warm-up: the C build and first-call costs
    rows, prev_plan, plain_tokens = [], None, None
    for name, switches in LADDER:
        probe = run_minipaged(model, tok, wl.requests[:1], 1, 512, **switches)
        plan = probe["plan"]
        row: dict[str, Any] = {"rung": name, "switches": switches, "plan": plan}
        if prev_plan is not None and plan["routes"] == prev_plan["routes"]:
            why = plan["refused"].get(WHY_KEY.get(name, ""), "the plan is the same as the rung before")
            row.update(same_as_before=True, why=why, batch1_tokens_per_s=rows[-1]["batch1_tokens_per_s"],
                       batch_tokens_per_s=rows[-1]["batch_tokens_per_s"], routes_run=rows[-1]["routes_run"])
        else:
            b1 = run_batch1_minipaged(model, tok, wl.requests[:batch1_requests], **switches)
            big = run_minipaged(model, tok, wl.requests, batch_size, 512, **switches)
            row.update(same_as_before=False, batch1_tokens_per_s=b1["output_tokens_per_s"],
                       batch_tokens_per_s=big["output_tokens_per_s"], routes_run=big["routes"])
            if plain_tokens is None:
                plain_tokens = big["token_ids"]
            row["tokens_equal_plain"] = sum(a == b for a, b in zip(big["token_ids"], plain_tokens))
            row["tokens_compared"] = len(plain_tokens)
        if progress:
            print(f"{name:22s} batch 1: {row['batch1_tokens_per_s']:7.1f} tok/s   batch {batch_size}: "
                  f"{row['batch_tokens_per_s']:7.1f} tok/s" + (f"   (same plan: {row['why']})" if row["same_as_before"] else ""),
                  flush=True)
        rows.append(row)
        prev_plan = plan
    for key in ("batch1_tokens_per_s", "batch_tokens_per_s"):
        gain = rows[-1][key] - rows[0][key]
        for a, b in zip(rows, rows[1:]):
            b[key.replace("tokens_per_s", "share")] = (b[key] - a[key]) / gain if gain > 0 else None
    return {"rows": rows, "batch_size": batch_size, "max_tokens": max_tokens, "num_requests": num_requests,
            "batch1_requests": batch1_requests,
            "machine": {"cpus": torch.get_num_threads(), "torch": torch.__version__, "platform": platform.platform()},
            "when": time.strftime("%Y-%m-%d")}


def format_markdown(res: dict) -> str:
    b = res["batch_size"]
    lines = [f"| rung | batch 1 tok/s | share | batch {b} tok/s | share | same tokens as plain | routes the steps took |",
             "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in res["rows"]:
        def share(k: str) -> str:
            v = r.get(k)
            return "-" if v is None else f"{v:.0%}"

        if r["same_as_before"]:
            lines.append(f"| {r['rung']} | = | - | = | - | - | not taken here: {r['why']} |")
            continue
        routes = ", ".join(f"{k} x{v}" for k, v in sorted(r["routes_run"].items()))
        same = f"{r['tokens_equal_plain']}/{r['tokens_compared']}"
        lines.append(f"| {r['rung']} | {r['batch1_tokens_per_s']:.1f} | {share('batch1_share')} | "
                     f"{r['batch_tokens_per_s']:.1f} | {share('batch_share')} | {same} | {routes} |")
    return "\n".join(lines)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--batch1-requests", type=int, default=2)
    ap.add_argument("--model", default=None, help="a .gguf file or model folder (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--json", type=Path, default=None, help="write the results here (the README's ablation block reads it)")


def run(a: argparse.Namespace) -> int:
    res = run_ablation(a.num_requests, a.max_tokens, a.batch_size, a.batch1_requests, a.model)
    print()
    print(format_markdown(res))
    save_run(res, a)
    return 0
