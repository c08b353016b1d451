"""`minipaged bench profile`: where one engine step's time goes, at batch 1, 16 and 64.

Owns the measurement only, by wall clock: on a CPU every PyTorch op is synchronous, so a
``time.perf_counter()`` before and after a call is that call's cost. The engine is not changed;
timers are wrapped around its public parts for the run and removed afterwards:

- linear layers: forward hooks on every ``nn.Linear`` of the decoder (q, k, v, o, gate, up, down);
- LM head: forward hooks on ``model.lm_head``;
- attention: the backend's ``write_kv`` and ``paged_attention`` (a timing backend wraps the chosen one);
- other model ops: the model's forward minus the two above (embedding, RMSNorm, RoPE, SiLU, residuals);
- sampling: the engine's sampler; scheduler: ``schedule`` and ``update``; runner: the model runner's
  ``prepare``; detokenizing: every ``tokenizer.decode`` call;
- engine glue: the rest of ``step()`` (outputs, stop checks, bookkeeping).

Each batch size serves that many real chat requests x ``max_tokens`` new tokens at once
(greedy, EOS ignored, fp32), and the shares are of the summed step time of the whole run,
prefill steps included. Timing each part needs each part called on its own, so the timed engine is built after the hooks
are on: its plan sees them and runs ``model.forward`` layer by layer (the executor's fast routes
are refused); the same run with no timers follows, on the engine's own plan, and its ms per step
is the served speed. ``decode_steps_by_route`` times whole decode steps of several plans side by
side (lesson 07).
Prints a markdown table (the README's) and can write JSON.
"""
from __future__ import annotations

import argparse
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from . import save_run

CATEGORIES = ("linear layers", "attention", "LM head", "other model ops", "sampling", "scheduler", "runner",
              "detokenizing", "engine glue")


class Timers:
    """Exclusive seconds per category: time spent in a timed call nested inside another timed
    call (a linear layer inside the model's forward, detokenizing inside the scheduler's update)
    counts for the inner one only. ``wrap`` times a callable, ``hook`` a module's forward."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._stack: list[list] = []  # [name, start, seconds spent in nested timed calls]

    def enter(self, name: str) -> None:
        self._stack.append([name, time.perf_counter(), 0.0])

    def exit(self) -> None:
        name, start, inner = self._stack.pop()
        total = time.perf_counter() - start
        self.seconds[name] += total - inner
        self.calls[name] += 1
        if self._stack:
            self._stack[-1][2] += total

    def wrap(self, name: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            self.enter(name)
            try:
                return fn(*args, **kwargs)
            finally:
                self.exit()

        timed.__wrapped__ = fn  # type: ignore[attr-defined]  (inspect.signature sees fn's parameters)
        timed.__name__ = getattr(fn, "__name__", name)
        return timed

    def hook(self, name: str, module: nn.Module) -> list:
        return [module.register_forward_pre_hook(lambda _m, _a: self.enter(name)),
                module.register_forward_hook(lambda _m, _a, _o: self.exit())]


class _TimedSampler:
    """Stands in for the engine's sampler: times each call, forwards everything else."""

    def __init__(self, sampler: Any, timers: Timers) -> None:
        self._sampler, self._timed = sampler, timers.wrap("sampling", sampler.__call__)

    def __call__(self, *args, **kwargs):
        return self._timed(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sampler, name)


def _timing_backend(backend: Any, timers: Timers) -> Any:
    from ..attention import AttentionBackend

    return AttentionBackend(backend.name, timers.wrap("attention", backend.write_kv),
                            timers.wrap("attention", backend.paged_attention), backend.takes_num_decodes)


def _engine(model, tokenizer, requests, max_num_seqs: int, max_num_batched_tokens: int, attention: Any, block_size: int):
    """The engine both runs serve with: just enough KV blocks for every request at once."""
    from ..engine import LLMEngine

    longest = max(len(r.prompt_token_ids) + r.max_tokens for r in requests)
    num_blocks = min(len(requests), max_num_seqs) * -(-longest // block_size) + 1
    return LLMEngine(model, tokenizer, attention=attention, block_size=block_size, num_blocks=num_blocks,
                     max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, record_trace=False)


def profile_engine(model, tokenizer, requests, max_num_seqs: int, max_num_batched_tokens: int = 2048,
                   attention: str = "torch", block_size: int = 16) -> dict:
    """Serve ``requests`` once with timers on; returns seconds per category and the step total."""
    from ..attention import get_backend
    from ..sampling import SamplingParams

    timers = Timers()
    backend = _timing_backend(get_backend(attention, next(model.parameters()).device), timers)
    handles = []
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear) and mod is not model.lm_head:
            handles += timers.hook("linear layers", mod)
    handles += timers.hook("LM head", model.lm_head)
    handles += timers.hook("model forward", model)
    # built after the hooks: its plan sees them and runs model.forward, so every timed call is made
    eng = _engine(model, tokenizer, requests, max_num_seqs, max_num_batched_tokens, backend, block_size)
    eng.sampler = _TimedSampler(eng.sampler, timers)
    sched = eng.scheduler
    sched.schedule = timers.wrap("scheduler", sched.schedule)
    sched.update = timers.wrap("scheduler", sched.update)
    eng.runner.prepare = timers.wrap("runner", eng.runner.prepare)
    tok_decode = tokenizer.decode
    tokenizer.decode = timers.wrap("detokenizing", tok_decode)
    try:
        for r in requests:
            eng.add_request(r.prompt_token_ids, SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True))
        step_s, steps, t_run = 0.0, 0, time.perf_counter()
        while eng.has_unfinished_requests():
            t = time.perf_counter()
            eng.step()
            step_s += time.perf_counter() - t
            steps += 1
        wall = time.perf_counter() - t_run
    finally:
        for h in handles:
            h.remove()
        del tokenizer.decode  # the instance attribute goes; the class's method shows again
        for name in ("schedule", "update"):
            sched.__dict__.pop(name, None)
    sec = dict(timers.seconds)
    shares = {
        "linear layers": sec.get("linear layers", 0.0),
        "attention": sec.get("attention", 0.0),
        "LM head": sec.get("LM head", 0.0),
        "other model ops": sec.get("model forward", 0.0),  # exclusive: the forward minus the timed calls inside
        "sampling": sec.get("sampling", 0.0),
        "scheduler": sec.get("scheduler", 0.0),
        "runner": sec.get("runner", 0.0),
        "detokenizing": sec.get("detokenizing", 0.0),
    }
    shares["engine glue"] = max(0.0, step_s - sum(shares.values()))
    tokens = sum(r.max_tokens for r in requests)
    return {"batch": max_num_seqs, "requests": len(requests), "steps": steps, "step_seconds": step_s, "wall_seconds": wall,
            "output_tokens_per_s": tokens / wall, "seconds": shares, "calls": dict(timers.calls),
            "share": {k: v / step_s for k, v in shares.items()}}


def untimed_steps(model, tokenizer, requests, max_num_seqs: int, max_num_batched_tokens: int = 2048,
                  attention: str = "torch", block_size: int = 16) -> dict:
    """The same run as ``profile_engine`` with no timers: the timers' hooks and timing backend
    make the model run its layers one call at a time, so this is what the engine's step costs
    as it serves, on the plan its engine makes (engine.plan)."""
    from ..sampling import SamplingParams

    eng = _engine(model, tokenizer, requests, max_num_seqs, max_num_batched_tokens, attention, block_size)
    for r in requests:
        eng.add_request(r.prompt_token_ids, SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True))
    t_run = time.perf_counter()
    eng.run()
    wall = time.perf_counter() - t_run
    return {"steps": eng.num_steps, "wall_seconds": wall, "ms_per_step": wall / max(eng.num_steps, 1) * 1e3,
            "output_tokens_per_s": sum(r.max_tokens for r in requests) / wall}


# -- one decode step, route by route (lesson 07) -------------------------------------------
def decode_step_seconds(engine: Any, batch: int, context_len: int = 64, steps: int = 3, seed: int = 0) -> dict:
    """Seconds of one decode-only step of ``engine`` at ``batch`` sequences whose contexts are about
    ``context_len`` tokens (the fastest of ``steps`` such steps: a busy machine only adds time),
    and the route those steps took (``StepRecord.route``). The engine must record a trace and be idle."""
    from ..sampling import SamplingParams

    if engine.has_unfinished_requests():
        raise ValueError("the engine is serving requests: time decode steps on an idle engine")
    g = torch.Generator().manual_seed(seed)
    vocab = engine.model.config.vocab_size
    for _ in range(batch):
        prompt = torch.randint(0, vocab, (context_len,), generator=g).tolist()
        engine.add_request(prompt, SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True))
    best, routes = float("inf"), set()
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        engine.step()
        dt = time.perf_counter() - t
        rec = engine.trace[-1]
        if rec.prefill_tokens == 0 and len(rec.batch) == batch:  # a decode-only step of the whole batch
            best = min(best, dt)
            routes.add(rec.route)
    if best == float("inf"):
        raise RuntimeError(f"no decode-only step of {batch} sequences was seen: give the engine more KV blocks or seats")
    return {"batch": batch, "seconds": best, "tokens_per_s": batch / best, "route": "/".join(sorted(routes))}


def decode_steps_by_route(model: Any, routes: dict[str, dict], batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32),
                          context_len: int = 64, steps: int = 3, block_size: int = 16) -> dict[str, dict]:
    """Whole decode steps of the same model on several routes, side by side in one process.

    ``routes``: a name -> EngineConfig settings (``{"fast_paths": False}``: the plain PyTorch model).
    One engine per route, all on ``model``; each batch size is timed on every route before the
    next (so a burst of load on a shared machine falls on all of them). Returns, per route, its
    plan, the steps' route names, seconds and tokens/s per batch, and the measured knee
    (``hardware.measured_knee``: where the step's time leaves its batch-1 floor)."""
    from ..engine import LLMEngine
    from .hardware import measured_knee

    top = max(batches)
    per_seq = -(-(context_len + steps + 2) // block_size)
    engines = {name: LLMEngine(model, None, block_size=block_size, num_blocks=top * per_seq + 1, max_num_seqs=top,
                               max_num_batched_tokens=max(2048, top * context_len), enable_prefix_caching=False,
                               **kw) for name, kw in routes.items()}
    rows: dict[str, list] = {name: [] for name in routes}
    for b in batches:
        for name, eng in engines.items():
            rows[name].append(decode_step_seconds(eng, b, context_len, steps))
    out = {}
    for name, eng in engines.items():
        r = rows[name]
        out[name] = {"plan": eng.plan, "settings": dict(routes[name]), "by_batch": r,
                     "step_routes": sorted({x["route"] for x in r}),
                     "knee": measured_knee([x["batch"] for x in r], [x["seconds"] for x in r]),
                     "weight_bytes_read": eng.executor.weight_bytes_read()}
    return out


def run_profile(batches: tuple[int, ...] = (1, 16, 64), max_tokens: int = 64, attention: str = "torch",
                max_num_batched_tokens: int = 2048) -> dict:
    from ..model import load_model
    from .speed import chat_workload

    model, tok = load_model(None, dtype=torch.float32, device="cpu")
    warm = chat_workload(tok, 2, 8).requests
    profile_engine(model, tok, warm, 2, max_num_batched_tokens, attention)  # first-call costs are not serving
    rows = []
    for b in batches:
        wl = chat_workload(tok, b, max_tokens)
        row = profile_engine(model, tok, wl.requests, b, max_num_batched_tokens, attention)
        row["untimed"] = untimed_steps(model, tok, wl.requests, b, max_num_batched_tokens, attention)
        rows.append(row)
    return {"batches": list(batches), "max_tokens": max_tokens, "attention": attention, "threads": torch.get_num_threads(),
            "runs": rows}


def format_markdown(res: dict) -> str:
    runs = res["runs"]
    head = "| share of step time | " + " | ".join(f"batch {r['batch']}" for r in runs) + " |"
    lines = [head, "|" + "---|" * (len(runs) + 1)]
    for cat in CATEGORIES:
        lines.append(f"| {cat} | " + " | ".join(f"{r['share'][cat] * 100:.1f}%" for r in runs) + " |")
    lines.append("| ms per step, timed | " + " | ".join(f"{r['step_seconds'] / r['steps'] * 1e3:.1f}" for r in runs) + " |")
    lines.append("| output tok/s, timed | " + " | ".join(f"{r['output_tokens_per_s']:.1f}" for r in runs) + " |")
    if all("untimed" in r for r in runs):
        lines.append("| ms per step, untimed | " + " | ".join(f"{r['untimed']['ms_per_step']:.1f}" for r in runs) + " |")
        lines.append("| output tok/s, untimed | " + " | ".join(f"{r['untimed']['output_tokens_per_s']:.1f}" for r in runs) + " |")
    return "\n".join(lines)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--batches", default="1,16,64", help="comma-separated batch sizes (requests served together)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--attention", default="torch", choices=["torch", "reference", "auto"])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's choice); 1 gives steadier shares on a busy machine")


def run(a: argparse.Namespace, ap: argparse.ArgumentParser | None = None) -> int:
    ap = ap or getattr(a, "_parser", None) or argparse.ArgumentParser(prog="minipaged bench profile")
    if a.threads is not None:
        if a.threads < 1:
            ap.error(f"--threads must be >= 1, got {a.threads}")
        torch.set_num_threads(a.threads)
    try:
        batches = tuple(int(x) for x in a.batches.split(",") if x.strip())
    except ValueError:
        ap.error(f"--batches must be comma-separated integers like 1,16,64, got {a.batches!r}")
    if not batches or min(batches) < 1 or a.max_tokens < 1:
        ap.error("--batches needs at least one size >= 1 and --max-tokens must be >= 1")
    res = run_profile(batches, a.max_tokens, a.attention)
    print(f"{res['max_tokens']} new tokens per request, chat prompts, greedy, fp32, {res['threads']} threads, wall clock per category")
    print(format_markdown(res))
    save_run(res, a)
    return 0
