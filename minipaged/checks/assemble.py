"""Checks for workbook 07: the learner's own parts, taken from their workbooks 02-06,
serving SmolLM2 through minipaged's engine, compared with the reference engine.

``load_parts`` runs the code cells of the learner's earlier workbooks (not their checks)
and re-runs each part's check quietly, so a missing, unsolved or wrong part is named before
any model is loaded. ``check_engine`` serves a few short prompts greedily with a small pool
(so blocks run out, sequences are preempted and recomputed, prompts are chunked), compares
the tokens with the reference engine's and, when they differ, swaps the parts for
minipaged's one at a time to say which one is to blame. It also checks that every plugged
part is the learner's own (the exact classes from their workbooks, and no call into
minipaged's allocator, table, scheduler policy or attention while their engine serves), and
that their scheduler's policy is the reference's: every step's schedule (who, from which
position, how many tokens) and preemptions are compared, since greedy tokens alone do not
depend on the policy.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from ._core import (CheckFailed, NotImplementedYet, builds, describe_exception, fmt_list, is_stub, not_implemented,
                    passed, run_with_time_limit, watching)
from ._delegation import guarded
from ._workbooks import find_workbook, run_workbook_cells
from .paged_attention import length_situations  # its module also names the situation "package code in place"

NAME = "07 assemble"

# (workbook, names it must define, the check that the part must still pass)
_PARTS = [
    ("02_block_allocator", ["MyBlockAllocator"], "block_allocator", "check", lambda ns: (ns["MyBlockAllocator"],)),
    ("03_block_table", ["MyBlockTable"], "block_table", "check", lambda ns: (ns["MyBlockTable"],)),
    ("04_paged_attention_torch", ["gather_kv", "paged_attention"], "paged_attention", "check",
     lambda ns: (ns["gather_kv"], ns["paged_attention"])),
    ("06_scheduler", ["MyScheduler"], "scheduler", "check", lambda ns: (ns["MyScheduler"],)),
]
_DECODE = ("05_triton_decode_kernel", ["paged_decode"], "triton_decode", "check_decode", lambda ns: (ns["paged_decode"],))

PROMPTS = [
    "The capital of France is",
    "Water boils at a temperature of",
    "One, two, three, four,",
    # 30 tokens: more than this small pool can ever hold, so the scheduler must reject it
    "Once upon a time, in a small village at the edge of a very large and very old forest, there lived a "
    "curious young girl who loved to read",
]
MAX_TOKENS = 8
ENGINE_ARGS = dict(block_size=4, num_blocks=7, max_num_seqs=4, max_num_batched_tokens=16)


@dataclass
class LearnerParts:
    """The learner's parts, ready for the engine."""

    allocator_cls: type
    block_table_cls: type
    paged_attention: Callable
    scheduler_cls: type
    paged_decode: Callable | None = None
    files: dict = field(default_factory=dict)
    attention_used: str = ""  # which attention serves the decode steps, and why (04 or 05)

    @functools.cached_property
    def attention(self) -> Callable:
        """Your Triton kernel for decode steps (on a GPU, if you solved 05), your PyTorch attention otherwise."""
        if self.paged_decode is None:
            return self.paged_attention
        decode, full = self.paged_decode, self.paged_attention

        def learner_attention(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale, out=None,
                              num_decodes=0):
            # The runner puts decode sequences first and says how many (AttentionMetadata.num_decodes): the
            # first num_decodes sequences, one query row each, go to your Triton decode, the rest to your 04.
            n = context_lens.shape[0]
            d = int(num_decodes)
            if d == 0:
                return full(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale, out)
            if d == n:
                return decode(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale, out)
            res = torch.empty_like(q) if out is None else out
            res[:d] = decode(q[:d], k_cache, v_cache, block_tables[:d], context_lens[:d], query_start_loc[: d + 1],
                             scale, None)
            res[d:] = full(q[d:], k_cache, v_cache, block_tables[d:], context_lens[d:], query_start_loc[d:] - d,
                           scale, None)
            return res

        return learner_attention


def _folder(folder) -> Path:
    return Path(folder if folder is not None else os.environ.get("MINIPAGED_WORKBOOKS", ".")).expanduser().resolve()


def _where_hint(folder: Path) -> str:
    import sys

    if "google.colab" in sys.modules:
        return ("On Colab each notebook runs alone: upload your solved workbooks into the Files panel (left) and keep "
                "WORKBOOKS = '.', or mount Google Drive (from google.colab import drive; drive.mount('/content/drive')) "
                "and set WORKBOOKS = '/content/drive/MyDrive/Colab Notebooks'.")
    return f"Put your solved workbooks next to this one, or set WORKBOOKS to the folder that holds them (now: {folder})."


def load_parts(folder: str | os.PathLike | None = None, learner: str | None = None, verbose: bool = True,
               use_triton: bool | None = None, timeout: float = 300) -> LearnerParts:
    """Your allocator (02), block table (03), attention (04) and scheduler (06), taken from your
    workbook files in ``folder``, each checked again. On a GPU (or with ``use_triton=True``) your
    Triton decode (05) is used for decode steps if its workbook is found and passes its check;
    05 is optional, so otherwise decode runs through your 04 attention. It prints which."""
    state = {"current": "running your workbooks' code cells"}
    return run_with_time_limit(lambda: _load_parts(folder, learner, verbose, use_triton, state), timeout, NAME,
                               lambda: state["current"])


def _try_part(root: Path, learner, stem: str, names: list, module: str, fn_name: str, pick, state) -> tuple:
    """Run workbook ``stem``'s code cells and its check quietly.

    Returns ``(objs, None, row)`` when the part is usable, else ``(None, (problem, stub), row)``.
    """
    import importlib

    state["current"] = f"the code cells and the check of your {stem}"
    path, candidates = find_workbook(root, stem, learner)
    if path is None:
        return None, (f"{stem}.ipynb: not found in {root}", False), (stem, "missing", "")
    try:
        with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ns = run_workbook_cells(path)
    except NotImplementedError:
        return None, (f"{path.name}: one of its code cells still raises NotImplementedError when it runs", True), \
            (stem, "not solved", path.name)
    except Exception as e:  # a learner's cell that does not run
        return None, (f"{path.name}: running its code cells failed: {describe_exception(e)}", False), \
            (stem, "broken", path.name)
    missing = [n for n in names if n not in ns]
    if missing:
        return None, (f"{path.name} defines no {', '.join(missing)}: keep the names the workbook gave you", False), \
            (stem, "incomplete", path.name)
    objs = pick(ns)
    check_fn = getattr(importlib.import_module(f"minipaged.checks.{module}"), fn_name)
    try:
        with contextlib.redirect_stdout(io.StringIO()) as out:
            check_fn(*objs)
    except NotImplementedYet as e:
        first = str(e).split("\n")[0].split(". It still raises")[0].rstrip(".")
        return None, (f"{path.name}: {first} (it still raises NotImplementedError)", True), (stem, "not solved", path.name)
    except CheckFailed as e:
        return None, (f"{path.name}: does not pass its own check yet: {str(e).split(chr(10))[0]}", False), \
            (stem, "check fails", path.name)
    if "SKIPPED" in out.getvalue():  # e.g. workbook 05's check without Triton: nothing was checked
        return None, (f"{path.name}: its check was skipped here ({out.getvalue().split('SKIPPED:')[1].strip().splitlines()[0]})",
                      False), (stem, "skipped", path.name)
    note = f" (of {len(candidates)} candidates, the newest)" if len(candidates) > 1 else ""
    return objs, None, (stem, "ok", path.name + note)


def _load_parts(folder, learner, verbose, use_triton, state) -> LearnerParts:
    root = _folder(folder)
    learner = learner if learner is not None else (os.environ.get("MINIPAGED_LEARNER") or None)
    if use_triton is None:
        use_triton = torch.cuda.is_available()
    found: dict[str, tuple] = {}
    problems: list[str] = []
    stub = False
    rows = []
    for stem, names, module, fn_name, pick in _PARTS:
        objs, problem, row = _try_part(root, learner, stem, names, module, fn_name, pick, state)
        rows.append(row)
        if problem is None:
            found[stem] = objs
        else:
            problems.append(problem[0])
            stub = stub or problem[1]
    if problems:
        names = ", ".join(p.split(".ipynb")[0] for p in problems)
        msg = (f"{NAME}: {len(problems)} of your parts cannot be used yet ({names}):\n"
               + "\n".join(f"  - {p}" for p in problems)
               + "\n\nOpen that workbook, make its check cells pass, save it (Ctrl+S), then run this cell again. "
               + (_where_hint(root) if any("not found" in p for p in problems) else ""))
        raise (NotImplementedYet if stub else CheckFailed)(msg.strip())
    # Workbook 05 is optional (docs/instructor.md, lesson 07): on a GPU your Triton kernel takes the decode
    # steps if its workbook is there and passes its check; otherwise decode runs through your 04 attention.
    decode, why_not = None, "no GPU here"
    if use_triton:
        stem, names, module, fn_name, pick = _DECODE
        objs, problem, row = _try_part(root, learner, stem, names, module, fn_name, pick, state)
        if problem is None:
            decode = objs[0]
            rows.append(row)
        else:
            why_not = problem[0]
            rows.append((stem, "not used", row[2] or "(optional)"))
    parts = LearnerParts(found["02_block_allocator"][0], found["03_block_table"][0], found["04_paged_attention_torch"][1],
                  found["06_scheduler"][0], decode, {stem: name for stem, _, name in rows})
    builds("learner's parts")
    if decode is not None:
        used = f"decode steps run through your Triton kernel (05, {parts.files[_DECODE[0]]}), prefill through your 04 attention"
    else:
        used = f"decode runs through your 04 attention: your Triton kernel (05, optional) is not used: {why_not}"
    parts.attention_used = used
    if verbose:
        width = max(len(r[0]) for r in rows)
        for stem, status, name in rows:
            print(f"  {stem.ljust(width)}  {status:<4}  {name}")
        print(f"  ({used})")
        passed(f"your parts from {root}: each still passes its own check.")
    return parts


# The parts the simulated GPU runs (lesson 10): workbook, the part's name there, build_scheduler's keyword.
SIMULATOR_PARTS = [("02_block_allocator", "MyBlockAllocator", "allocator_cls"),
                   ("03_block_table", "MyBlockTable", "block_table_cls"),
                   ("06_scheduler", "MyScheduler", "scheduler_cls")]


def simulator_parts(folder: str | os.PathLike | None = None, learner: str | None = None, verbose: bool = True,
                    timeout: float = 300) -> tuple[dict, dict]:
    """Your block pool (02), block table (03) and scheduler (06) for the simulated GPU, each one
    where its workbook is in ``folder`` and passes its own check, minipaged's reference part in
    place of each one that does not. Returns ``(parts, which)``: ``parts`` for
    ``minipaged.bench.gpu.build_scheduler`` (``allocator_cls``, ``block_table_cls``,
    ``scheduler_cls``), ``which`` one line per part saying whose ran and why; printed when
    ``verbose``. Unlike :func:`load_parts` it never fails: the simulation runs either way."""
    from ..block_allocator import BlockAllocator
    from ..block_table import BlockTable
    from ..scheduler import Scheduler

    reference = {"allocator_cls": BlockAllocator, "block_table_cls": BlockTable, "scheduler_cls": Scheduler}
    state = {"current": "running your workbooks' code cells"}

    def load() -> tuple[dict, dict]:
        root = _folder(folder)
        who = learner if learner is not None else (os.environ.get("MINIPAGED_LEARNER") or None)
        parts, which = {}, {}
        spec = {p[0]: p for p in _PARTS}
        for stem, name, key in SIMULATOR_PARTS:
            _, names, module, fn_name, pick = spec[stem]
            objs, problem, row = _try_part(root, who, stem, names, module, fn_name, pick, state)
            if problem is None:
                parts[key] = objs[0]
                which[key] = f"YOURS: {name} from {row[2]}"
            else:
                parts[key] = reference[key]
                which[key] = f"reference {reference[key].__name__} ({problem[0]})"
        return parts, which

    parts, which = run_with_time_limit(load, timeout, NAME, lambda: state["current"])
    if verbose:
        for key, line in which.items():
            print(f"  {key:<16} {line}")
    return parts, which


_MODEL: dict = {}


def model_and_tokenizer():
    """SmolLM2-135M-Instruct, loaded once per session (on the GPU if there is one)."""
    from ..model import load_model

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in _MODEL:
        _MODEL[device] = load_model(None, device=device)
    return _MODEL[device]


def _generate(llm, prompts, what: str):
    from ..sampling import SamplingParams

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the rejected prompt warns; the table below says it
        try:
            return llm.generate(prompts, params)
        except (CheckFailed, NotImplementedError):
            raise
        except Exception as e:
            raise CheckFailed(f"{NAME}: {what} crashed while serving the prompts: {describe_exception(e)}\n\n"
                              "Your parts pass their own checks, so look at what only the engine does: several "
                              "sequences at once, preemption and recompute, tensors of the model's dtype and device.") from e


def _tokens(outs) -> list:
    return [(list(o.token_ids), o.finish_reason) for o in outs]


def _build(build_engine, model, tok, parts, args):
    try:
        llm = build_engine(model, tok, parts, **args)
    except NotImplementedError as e:
        from ._core import _qualname

        raise not_implemented(_qualname(e.__traceback__)) from None
    except CheckFailed:
        raise
    except Exception as e:
        raise CheckFailed(f"{NAME}: build_engine(model, tokenizer, parts, **engine_args) crashed: {describe_exception(e)}") from e
    if not hasattr(llm, "generate"):
        raise CheckFailed(f"{NAME}: build_engine returned {type(llm).__name__}; return the LLM(...) you built "
                          "(it has .generate).")
    return llm


def _recording_raises(fn: Callable, where: str, raised: list) -> Callable:
    """``fn`` that describes into ``raised`` what it raises (the engine turns it into a request error)."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raised.append(f"in your {where}: {describe_exception(e)}")
            raise

    return call


def _check_plugged(llm, parts: LearnerParts) -> None:
    eng = getattr(llm, "engine", None)
    if eng is None:
        return
    wrong = []
    if type(eng.allocator) is not parts.allocator_cls:
        wrong.append(f"allocator_cls=parts.allocator_cls (the engine's allocator is a {type(eng.allocator).__name__})")
    if type(eng.scheduler) is not parts.scheduler_cls:
        wrong.append(f"scheduler_cls=parts.scheduler_cls (the engine's scheduler is a {type(eng.scheduler).__name__})")
    if getattr(eng.scheduler, "block_table_cls", parts.block_table_cls) is not parts.block_table_cls:
        wrong.append(f"block_table_cls=parts.block_table_cls (the engine uses {eng.scheduler.block_table_cls.__name__})")
    from ..attention.reference import paged_attention as ref_attention

    backend = getattr(eng, "backend", None)
    fn = getattr(backend, "paged_attention", None)
    if fn is ref_attention or getattr(backend, "name", None) in ("torch", "triton", "cpu", "reference"):
        wrong.append(f"attention=parts.attention (the engine uses minipaged's own {getattr(backend, 'name', '')} attention)")
    config = getattr(eng, "config", None)

    def setting(name, *owners):
        if config is not None and hasattr(config, name):
            return getattr(config, name)
        for o in owners:
            if hasattr(o, name):
                return getattr(o, name)
        return None

    asked = {"block_size": setting("block_size", eng), "num_blocks": getattr(eng.allocator, "num_blocks", None),
             "max_num_seqs": setting("max_num_seqs", eng.scheduler),
             "max_num_batched_tokens": setting("max_num_batched_tokens", eng.scheduler)}
    differs = [f"{k}={asked[k]} (asked for {v})" for k, v in ENGINE_ARGS.items() if k in asked and asked[k] != v]
    if differs:
        wrong.append("**engine_args unchanged: your engine has " + ", ".join(differs))
    if wrong:
        raise CheckFailed(f"{NAME}: your engine does not use all of your parts and settings. Pass " + "; ".join(wrong)
                          + ".\n\nHint: the point of this workbook is to serve the model with YOUR code: give LLM(...) "
                            "every part from `parts`, and pass **engine_args on unchanged.")
    builds("different part class")  # the learner's own classes serve, in the reference's place


def _record_schedules(llm, raised: list | None = None) -> list:
    """Wrap the engine's scheduler's schedule() to keep, per step, [(request, start, new tokens)] and the
    preempted; what raises in it (your scheduler, table or allocator) is described into ``raised``."""
    steps: list = []
    sched = llm.engine.scheduler
    schedule = sched.schedule
    names: dict = {}

    def name(seq) -> str:
        return names.setdefault(seq.seq_id, f"r{len(names)}")

    def recording():
        try:
            out = schedule()
        except Exception as e:
            if raised is not None:
                raised.append(f"in schedule(): {describe_exception(e)}")
            raise
        steps.append((tuple((name(s.seq), s.start, s.num_new_tokens) for s in out.scheduled),
                      tuple(name(s) for s in out.preempted)))
        return out

    sched.schedule = recording
    return steps


def _step_text(step) -> str:
    if step is None:
        return "(no step)"
    sched, pre = step
    text = " ".join(f"{r}+{n}@{p}" for r, p, n in sched) or "(nothing)"
    return text + (f"; preempted {fmt_list(pre)}" if pre else "")


def _compare_policy(exp_steps: list, got_steps: list) -> None:
    if exp_steps == got_steps:
        return
    k = next((i for i, (a, b) in enumerate(zip(exp_steps, got_steps)) if a != b), min(len(exp_steps), len(got_steps)))
    rows = []
    for i in range(max(0, k - 2), min(max(len(exp_steps), len(got_steps)), k + 2)):
        e = exp_steps[i] if i < len(exp_steps) else None
        g = got_steps[i] if i < len(got_steps) else None
        rows.append(f"    step {i + 1}: reference {_step_text(e)}\n    {' ' * len(str(i + 1))}       yours     {_step_text(g)}"
                    + ("   <- differs" if e != g else ""))
    raise CheckFailed(
        f"{NAME}: your engine's answers are right, but your scheduler's policy differs from the reference's in the "
        f"engine (first at step {k + 1} of {len(exp_steps)}; yours took {len(got_steps)} steps).\n\n" + "\n".join(rows)
        + "\n    (rN+T@P: request N computes T new tokens from position P)\n\n"
        "Hint: greedy tokens do not depend on the policy, so the check compares every step's schedule. Your scheduler "
        "passes workbook 06's check, so look at what only the engine gives it: its settings (read them from the "
        "scheduler's attributes, never hard-code them) and requests that finish early, at EOS or a stop."
    )


def check_engine(build_engine: Callable, folder: str | os.PathLike | None = None, timeout: float = 900) -> None:
    """``build_engine(model, tokenizer, parts, **engine_args)`` -> an LLM with your parts; its greedy
    answers must equal the reference engine's, token for token."""
    if is_stub(build_engine):
        raise not_implemented(getattr(build_engine, "__name__", "build_engine"))
    state = {"current": "loading your parts"}

    def body():
        from ..llm import LLM

        parts = load_parts(folder, verbose=False)
        state["current"] = "loading SmolLM2-135M-Instruct"
        model, tok = model_and_tokenizer()
        state["current"] = "serving the prompts with the reference engine"
        t = time.perf_counter()
        ref = LLM(model, tok, attention="torch", **ENGINE_ARGS)
        exp_steps = _record_schedules(ref)
        exp = _generate(ref, PROMPTS, "the reference engine")
        t_ref = time.perf_counter() - t
        # What these prompts in this small pool put the parts in, read off the reference's schedule: every length
        # a sequence reaches, blocks freed and allocated again, and the same cache written in place every step.
        lengths = [start + n for sched, _ in exp_steps for _, start, n in sched]
        builds("reused object", *length_situations(lengths, ENGINE_ARGS["block_size"]))
        if any(pre for _, pre in exp_steps):
            builds("preemption", "full pool")
        state["current"] = "serving the prompts with your engine"
        raised: list = []
        parts.paged_attention = _recording_raises(parts.paged_attention, "attention (04)", raised)
        if parts.paged_decode is not None:
            parts.paged_decode = _recording_raises(parts.paged_decode, "Triton decode (05)", raised)
        llm = _build(build_engine, model, tok, parts, ENGINE_ARGS)
        _check_plugged(llm, parts)
        got_steps = _record_schedules(llm, raised) if hasattr(llm, "engine") else None
        t = time.perf_counter()
        # While your engine serves, none of minipaged's own parts may run in place of yours.
        with guarded("07", NAME), watching("your engine (build_engine(...).generate)"):
            builds("package code in place")
            got = _generate(llm, PROMPTS, "your engine")
        t_mine = time.perf_counter() - t
        if not isinstance(got, list) or len(got) != len(PROMPTS):
            raise CheckFailed(f"{NAME}: your engine returned {type(got).__name__} for {len(PROMPTS)} prompts; "
                              "expected a list of one output per prompt.")
        errors = [(i, o) for i, o in enumerate(got) if getattr(o, "finish_reason", None) == "error"]
        if errors:
            # The engine keeps serving when a step raises, and ends that step's requests with the error: name it.
            i, o = errors[0]
            raise CheckFailed(
                f"{NAME}: your engine ended {len(errors)} of the {len(PROMPTS)} requests with an error (first: prompt {i}, "
                f"{PROMPTS[i][:40]!r}):\n    {o.error}\n" + (f"  It was raised {raised[0]}\n" if raised else "")
                + "\nYour parts pass their own checks, so look at what only the engine gives them: several sequences "
                "at once, preemption and recompute, the model's shapes (9 query heads over 3 KV heads, head_dim 64), "
                "dtype and device.")
        if _tokens(got) != _tokens(exp):
            raise _mismatch(exp, got, parts, build_engine, model, tok, state)
        if got_steps is not None:
            _compare_policy(exp_steps, got_steps)
        stats = llm.engine.stats() if hasattr(llm, "engine") else {}
        w = max(len(p) for p in PROMPTS[:3])
        print(f"  {'prompt'.ljust(w)}  answer (yours = the reference's)")
        for p, o in zip(PROMPTS, got):
            shown = (p if len(p) <= w else p[: w - 3] + "...").ljust(w)
            ans = repr(o.text) if o.finish_reason != "rejected" else f"rejected: {o.error}"
            print(f"  {shown}  {ans}")
        pre = stats.get("preemptions", "?")
        if parts.attention_used:
            print(f"  ({parts.attention_used})")
        passed(f"your allocator, block table, attention and scheduler serve SmolLM2 with the reference's greedy tokens: "
               f"{len(PROMPTS)} prompts ({MAX_TOKENS} tokens each, one rejected), {ENGINE_ARGS['num_blocks']} blocks of "
               f"{ENGINE_ARGS['block_size']} tokens, {pre} preemption(s), chunks of {ENGINE_ARGS['max_num_batched_tokens']} "
               f"tokens. Your engine took {t_mine:.1f} s, the reference {t_ref:.1f} s.")

    run_with_time_limit(body, timeout, NAME, lambda: state["current"])


def _mismatch(exp, got, parts: LearnerParts, build_engine, model, tok, state) -> CheckFailed:
    lines = []
    first = None
    for i, (p, e, g) in enumerate(zip(PROMPTS, exp, got)):
        if (list(e.token_ids), e.finish_reason) == (list(g.token_ids), g.finish_reason):
            continue
        if first is None:
            first = i
        k = next((j for j, (a, b) in enumerate(zip(e.token_ids, g.token_ids)) if a != b), min(len(e.token_ids), len(g.token_ids)))
        lines.append(f"  prompt {i} {p[:40]!r}:\n    reference: {e.text!r} {list(e.token_ids)} ({e.finish_reason})\n"
                     f"    yours:     {g.text!r} {list(g.token_ids)} ({g.finish_reason}); first difference at token {k}")
    # Which part is to blame: swap in minipaged's own, one part at a time.
    from .. import BlockAllocator, BlockTable, Scheduler
    from ..attention.reference import paged_attention as ref_attention

    swaps = [("allocator (02)", dict(allocator_cls=BlockAllocator)), ("block table (03)", dict(block_table_cls=BlockTable)),
             ("attention (04/05)", dict(paged_attention=ref_attention, paged_decode=None)),
             ("scheduler (06)", dict(scheduler_cls=Scheduler))]
    blame = []
    for name, change in swaps:
        state["current"] = f"serving again with minipaged's {name}"
        fields = {f.name: getattr(parts, f.name) for f in dataclasses.fields(LearnerParts)}
        trial = LearnerParts(**{**fields, **change})
        try:
            outs = _generate(_build(build_engine, model, tok, trial, ENGINE_ARGS), PROMPTS, "the engine")
        except CheckFailed:
            continue
        if _tokens(outs) == _tokens(exp):
            blame.append(name)
    if blame:
        hint = (f"with minipaged's {blame[0]} instead of yours, the answers match: the difference is in your {blame[0]}. "
                "It passes its own check, so look at what the engine adds: several sequences at once, tensors of the "
                "model's dtype and device, preemption and recompute.")
    else:
        hint = ("no single part explains it: swapping any one of yours for minipaged's does not fix it. Check build_engine "
                "passes every part and ENGINE_ARGS on to LLM(...).")
    return CheckFailed(f"{NAME}: your engine's greedy answers differ from the reference engine's.\n\n" + "\n".join(lines)
                       + f"\n\nEngine settings: {ENGINE_ARGS}, max_tokens={MAX_TOKENS}, temperature=0.\n\nHint: " + hint)


__all__ = ["LearnerParts", "load_parts", "simulator_parts", "check_engine", "model_and_tokenizer", "PROMPTS", "ENGINE_ARGS"]
