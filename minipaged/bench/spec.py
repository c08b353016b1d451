"""Speculative decoding, on and off: n-gram drafts on a workload that repeats its context and on one that does not.

Owns one measurement, in one process on one model: two workloads, each served with
``speculative_config`` off and on, at batch 1 (requests one at a time) and at batch
``--batch-size`` (all at once), greedy, EOS ignored, fp32.

- **repeat**: the model is asked to copy back a Python function or a module's docstring that
  this package ships (read with ``inspect``: no download), so its answer repeats its prompt and
  the n-gram proposer's drafts are mostly right.
- **chat**: the 16 free chat prompts of ``workloads.CHAT_PROMPTS``: only what the answer
  happens to repeat of itself is drafted right.

One engine serves every run at a batch size (building one packs the weights: seconds); a run
switches speculation off by taking the engine's SpecDecoder away and on by giving it a fresh one.
Each (workload, batch) pair runs off, on, off, on, ... ``--repeats`` times and keeps each side's
best run (other work on a shared machine only ever slows a run down). Reported: output
tok/s off and on, the speedup, the acceptance rate and mean accepted length (vLLM's terms: 1 +
kept drafts per verifying step), the proposals the back-off rule paused, and the routes the
steps took. The greedy tokens of every run must equal the first run's without speculation:
``greedy_equal`` says whether they did, and the command fails (exit 1) when they did not.

    minipaged bench spec --json docs/figures/spec.json
"""
from __future__ import annotations

import argparse
import inspect
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ..sampling import SamplingParams
from . import save_run
from .workloads import chat_prompt_ids

GOALS = {"repeat_batch1_speedup_min": 1.5, "chat_batch1_speedup_min": 0.95}
LOOKUP = (2, 4)  # prompt_lookup_min, prompt_lookup_max

# What the repeat workload asks the model to copy: functions and docstrings of this package.
_SOURCES = [
    ("minipaged.spec_decode", "verify_run"), ("minipaged.spec_decode", "draft_room"),
    ("minipaged.spec_decode", "truncate_table"), ("minipaged.spec_decode", "rollback"),
    ("minipaged.spec_decode", "speculates"), ("minipaged.parts", "cdiv"),
    ("minipaged.bench.speed", "gemm_rate"), ("minipaged.bench.speed", "model_weights"),
    ("minipaged.bench.speed", "workload_flops"), ("minipaged.bench.workloads", "chat_prompt_ids"),
    ("minipaged.bench.workloads", "_lognormal"), ("minipaged.bench", "save_run"),
]
_DOC_SOURCES = ["minipaged.spec_decode", "minipaged.bench.prefix", "minipaged.bench.ablation", "minipaged.bench.workloads"]
_MAX_CHARS = 1200


def repeat_texts(count: int = 16, max_chars: int = _MAX_CHARS) -> list[tuple[str, str]]:
    """``count`` (kind, text) pairs this package ships: a function's source ("code") or the first
    paragraph of a module's docstring ("text"), each cut to ``max_chars``, in a fixed order,
    cycling when there are fewer."""
    import importlib

    found: list[tuple[str, str]] = []
    for mod, name in _SOURCES:
        try:
            src = inspect.getsource(getattr(importlib.import_module(mod), name))
        except (ImportError, AttributeError, OSError, TypeError):
            continue
        found.append(("code", src[:max_chars]))
    for mod in _DOC_SOURCES:
        try:
            doc = (importlib.import_module(mod).__doc__ or "").strip()
        except ImportError:
            continue
        para = doc.split("\n\n")[0].strip()
        if para:
            found.append(("text", para[:max_chars]))
    if not found:
        raise RuntimeError("the repeat workload found no source text in the package")
    order = found[0::2] + found[1::2]  # code and text mixed in the first few requests
    return [order[i % len(order)] for i in range(count)]


def repeat_prompt_ids(tokenizer, count: int = 16, max_chars: int = _MAX_CHARS) -> list[list[int]]:
    """Chat prompts asking the model to copy back text or code it is given."""
    out = []
    for kind, text in repeat_texts(count, max_chars):
        if kind == "code":
            msg = f"Copy this Python function back exactly as it is, in a code block:\n\n```python\n{text}```"
        else:
            msg = f"Repeat this text exactly, word for word:\n\n{text}"
        out.append(tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": msg}], add_generation_prompt=True)))
    return out


def _engine(model, tokenizer, prompts: list[list[int]], batch: int, max_tokens: int, spec: dict):
    """One engine for every run at this batch size, built with ``spec`` (building one packs the
    weights: seconds). A run switches speculation off by taking its SpecDecoder away (every
    speculative path of the step is gated on ``engine.spec``), on by giving it a fresh one."""
    from ..engine import LLMEngine

    block_size = 16
    longest = max(len(p) for p in prompts) + max_tokens + spec["num_speculative_tokens"]
    num_blocks = batch * -(-longest // block_size) + 2
    return LLMEngine(model, tokenizer, block_size=block_size, num_blocks=num_blocks, max_num_seqs=batch,
                     max_num_batched_tokens=max(512, batch * 8), record_trace=False, enable_prefix_caching=False,
                     speculative_config=spec)


def _serve(eng, prompts: list[list[int]], batch: int, max_tokens: int, speculate: bool) -> dict:
    """Serve ``prompts``, ``batch`` at a time (batch 1: one after another), speculation on or off."""
    from ..spec_decode import SpecDecoder

    if not hasattr(eng, "_bench_spec"):
        eng._bench_spec = eng.spec
    proto = eng._bench_spec
    eng.spec = (SpecDecoder(proto.config, proto.max_model_len, backoff=proto.backoff,
                            disable_by_batch_size=proto.disable_by_batch_size, proposer=proto.proposer)
                if speculate else None)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    routes0, steps0 = dict(eng.route_counts), eng.num_steps
    tokens: list[list[int]] = []
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch):
        ids = [eng.add_request({"prompt_token_ids": p}, params) for p in prompts[i:i + batch]]
        done = eng.run()
        tokens += [list(done[r].token_ids) for r in ids]
    seconds = time.perf_counter() - t0
    got = sum(len(t) for t in tokens)
    if got != max_tokens * len(prompts):
        raise RuntimeError(f"generated {got} tokens where {max_tokens * len(prompts)} were asked for")
    routes = {k: v - routes0.get(k, 0) for k, v in eng.route_counts.items() if v > routes0.get(k, 0)}
    if eng.allocator.num_free_blocks != eng.allocator.num_blocks:
        raise RuntimeError("blocks leaked: the engine holds blocks after every request finished")
    return {"seconds": seconds, "output_tokens": got, "tokens_per_s": got / seconds, "token_ids": tokens,
            "steps": eng.num_steps - steps0, "routes": routes,
            "spec_decode": eng.spec.as_dict() if eng.spec is not None else None}


def run_spec_bench(max_tokens: int = 64, k: int = 4, batch_size: int = 16, batch1_requests: int = 4, repeats: int = 2,
                   model_path: str | None = None, progress: bool = True, max_chars: int = _MAX_CHARS) -> dict:
    """Both workloads, off and on, at batch 1 and ``batch_size``; see the module's docstring.
    ``max_chars``: the longest text the repeat workload copies (shorter: a quicker run)."""
    from ..model import load_model

    model, tok = load_model(model_path)
    spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": LOOKUP[0], "prompt_lookup_max": LOOKUP[1]}
    chat = chat_prompt_ids(tok)
    n_max = max(batch_size, batch1_requests)
    workloads = {
        "repeat": (repeat_prompt_ids(tok, n_max, max_chars),
                   "copy back a function or a docstring of this package (the answer repeats the prompt)"),
        "chat": ([chat[i % len(chat)] for i in range(n_max)],
                 "free chat: the 16 prompts of minipaged.bench.workloads.CHAT_PROMPTS"),
    }
    every = [p for ps, _ in workloads.values() for p in ps]
    engines = {b: _engine(model, tok, every, b, max_tokens, spec) for b in sorted({1, batch_size})}
    for b, eng in engines.items():  # warm-up, not measured: C kernels, first calls, both kinds of step
        _serve(eng, workloads["repeat"][0][:b], b, 4, True)
    rows = []
    for wname, (prompts, _) in workloads.items():
        for batch, n in ((1, batch1_requests), (batch_size, batch_size)):
            ps, eng = prompts[:n], engines[batch]
            best: dict[str, dict] = {}
            reference, equal = None, True
            for _ in range(repeats):
                for mode in ("off", "on"):
                    r = _serve(eng, ps, batch, max_tokens, mode == "on")
                    if reference is None:
                        reference = r["token_ids"]
                    equal = equal and r["token_ids"] == reference
                    if mode not in best or r["tokens_per_s"] > best[mode]["tokens_per_s"]:
                        best[mode] = r
            off, on = best["off"], best["on"]
            sd = on["spec_decode"] or {}
            row = {"workload": wname, "batch": batch, "requests": n, "off_tokens_per_s": off["tokens_per_s"],
                   "on_tokens_per_s": on["tokens_per_s"], "speedup": on["tokens_per_s"] / off["tokens_per_s"],
                   "acceptance_rate": sd.get("acceptance_rate", 0.0),
                   "mean_accepted_length": sd.get("mean_acceptance_length", 0.0),
                   "num_drafts": sd.get("num_drafts", 0), "num_paused_steps": sd.get("num_paused_steps", 0),
                   "steps_off": off["steps"], "steps_on": on["steps"],
                   "routes_off": off["routes"], "routes_on": on["routes"], "greedy_equal": equal}
            rows.append(row)
            if progress:
                print(f"{wname:6s} batch {batch:2d}: off {row['off_tokens_per_s']:7.1f} tok/s  on {row['on_tokens_per_s']:7.1f} "
                      f"tok/s  x{row['speedup']:.2f}  acceptance {row['acceptance_rate']:.0%}  accepted length "
                      f"{row['mean_accepted_length']:.2f}  greedy equal: {equal}", flush=True)
    by = {(r["workload"], r["batch"]): r for r in rows}
    goals = {"repeat_batch1_speedup": {"goal": GOALS["repeat_batch1_speedup_min"], "got": by[("repeat", 1)]["speedup"]},
             "chat_batch1_speedup": {"goal": GOALS["chat_batch1_speedup_min"], "got": by[("chat", 1)]["speedup"]}}
    for g in goals.values():
        g["met"] = g["got"] >= g["goal"]
    plan = engines[batch_size].plan
    return {"rows": rows, "greedy_equal": all(r["greedy_equal"] for r in rows), "goals": goals,
            "speculative_config": spec, "backoff": True, "max_tokens": max_tokens, "batch_size": batch_size,
            "batch1_requests": batch1_requests, "repeats": repeats,
            "workloads": {k_: d for k_, (_, d) in workloads.items()},
            "plan": plan.as_dict(), "route": route_summary(plan),
            "model": getattr(model.config, "name", "?"),
            "machine": {"cpus": torch.get_num_threads(), "torch": torch.__version__, "platform": platform.platform()},
            "when": time.strftime("%Y-%m-%d")}


def route_summary(plan: Any) -> str:
    """One line from the plan: how verifying steps run, and how plain decode steps run."""
    routes = plan.routes if not isinstance(plan, dict) else plan["routes"]
    return (f"verifying steps: {routes.get('speculative', 'n/a')}; decode steps without drafts: whole-step decode "
            f"{routes.get('whole_step_decode', '?')}, linear {routes.get('linear', '?')}, decode attention "
            f"{routes.get('decode_attention', '?')}")


def format_markdown(res: dict) -> str:
    lines = ["| workload | batch | off tok/s | on tok/s | speedup | acceptance | mean accepted length | greedy equal | routes (on) |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |"]
    for r in res["rows"]:
        routes = ", ".join(f"{k} x{v}" for k, v in sorted(r["routes_on"].items()))
        lines.append(f"| {r['workload']} | {r['batch']} | {r['off_tokens_per_s']:.1f} | {r['on_tokens_per_s']:.1f} | "
                     f"**{r['speedup']:.2f}x** | {r['acceptance_rate']:.0%} | {r['mean_accepted_length']:.2f} | "
                     f"{'yes' if r['greedy_equal'] else '**NO**'} | {routes} |")
    return "\n".join(lines)


def format_goals(res: dict) -> str:
    g = res["goals"]
    return "; ".join(f"{name.replace('_', ' ')} {v['got']:.2f}x (goal >= {v['goal']}x: {'met' if v['met'] else 'NOT met'})"
                     for name, v in g.items())


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--max-tokens", type=int, default=64, help="new tokens per request (EOS ignored)")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens: the most drafts a step verifies")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--batch1-requests", type=int, default=4, help="requests served one at a time for batch 1")
    ap.add_argument("--repeats", type=int, default=2, help="off/on runs interleaved; each side's best is kept")
    ap.add_argument("--quick", action="store_true", help="a tiny run (for tests): short texts, 8 tokens, batch 2, one run a side")
    ap.add_argument("--model", default=None, help="a .gguf file or model folder (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--json", type=Path, default=None, help="write the results here (the README's spec block reads it)")


def run(a: argparse.Namespace) -> int:
    max_chars = _MAX_CHARS
    if a.quick:  # seconds, not minutes: short texts, few tokens, batch 2, one run a side
        a.max_tokens, a.batch_size, a.batch1_requests, a.repeats = min(a.max_tokens, 8), min(a.batch_size, 2), 1, 1
        max_chars = 240
    res = run_spec_bench(a.max_tokens, a.k, a.batch_size, a.batch1_requests, a.repeats, a.model, max_chars=max_chars)
    print()
    print(format_markdown(res))
    print()
    print(f"speculative_config: {res['speculative_config']} (back-off on); {a.max_tokens} tokens a request, greedy")
    print(f"route: {res['route']}")
    print(f"goals: {format_goals(res)}")
    print(f"greedy_equal: {res['greedy_equal']}")
    save_run(res, a)
    if not res["greedy_equal"]:
        bad = [f"{r['workload']} batch {r['batch']}" for r in res["rows"] if not r["greedy_equal"]]
        print(f"minipaged bench spec: FAILED: speculation changed the greedy tokens ({', '.join(bad)})", file=sys.stderr)
        return 1
    return 0
