"""``minipaged bench [SUB]``: the bench's own branch of the command line.

Owns the bench's commands' names and wiring: the serving experiments (``serving.py``, no SUB)
and one sub-command a module (kernels, speed, ..., paper, serve), each module declaring its own
arguments (``add_arguments(parser)``) and doing the work (``run(args)``). ``minipaged.cli``
plugs :func:`add_bench_parser` into its tree; ``python -m minipaged.bench`` runs :func:`main`.
The bench never imports the top-level command line, so the package graph has no loop through it.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from typing import Any

# name, module (relative to minipaged), what it does
BENCH_COMMANDS = [
    ("kernels", ".bench.kernels", "time the Triton paged decode kernel on a GPU (GB/s against the copy bandwidth)"),
    ("speed", ".bench.speed", "minipaged against transformers' generate at the same batch, and the fp32 GEMM ceiling"),
    ("profile", ".bench.profile", "where a step's time goes at batch 1, 16 and 64"),
    ("tp", ".bench.tp", "where a tensor-parallel decode step's time goes: compute, all-reduce, bytes per token"),
    ("ablation", ".bench.ablation", "what each fast path buys: plain, + C kernels, + GGUF matmul, + whole-step decode, + greedy-from-head"),
    ("detok", ".bench.detok", "what detokenizing costs per token, incremental against a full re-decode"),
    ("prefix", ".bench.prefix", "a shared system prompt with the prefix cache on and off"),
    ("spec", ".bench.spec", "speculative decoding (n-gram drafts) on and off, on a repeating workload and free chat"),
    ("kvquant", ".bench.kvquant", "8-bit KV pages (kv_cache_dtype) against auto: quality, speed, sequences that fit"),
    ("structured", ".bench.structured", "structured outputs: the grammar mask's time per step at batch 1, 16, 64, and the parse rate"),
    ("offload", ".bench.offload", "a host-memory KV tier on and off: multi-turn prompts whose prefixes do not fit the device pool"),
    ("disagg", ".bench.disagg", "colocated against disaggregated prefill on the simulated GPU: goodput under TTFT/TPOT SLOs"),
    ("disagg-serve", ".bench.disagg_serve", "bench serve's load against one colocated server, then against a producer, a "
                                            "consumer and the proxy on this machine: TTFT, TPOT, goodput side by side"),
    ("paper", ".bench.gpu.paper", "the PagedAttention paper's Figs. 12-17 on a simulated GPU (real scheduler, no model)"),
    ("serve", ".bench.serve", "load-generate against an OpenAI-compatible server (minipaged or vLLM)"),
]
_PACKAGE = "minipaged"


def add_module_command(sub: Any, name: str, module: str, help: str) -> argparse.ArgumentParser | None:
    """Add ``name`` to ``sub`` (an argparse sub-parsers action) from ``module`` (relative to
    minipaged), which offers ``add_arguments(parser)`` and ``run(args)``; a module this install
    lacks (an ImportError) leaves the command out of the menu."""
    try:
        mod = importlib.import_module(module, _PACKAGE)
    except ImportError:
        return None
    p = sub.add_parser(name, help=help, description=(mod.__doc__ or help).strip().splitlines()[0])
    mod.add_arguments(p)
    p.set_defaults(fn=mod.run, _parser=p)
    return p


def add_threads_argument(ap: argparse.ArgumentParser) -> None:
    """``--threads N``: the torch threads a timing command runs with (see :func:`apply_threads`)."""
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's choice); 1 gives steadier shares "
                                                 "on a busy machine")


def apply_threads(a: argparse.Namespace, ap: argparse.ArgumentParser) -> None:
    """Set torch's threads from ``--threads`` when given (an error through ``ap`` below 1)."""
    if a.threads is None:
        return
    if a.threads < 1:
        ap.error(f"--threads must be >= 1, got {a.threads}")
    import torch

    torch.set_num_threads(a.threads)


def add_bench_parser(sub: Any) -> argparse.ArgumentParser:
    """``bench`` and its sub-commands, added to ``sub`` (the top-level sub-parsers action)."""
    from . import serving

    b = sub.add_parser("bench", help="the serving experiments: {contiguous, paged} x {static, continuous}, naive, "
                                     "transformers, an online sweep (or a sub-command: kernels, speed, profile, serve, ...)",
                       description=(serving.__doc__ or "").strip().splitlines()[0])
    serving.add_arguments(b)
    b.set_defaults(fn=serving.run, _parser=b)
    bsub = b.add_subparsers(dest="bench_cmd", metavar="{" + ",".join(n for n, _, _ in BENCH_COMMANDS) + "}")
    for name, module, help in BENCH_COMMANDS:
        add_module_command(bsub, name, module, help)
    return b


def dispatch(ap: argparse.ArgumentParser, argv: list[str]) -> int:
    """Parse ``argv`` with ``ap`` and run the command it names; a user's mistake (a missing file,
    a bad value, a missing extra) is one line on stderr and exit status 2, not a traceback."""
    args = ap.parse_args(argv)
    try:
        return args.fn(args) or 0
    except (FileNotFoundError, ValueError, ImportError) as e:
        print(f"minipaged {args.cmd}: error: {e}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    """``python -m minipaged.bench [SUB] ...``: the same commands as ``minipaged bench``."""
    ap = argparse.ArgumentParser(prog="minipaged")
    add_bench_parser(ap.add_subparsers(dest="cmd", required=True))
    return dispatch(ap, ["bench", *(sys.argv[1:] if argv is None else argv)])
