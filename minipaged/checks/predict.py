"""Checks for workbook 10: predict, then measure. The learner predicts six numbers of this machine
and of the simulated GPU from the machine model (minipaged.machine's profile) and from the shapes,
and keeps a decision ledger of two optimisations measured against a matched control.

A prediction check drives the learner's function and the reference model side by side on seeded
cases (small numbers, where every term shows; inputs at and just beside the bounds the rules name;
lists and curves handed in again after they changed in place, so an answer kept by id() shows) and
on this machine's profile, and accepts an answer within the check's tolerance of **the reference
model's prediction**, never of a measurement: measurements on a shared machine are noisy, the model
is not. Each check prints both predictions; the workbook then sets the learner's prediction beside
a measurement with :func:`beside`.

The ledger check verifies the method, never a verdict: the same requests and seeds in both arms
(:func:`ledger_run` records them), at least three repeats, each repeat's two runs back to back,
the interval computed from the ledger's own samples, and a verdict that interval supports.

Nothing here spawns processes: tensor parallelism is predicted only (a graded run has 4 GiB).
"""
from __future__ import annotations

import hashlib
import itertools
import math
import random
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

from . import _delegation
from ._core import DEFAULT_TIMEOUT_S, SITUATIONS, builds, failure, learner_call, length_situations, passed, run_with_time_limit
from ._delegation import run_guarded

NAME = "10 predict and measure"
MAX_MODEL_LEN = 2048  # a long sequence, past any window a learner might cap at (SmolLM2-135M serves 8,192)
# The situations of workbook 10's rules that _core's vocabulary does not name (issue 40).
SITUATIONS.update({
    "exactly at a bound": "an input exactly at a bound the rule names (a latency at its target, a ratio of 1 or k + 1, "
                          "an interval's end at the bar, a slope of 0)",
    "just beside a bound": "inputs just inside and just outside a bound the rule names (ratios of 1.01 and 4.99 beside "
                           "1 and 5, intervals ending at 1.04 or starting at 1.06 beside the bar of 1.05, a slope just "
                           "below 0)",
    "not a straight line": "a curve that bends (a step time with a floor, a geometric sum), so reading it at the wrong "
                           "points or as a line shows",
    "given arguments": "arguments other than the defaults (another context and batches) that change the answer",
    "each condition alone": "each of a rule's conditions failing alone (a TTFT met with its TPOT missed, and the other "
                            "way round)",
    "uneven weights": "items of different weights (requests of different output lengths), so an unweighted mean shows",
    "paired samples": "paired runs whose speed-ups' mean differs from the ratio of the arms' means",
    "varied repeats": "3, 4 and 5 repeats whose speed-ups vary, so the spread's formula (n - 1) shows",
})
AGAIN = " (the same objects as the call before, changed in place since)"
REUSED_HINT = ("this call hands in the same objects as the call before, changed in place since: compute from what "
               "they hold now, every call (an answer kept by id() of an argument belongs to what it held before).")

# Two-sided 95% quantiles of Student's t by degrees of freedom (repeats - 1): given, not to be computed.
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
       11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093, 20: 2.086}
WORTH = 1.05  # the ledger's bar: an optimisation is kept when it is surely at least 5% faster
ALL_REDUCE_LATENCY_S = 100e-6  # assumed: one all-reduce between processes on one machine, before its bytes
_ORDER = itertools.count()  # ledger runs, in the order they ran
# The learner's predictions for this machine, by name, set by each check once it has passed: the
# measurement cells read them here (a cell that is not a check never calls the learner's code, so a
# workbook with stubs fails at its check cells only).
PREDICTIONS: dict = {}


def _watch_list() -> list:
    return [
        ("minipaged.machine", "knee"), ("minipaged.machine", "break_even_acceptance"),
        ("minipaged.machine", "expected_tokens"), ("minipaged.machine", "expected_speedup"),
        ("minipaged.kv_cache", "num_blocks_for_budget"), ("minipaged.kv_cache", "plan_num_blocks"),
        ("minipaged.kv_cache", "kv_bytes_per_token"), ("minipaged.bench.serving", "online_summary"),
        ("minipaged.bench.serving", "goodput"), ("minipaged.bench.hardware", "measured_knee"),
        ("minipaged.checks.kv_cache_math", "ref_bytes_per_token"),
    ] + [("minipaged.checks.predict", n) for n in ("ref_kv_capacity", "ref_knee", "ref_goodput", "ref_gain",
                                                    "ref_all_reduce_bytes_per_token", "ref_tp_step_time",
                                                    "ref_break_even", "ref_speedup_interval", "ref_verdict")]



_delegation.WATCH.setdefault("10", _watch_list())
# What workbook 10 hands the learner inside a check: ledger_run (measure_pair times each arm with it) and the
# engine the arms' make-engine functions build (LLM, its sampling parameters), and the step_time predict_knee is
# handed (StepTime). Every other call is refused.
_delegation.ALLOW.setdefault("10", [("minipaged.checks.predict", "ledger_run"), ("minipaged.checks.predict", "LedgerRun"),
                                    ("minipaged.checks.predict", "StepTime"),
                                    ("minipaged.llm", None), ("minipaged.sampling", None),
                                    ("minipaged.sampling_params", None)])


def _refuse(*named: tuple) -> None:
    from ._delegation import refuse_package_function

    for fn, what in named:
        refuse_package_function(fn, NAME, what)


def _run(body: Callable, what: str, timeout: float) -> Any:
    state = {"current": what}
    return run_guarded("10", NAME, body, timeout, state)


def _show(name: str, yours: float, model: float, tolerance: float, unit: str = "") -> str:
    apart = 0.0 if yours == model else abs(yours - model) / abs(model) if model and not math.isinf(model) else math.inf
    return (f"prediction {name}: yours {_fmt(yours)}{unit}, the model's {_fmt(model)}{unit} "
            f"({apart * 100:.1f}% apart, tolerance {tolerance * 100:g}%)")


def _fmt(x: float) -> str:
    if isinstance(x, int) or (isinstance(x, float) and x.is_integer() and abs(x) < 1e15):
        return f"{int(x):,}"
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    return f"{x:.4g}"


def _close(got: Any, exp: float, tolerance: float) -> bool:
    if isinstance(got, bool) or not isinstance(got, (int, float)):
        return False
    if math.isinf(exp) or math.isinf(got):
        return got == exp
    if math.isnan(got):
        return False
    return abs(got - exp) <= tolerance * abs(exp) + 1e-12


def _factors_differ(*factors: int) -> bool:
    """True when no factor is 1 or equals another, so an answer missing one (or using one twice) shows."""
    return 1 not in factors and len(set(factors)) == len(factors)


def _number(title: str, got: Any, desc: str) -> None:
    if isinstance(got, bool) or not isinstance(got, (int, float)):
        raise failure(title, done=desc, expected="a number", got=f"{got!r} ({type(got).__name__})",
                      hint="return a plain Python number (float(x) of a tensor or a numpy value).")


def _judge(title: str, got: Any, exp: float, tolerance: float, *, expected: str, hint: str, desc: str = "",
           got_as: Callable[[float], str] = _fmt, ok: Callable[[float, float], bool] | None = None) -> None:
    """The learner's prediction ``got`` beside the model's ``exp``: a failure titled ``title`` (``desc``: what
    was asked) unless ``got`` is a plain number (:func:`_number`) within ``tolerance`` of ``exp`` (relative,
    :func:`_close`; ``ok(got, exp)`` instead where a check has its own rule). The failure shows ``expected``,
    ``got_as(got)`` and the ``hint``."""
    _number(title, got, desc)
    if not (ok(got, exp) if ok is not None else _close(got, exp, tolerance)):
        raise failure(title, done=desc, expected=expected, got=got_as(got), hint=hint)


def _keep(key: str, name: str, got: float, model: float, tolerance: float, unit: str = "") -> None:
    """Keep the learner's prediction for this machine under ``key`` (the measurement cells read
    :data:`PREDICTIONS`) and print it beside the model's (:func:`_show`)."""
    PREDICTIONS[key] = got
    print(_show(name, got, model, tolerance, unit))


def beside(name: str, predicted: float | None, measured: float, tolerance: float, unit: str = "", cause: str = "") -> bool:
    """Print ``prediction <name>: predicted X, measured Y (Z% off, tolerance T%)``, the format of
    ``minipaged.machine.check_prediction``; beyond tolerance, a line that says where to look
    (``cause``) instead of failing: the workbook grades the prediction, a busy machine moves the measurement.
    ``predicted`` None (its check has not passed yet): the measurement alone."""
    if predicted is None:
        print(f"prediction {name}: none yet (its check above has not passed), measured {_fmt(float(measured))}{unit}")
        return False
    predicted, measured = float(predicted), float(measured)
    off = 0.0 if predicted == measured else abs(measured - predicted) / abs(measured) if measured and not math.isinf(measured) \
        else math.inf
    print(f"prediction {name}: predicted {_fmt(predicted)}{unit}, measured {_fmt(measured)}{unit} "
          f"({off * 100:.1f}% off, tolerance {tolerance * 100:g}%)")
    if off > tolerance:
        print(f"  beyond tolerance: {cause or 'run the cell again on a quiet machine'}")
    return off <= tolerance


# -- 1. KV capacity of a config (lesson 01) -------------------------------------------------------
def ref_kv_capacity(m, kv_cache_bytes: int, block_size: int, num_tokens: int) -> tuple[int, int]:
    per_token = 2 * m.num_layers * m.num_kv_heads * m.head_dim * m.dtype_bytes
    num_blocks = kv_cache_bytes // (block_size * per_token)
    return num_blocks, num_blocks // -(-num_tokens // block_size)


def check_kv_capacity(kv_capacity: Callable, config: tuple | None = None, timeout: float = DEFAULT_TIMEOUT_S) -> None:
    """``kv_capacity(m, kv_cache_bytes, block_size, num_tokens)``; ``config``: the workbook's own
    ``(m, kv_cache_bytes, block_size, num_tokens)``, checked first and printed."""
    from .kv_cache_math import SMOLLM2_135M, ModelShape

    _refuse((kv_capacity, "kv_capacity"))
    fp32 = ModelShape("SmolLM2-135M in fp32 (this CPU)", 30, 3, 64, 4)
    rng = random.Random(10)
    cases = [(fp32, 40 * 16 * 46080, 16, 31), (fp32, 40 * 16 * 46080 - 1, 16, 32), (fp32, 2**30, 16, 300),
             (SMOLLM2_135M, 2**30, 16, 17), (ModelShape("a probe shape", 3, 5, 7, 4), 10_000_000, 8, 9)]
    for _ in range(12):
        m = ModelShape("a random shape", rng.randint(1, 40), rng.choice([1, 2, 4, 8]), rng.choice([32, 64, 128]),
                       rng.choice([2, 4]))
        cases.append((m, rng.randint(1, 64) * 2**24 + rng.randint(0, 9999), rng.choice([1, 4, 16, 32]),
                      rng.randint(1, 700)))
    cases.append((SMOLLM2_135M, 2**30, 16, MAX_MODEL_LEN))  # sequences of SmolLM2's whole context
    if config is not None:
        cases.insert(0, tuple(config))
    shown = []

    def body():
        for m, budget, bs, n in cases:
            factors = (2, m.num_layers, m.num_kv_heads, m.head_dim, m.dtype_bytes)  # of the bytes a token keeps
            if _factors_differ(*factors):
                builds("distinct factors")
            builds(*length_situations(n, bs, MAX_MODEL_LEN))
            if budget % (bs * math.prod(factors)):
                builds("budget remainder")
            what = f"kv_capacity({m.name}, kv_cache_bytes={budget:_}, block_size={bs}, num_tokens={n})"
            got = learner_call(kv_capacity, m, budget, bs, n, what=what)
            exp = ref_kv_capacity(m, budget, bs, n)
            desc = (f"{m.name}: num_layers={m.num_layers}, num_kv_heads={m.num_kv_heads}, head_dim={m.head_dim}, "
                    f"dtype_bytes={m.dtype_bytes}")
            if not (isinstance(got, tuple) and len(got) == 2):
                raise failure(f"{NAME}: {what} should return (num_blocks, num_seqs).", done=desc,
                              expected=f"{exp}", got=f"{got!r}", hint="return a tuple of two ints.")
            if got != exp:
                blocks_ok = got[0] == exp[0]
                capped = blocks_ok and isinstance(got[1], int) and got[1] > exp[1] and n > 1024
                hint = (f"num_blocks is right, but yours fits {got[1]} sequences of {n:,} tokens where {exp[1]} fit, as "
                        "if each held fewer tokens: something caps the length (a window, a table of fixed size). A "
                        "sequence can be as long as max_model_len (8,192 for SmolLM2-135M)." if capped else
                        "num_blocks is right; sequences = num_blocks // ceil(num_tokens / block_size): each sequence "
                        "takes whole blocks." if blocks_ok else
                        "num_blocks = kv_cache_bytes // (block_size * bytes per token), bytes per token = 2 (K and V) "
                        "* num_layers * num_kv_heads * head_dim * dtype_bytes; the engine keeps whole blocks only.")
                raise failure(f"{NAME}: {what} is wrong.", done=desc, expected=f"{exp}", got=f"{got!r}", hint=hint)
            shown.append(got)

    _run(body, "kv_capacity(...)", timeout)
    m, budget, bs, n = cases[0]
    exp = ref_kv_capacity(m, budget, bs, n)
    PREDICTIONS["kv_capacity"] = shown[0]
    print(_show(f"KV blocks of {budget:,} bytes ({m.name}, blocks of {bs})", shown[0][0], exp[0], 0))
    print(_show(f"sequences of {n} tokens in them", shown[0][1], exp[1], 0))
    passed(f"kv_capacity: right on {len(cases)} configs: {budget / 2**20:.1f} MiB of KV hold {exp[0]} blocks, "
           f"{exp[1]} sequences of {n} tokens.")


# -- 2. the decode knee (lesson 07) ----------------------------------------------------------------
def measured_knee(seconds: dict, context: int, batches: tuple) -> float:
    """The knee of measured steps (``seconds`` by batch), read as the model's is."""
    return ref_knee(lambda b, c: seconds[b], context, batches)


def ref_knee(step_time: Callable, context: int = 32, batches: tuple = (1, 32, 64)) -> float:
    floor = step_time(batches[0], context)
    a, b = batches[-2], batches[-1]
    slope = (step_time(b, context) - step_time(a, context)) / (b - a)
    return floor / slope if slope > 0 else math.inf


class StepTime:
    """The ``step_time(batch, context)`` a check hands predict_knee: seconds of a decode step."""

    def __init__(self, fn: Callable) -> None:
        self._fn = fn

    def __call__(self, batch: int, context: int) -> float:
        return self._fn(batch, context)


def _synthetic_steps() -> list[tuple[str, Callable, int, tuple, tuple]]:
    """(label, step_time, context, batches, the SITUATIONS the curve puts predict_knee in)."""
    return [
        ("2 ms + 0.1 ms a sequence", StepTime(lambda b, c: 2e-3 + 1e-4 * b), 32, (1, 32, 64), ()),
        ("a floor until batch 16, then 0.5 ms a sequence + 1 us a sequence-token",
         StepTime(lambda b, c: 8e-3 + max(0, b - 16) * 5e-4 + 1e-6 * b * c), 128, (1, 16, 48),
         ("not a straight line", "given arguments")),
        ("a step that costs the same at every batch", StepTime(lambda b, c: 5e-3 + 1e-5 * c), 32, (1, 32, 64),
         ("exactly at a bound",)),
        ("three batches far apart", StepTime(lambda b, c: 1e-3 * (1 + b / 7) + 2e-7 * b * c), 64, (2, 10, 90),
         ("given arguments",)),
        # After the flat step, so that a knee of 0 there is named by its own curve: a slope just below 0.
        ("a step a little cheaper at the largest batch (noise in a measurement)",
         StepTime(lambda b, c: 5e-3 - 1e-7 * b), 32, (1, 32, 64), ("just beside a bound",)),
    ]


def check_knee(predict_knee: Callable, prof: Any = None, context: int | None = None, batches: tuple | None = None,
               timeout: float = DEFAULT_TIMEOUT_S) -> None:
    """``predict_knee(step_time, context, batches)``; ``prof``: this machine's profile (also checked,
    at ``context`` and ``batches``, by default machine.KNEE_CONTEXT and KNEE_BATCHES)."""
    _refuse((predict_knee, "predict_knee"))
    cases = _synthetic_steps()
    if prof is not None:
        from .. import machine

        cases.append(("this machine's profile", StepTime(lambda b, c: machine.predict_decode(prof, b, c)),
                      context or machine.KNEE_CONTEXT, tuple(batches or machine.KNEE_BATCHES), ()))
    shown = []

    def knee(label: str, fn: Callable, ctx: int, batches: tuple, hint: str) -> tuple[float, float]:
        what = f"predict_knee(step_time, context={ctx}, batches={batches})"
        got = learner_call(predict_knee, fn, ctx, batches, what=what)
        exp = ref_knee(fn, ctx, batches)
        title = f"{NAME}: {what} is off, for step_time = {label}."
        _number(title, got, "")
        if not _close(got, exp, 0.02):
            f1, fa, fb = fn(batches[0], ctx), fn(batches[-2], ctx), fn(batches[-1], ctx)
            raise failure(title, done=(f"step_time({batches[0]}, {ctx}) = {f1 * 1e3:.3f} ms, step_time({batches[-2]}, "
                                       f"{ctx}) = {fa * 1e3:.3f} ms, step_time({batches[-1]}, {ctx}) = {fb * 1e3:.3f} ms"),
                          expected=f"{_fmt(exp)} (within 2%)", got=_fmt(got), hint=hint)
        return got, exp

    def body():
        hint = ("the knee = the floor (the step at the smallest batch) / the cost of one more sequence, the slope "
                "between the two largest batches; inf when that slope is 0 or less. Use the context and batches you "
                "are given.")
        for label, fn, ctx, batches, situations in cases:
            builds(*situations)
            shown.append((label, *knee(label, fn, ctx, batches, hint)))
        # The same step_time again after its measurements changed in place (the machine measured anew): a knee
        # kept by id(step_time) is the old curve's.
        seconds = {1: 4e-3, 32: 6e-3, 64: 8e-3}
        measured = StepTime(lambda b, c: seconds[b])
        knee("a table of measured seconds", measured, 32, (1, 32, 64), hint)
        seconds[64] = 1.2e-2
        builds("reused object")
        knee("the same table, its last batch measured again" + AGAIN, measured, 32, (1, 32, 64), REUSED_HINT)

    _run(body, "predict_knee(...)", timeout)
    if prof is not None:
        PREDICTIONS["knee"] = shown[-1][1]
    for label, got, exp in shown[-1:]:
        print(_show(f"decode knee ({label})", got, exp, 0.02, " sequences"))
    passed(f"predict_knee: within 2% of the model's knee on {len(cases) + 1} step-time curves (one of them changed in "
           "place between two calls).")


# -- 3. goodput at a rate (lesson 09) --------------------------------------------------------------
def ref_goodput(ttfts: list, tpots: list, slo: dict, window_s: float) -> float:
    ok = sum(1 for a, b in zip(ttfts, tpots) if a <= slo["ttft_s"] and b <= slo["tpot_s"])
    return ok / window_s


def latencies(run: dict, requests: list) -> tuple[list, list]:
    """(TTFTs, TPOTs) in seconds of a served run (``simulate_online``'s form or :func:`serve_on_clock`'s):
    TTFT = first token - arrival; TPOT = (finish - first token) / (output tokens - 1)."""
    ids = sorted(run["first_token"])
    ttft = [run["first_token"][i] - run["arrival"][i] for i in ids]
    tpot = [(run["finish"][i] - run["first_token"][i]) / max(requests[i][1] - 1, 1) for i in ids]
    return ttft, tpot


def serve_on_clock(llm: Any, prompts: list, max_tokens: int, arrivals: list) -> dict:
    """Serve token-id ``prompts`` (``max_tokens`` each, greedy, EOS ignored) on the real engine, each
    added at its arrival time (seconds from the start) on the wall clock: the measured run a
    simulated one is set beside. Returns ``arrival``, ``first_token``, ``finish`` (seconds) by request."""
    from ..sampling import SamplingParams

    eng = getattr(llm, "engine", llm)
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    first, finish, ids = {}, {}, {}
    t0 = time.perf_counter()
    nxt = 0
    while nxt < len(prompts) or eng.has_unfinished_requests():
        now = time.perf_counter() - t0
        while nxt < len(prompts) and arrivals[nxt] <= now:
            ids[eng.add_request(prompts[nxt], sp)] = nxt
            nxt += 1
        if not eng.has_unfinished_requests():
            time.sleep(max(0.0, arrivals[nxt] - now))
            continue
        for out in eng.step():
            i, t = ids.get(out.request_id), time.perf_counter() - t0
            if i is not None and out.outputs[0].token_ids and i not in first:
                first[i] = t
            if i is not None and out.finished:
                finish[i] = t
    return {"arrival": list(arrivals), "first_token": first, "finish": finish}


def check_goodput(goodput: Callable, this_run: tuple | None = None, timeout: float = DEFAULT_TIMEOUT_S) -> None:
    """``goodput(ttfts, tpots, slo, window_s)``; ``this_run``: the workbook's simulated run's
    ``(ttfts, tpots, slo, window_s)``, checked too and printed."""
    _refuse((goodput, "goodput"))
    rng = random.Random(9)
    slo = {"ttft_s": 0.5, "tpot_s": 0.05}
    cases = [([0.5, 0.2, 0.6], [0.05, 0.06, 0.01], slo, 2.0),  # right at both bounds: within the SLO
             ([0.1, 0.1, 0.1, 0.1], [0.01, 0.01, 0.2, 0.01], slo, 4.0), ([], [], slo, 1.0),
             ([0.3], [0.01], {"ttft_s": 0.2, "tpot_s": 0.02}, 0.5)]
    for _ in range(8):
        n = rng.randint(1, 30)
        cases.append(([rng.uniform(0, 1) for _ in range(n)], [rng.uniform(0, 0.1) for _ in range(n)],
                      {"ttft_s": rng.uniform(0.1, 0.9), "tpot_s": rng.uniform(0.01, 0.09)}, rng.uniform(1, 20)))
    if this_run is not None:
        cases.append(tuple(this_run))
    shown = []

    def one(ttft: list, tpot: list, s: dict, window: float, same: bool = False,
            again: bool = False) -> tuple[float, float]:
        """``same``: hand in these very objects (else copies); ``again``: they came in before, changed since."""
        what = f"goodput(ttfts, tpots, slo={s}, window_s={window:.3g})" + (AGAIN if again else "")
        desc = f"ttfts = {[round(x, 3) for x in ttft]}\ntpots = {[round(x, 3) for x in tpot]}"
        exp = ref_goodput(ttft, tpot, s, window)
        args = (ttft, tpot, s) if same else (list(ttft), list(tpot), dict(s))
        got = learner_call(goodput, *args, window, what=what)
        _judge(f"{NAME}: {what} is wrong.", got, exp, 1e-9, desc=desc, expected=f"{exp:.6g} requests/s", got_as=repr,
               hint=REUSED_HINT if again else (
                   "goodput = requests that met BOTH targets (TTFT <= slo['ttft_s'] and TPOT <= slo['tpot_s']; a "
                   "request right at a target meets it) / window_s, the offered window in seconds."))
        return got, exp

    def body():
        for ttft, tpot, s, window in cases:
            met = [(a <= s["ttft_s"], b <= s["tpot_s"]) for a, b in zip(ttft, tpot)]
            if any(a == s["ttft_s"] or b == s["tpot_s"] for a, b in zip(ttft, tpot)):
                builds("exactly at a bound")
            if (True, False) in met and (False, True) in met:
                builds("each condition alone")
            if not ttft:
                builds("empty")
            elif window not in (1, len(ttft)):  # neither a count nor a fraction of requests passes for goodput
                builds("distinct factors")
            shown.append(one(ttft, tpot, s, window))
        # The same lists again, changed in place (the second request now misses its TTFT target): a goodput kept
        # by id() of an argument is the old run's.
        ttft, tpot = [0.1, 0.4, 0.3], [0.01, 0.02, 0.03]
        one(ttft, tpot, slo, 2.0, same=True)
        ttft[1] = 0.9
        builds("reused object")
        one(ttft, tpot, slo, 2.0, same=True, again=True)

    _run(body, "goodput(...)", timeout)
    if this_run is not None:
        _keep("goodput", "goodput of the simulated run", *shown[-1], 1e-9, " req/s")
    passed(f"goodput: right on {len(cases) + 1} runs (a request right at a target meets it; one run changed in place "
           "between two calls).")


def measured_goodput(run: dict, requests: list, slo: dict, window_s: float) -> float:
    """The goodput of a served run (the reference's rule, for the measurement beside your prediction)."""
    return ref_goodput(*latencies(run, requests), slo, window_s)


# -- 4. vLLM's gain over Orca on the simulated GPU (lesson 10) ---------------------------------------
def ref_gain(kv_tokens: int, lengths: list, max_len: int) -> float:
    held = sum(o * (p + o / 2) for p, o in lengths) / sum(o for _, o in lengths)
    return (kv_tokens / held) / (kv_tokens // max_len)


def check_gain(predict_gain: Callable, workload: tuple | None = None, timeout: float = DEFAULT_TIMEOUT_S) -> None:
    """``predict_gain(kv_tokens, lengths, max_len)``; ``workload``: the workbook's own
    ``(kv_tokens, lengths, max_len)``, checked too and printed."""
    _refuse((predict_gain, "predict_gain"))
    rng = random.Random(4)
    cases = [(15_455, [(1, 1), (2, 3)], 2048), (100, [(3, 5)], 10), (15_455, [(161, 338), (20, 1)], 2048),
             (8000, [(7, 2), (1, 9), (4, 4)], 1000)]
    for _ in range(6):
        cases.append((rng.randint(2000, 40_000), [(rng.randint(1, 900), rng.randint(1, 900)) for _ in range(rng.randint(1, 40))],
                      rng.choice([1024, 2048, 4096])))
    if workload is not None:
        cases.append(tuple(workload))
    shown = []

    def one(kv: int, lengths: list, max_len: int, same: bool = False, again: bool = False) -> tuple[float, float]:
        """``same``: hand in this very list (else a copy); ``again``: it came in before, changed since."""
        what = (f"predict_gain(kv_tokens={kv}, lengths=<{len(lengths)} requests>, max_len={max_len})"
                + (AGAIN if again else ""))
        exp = ref_gain(kv, lengths, max_len)
        got = learner_call(predict_gain, kv, lengths if same else list(lengths), max_len, what=what)
        desc = f"lengths (prompt, output) = {lengths[:8]}" + (" ..." if len(lengths) > 8 else "")
        _judge(f"{NAME}: {what} is off.", got, exp, 0.02, desc=desc, expected=f"{exp:.4g} (within 2%)",
               hint=REUSED_HINT if again else (
                   "Orca (Max) seats kv_tokens // max_len sequences (whole reservations). A paged sequence holds its "
                   "prompt plus half its output on average over its output_len steps, so the tokens a running "
                   "sequence holds, weighted by time, are sum(o * (p + o / 2)) / sum(o); vLLM seats kv_tokens / "
                   "that; the gain is the ratio."))
        return got, exp

    def body():
        for kv, lengths, max_len in cases:
            if any(p != o for p, o in lengths):
                builds("distinct factors")
            if len({o for _, o in lengths}) > 1:
                builds("uneven weights")
            if max_len == MAX_MODEL_LEN:
                builds("max_model_len")
            shown.append(one(kv, lengths, max_len))
        # The same list again, changed in place (the second request's prompt grew): a gain kept by id(lengths) is
        # the old workload's.
        lengths = [(100, 200), (30, 40)]
        one(20_000, lengths, MAX_MODEL_LEN, same=True)
        lengths[1] = (900, 40)
        builds("reused object")
        one(20_000, lengths, MAX_MODEL_LEN, same=True, again=True)

    _run(body, "predict_gain(...)", timeout)
    if workload is not None:
        _keep("gain", "vLLM's gain over Orca (Max), mean batched requests", *shown[-1], 0.02, "x")
    passed(f"predict_gain: within 2% of the model's gain on {len(cases) + 1} workloads (one changed in place between "
           "two calls).")


# -- 5. tensor parallelism (lesson 11): predicted only ------------------------------------------------
def ref_all_reduce_bytes_per_token(num_layers: int, hidden_size: int, dtype_bytes: int) -> int:
    return 2 * num_layers * hidden_size * dtype_bytes


def ref_tp_step_time(step_s: float, n: int, num_layers: int, hidden_size: int, dtype_bytes: int, batch: int,
                     link_GBps: float, latency_s: float) -> float:
    payload = batch * hidden_size * dtype_bytes
    one = latency_s + 2 * (n - 1) / n * payload / (link_GBps * 1e9)
    return step_s / n + 2 * num_layers * one


def check_tensor_parallel(all_reduce_bytes_per_token: Callable, tp_step_time: Callable, shape: tuple | None = None,
                          split: tuple | None = None, timeout: float = DEFAULT_TIMEOUT_S) -> None:
    """``shape``: the workbook's model's ``(num_layers, hidden_size, dtype_bytes)``; ``split``: its
    ``tp_step_time`` arguments at the smallest split; both checked too and printed."""
    _refuse((all_reduce_bytes_per_token, "all_reduce_bytes_per_token"), (tp_step_time, "tp_step_time"))
    rng = random.Random(11)
    shapes = [(30, 576, 4), (32, 4096, 2), (3, 7, 5)] + [(rng.randint(1, 80), rng.choice([64, 576, 2048, 8192]),
                                                        rng.choice([1, 2, 4])) for _ in range(5)]
    steps = [(0.05, 3, 30, 576, 4, 8, 10.0, 1e-4), (0.02, 2, 3, 7, 5, 1, 0.001, 0.0), (0.1, 4, 2, 100, 2, 3, 1e-6, 1e-3)]
    for _ in range(6):
        steps.append((rng.uniform(0.001, 0.2), rng.choice([2, 3, 4, 8]), rng.randint(1, 40), rng.choice([64, 576, 4096]),
                      rng.choice([2, 4]), rng.randint(1, 64), rng.uniform(1, 50), rng.uniform(0, 3e-4)))
    if shape is not None:
        shapes.append(tuple(shape))
    if split is not None:
        steps.append(tuple(split))
    shown = {}

    def body():
        for L, H, d in shapes:
            if _factors_differ(2, L, H, d):
                builds("distinct factors")
            what = f"all_reduce_bytes_per_token(num_layers={L}, hidden_size={H}, dtype_bytes={d})"
            got = learner_call(all_reduce_bytes_per_token, L, H, d, what=what)
            exp = ref_all_reduce_bytes_per_token(L, H, d)
            if got != exp:
                raise failure(f"{NAME}: {what} is wrong.", expected=f"{exp:,} bytes", got=f"{got!r}",
                              hint=("two all-reduces per layer (after the attention's output projection and after the "
                                    "MLP's down projection), each one row of hidden_size values per token."))
            shown["bytes"] = (got, exp)
        for args in steps:
            if _factors_differ(*args[1:6]):
                builds("distinct factors")
            names = ("step_s", "n", "num_layers", "hidden_size", "dtype_bytes", "batch", "link_GBps", "latency_s")
            what = "tp_step_time(" + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                               for k, v in zip(names, args)) + ")"
            got = learner_call(tp_step_time, *args, what=what)
            exp = ref_tp_step_time(*args)
            _judge(f"{NAME}: {what} is off.", got, exp, 0.01, expected=f"{exp * 1e3:.4f} ms (within 1%)",
                   got_as=lambda g: f"{g * 1e3:.4f} ms",
                   hint=("each of n ranks computes 1/n of the step; then 2 * num_layers all-reduces, each "
                         "latency_s plus a ring's 2 (n - 1) / n of the step's batch * hidden_size * "
                         "dtype_bytes bytes at link_GBps (GB/s: 1e9 bytes a second)."))
            shown["step"] = (got, exp)

    _run(body, "all_reduce_bytes_per_token(...) / tp_step_time(...)", timeout)
    if shape is not None:
        _keep("all_reduce_bytes_per_token", "all-reduce bytes per token", *shown["bytes"], 0, " B")
    if split is not None:
        PREDICTIONS["tp_step_time"] = shown["step"][0]
        print(_show(f"decode step at N = {split[1]}", shown["step"][0] * 1e3, shown["step"][1] * 1e3, 0.01, " ms"))
    passed(f"all_reduce_bytes_per_token and tp_step_time: right on {len(shapes)} shapes and {len(steps)} splits.")


# -- 6. break-even acceptance (lesson 12) -------------------------------------------------------------
def ref_break_even(verify_cost_ratio: float, k: int) -> float:
    from ..machine import break_even_acceptance

    return break_even_acceptance(verify_cost_ratio, k)


def _break_even_close(got: float, exp: float) -> bool:
    """Break-even acceptance's rule: 0 and inf exactly, anything else within 0.005 (absolute)."""
    return got == exp if (math.isinf(exp) or exp == 0) else (not math.isinf(got) and abs(got - exp) <= 0.005)


def check_break_even(break_even: Callable, this_machine: tuple | None = None, timeout: float = DEFAULT_TIMEOUT_S) -> None:
    """``break_even(verify_cost_ratio, k)``; ``this_machine``: the workbook's ``(ratio, k)``, checked too and printed."""
    _refuse((break_even, "break_even"))
    cases = [(0.8, 4), (1.0, 4), (5.0, 4), (6.5, 4), (1.55, 4), (2.0, 1), (1.5, 1), (2.9, 2), (1.2, 8), (3.0, 3),
             (1.01, 4), (4.99, 4)]
    if this_machine is not None:
        cases.append(tuple(this_machine))
    shown = []

    def body():
        for ratio, k in cases:
            ends = (1, k + 1)  # the ratios where the answer turns to 0 and to inf
            if ratio in ends:
                builds("exactly at a bound")
            if any(0 < abs(ratio - e) <= 0.02 for e in ends):
                builds("just beside a bound")
            if k >= 2:  # 1 + a + a^2 + ...: a curve, where 1 + k a is a line
                builds("not a straight line")
            what = f"break_even(verify_cost_ratio={ratio}, k={k})"
            got = learner_call(break_even, ratio, k, what=what)
            exp = ref_break_even(ratio, k)
            _judge(f"{NAME}: {what} is off.", got, exp, 0.005, ok=_break_even_close, expected=f"{_fmt(exp)} (within 0.005)",
                   hint=("find the acceptance a where 1 + a + a^2 + ... + a^k (the tokens a verifying step "
                         "yields) equals the ratio; 0 when the ratio is at most 1 (verifying costs nothing "
                         "extra); float('inf') when it is at least k + 1 (even a = 1 cannot pay)."))
            shown.append((got, exp))

    _run(body, "break_even(...)", timeout)
    if this_machine is not None:
        got, exp = shown[-1]
        _keep("break_even", f"break-even acceptance (k = {this_machine[1]}, verify cost {this_machine[0]:.2f}x)",
              got, exp, 0.005 / max(exp, 1e-9) if exp else 0)
    passed(f"break_even: right on {len(cases)} ratios and draft lengths (within 0.005, and 0 and inf at the ends).")


# -- the decision ledger ---------------------------------------------------------------------------
@dataclass(frozen=True)
class LedgerRun:
    """One timed run of the ledger: ``seconds`` of ``llm.generate``, ``requests`` a digest of the
    prompts and sampling parameters (seeds included), ``order`` when it ran (a counter), ``arm``."""

    arm: str
    seconds: float
    requests: str
    order: int
    tokens: int


def ledger_run(arm: str, make_llm: Callable, prompts: list, params: Any) -> LedgerRun:
    """Build a fresh engine with ``make_llm()`` (nothing cached from an earlier run) and time
    ``generate(prompts, params)`` on it: one sample of ``arm`` ("control" or "treatment")."""
    llm = make_llm()
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - t
    digest = hashlib.sha256(repr((prompts, params)).encode()).hexdigest()[:16]
    return LedgerRun(arm, seconds, digest, next(_ORDER), sum(len(o.outputs[0].token_ids) for o in outs))


def ref_speedup_interval(control: list, treatment: list) -> tuple[float, float]:
    r = [c / t for c, t in zip(control, treatment)]
    m, s = statistics.mean(r), statistics.stdev(r)
    half = T95[len(r) - 1] * s / math.sqrt(len(r))
    return m - half, m + half


def ref_verdict(lo: float, hi: float) -> str:
    return "keep" if lo > WORTH else "reject" if hi < WORTH else "inconclusive"


_INTERVAL_CASES = [([2.0, 2.0, 2.0], [1.0, 1.0, 1.0]), ([1.0, 1.2, 0.9], [1.0, 1.0, 1.0]),
                   ([3.0, 2.0, 4.0, 3.5], [1.5, 2.0, 1.0, 2.5]), ([1.0, 1.0, 1.0], [2.0, 1.0, 4.0]),
                   ([0.5, 0.7, 0.6, 0.55, 0.65], [0.4, 0.5, 0.45, 0.42, 0.5])]
_VERDICT_CASES = [(1.2, 1.5), (0.8, 0.9), (0.9, 1.3), (WORTH, 1.4), (0.7, WORTH), (1.06, 1.07), (1.0, 1.04)]


def check_ledger(ledger: Any, speedup_interval: Callable, verdict: Callable, arms: list | None = None,
                 timeout: float = 900) -> list:
    """``ledger``: entries ``{"optimisation", "control", "treatment", "interval", "verdict"}``, the
    arms lists of :class:`LedgerRun`; or the learner's ``measure_pair``, run here on each of ``arms``
    (``(name, make_control, make_treatment, prompts, params)``) to make them. Verifies the method,
    never which verdict came. Returns the ledger."""
    _refuse((speedup_interval, "speedup_interval"), (verdict, "verdict"))
    if callable(ledger):
        _refuse((ledger, "measure_pair"))
    made = {"ledger": ledger}
    if callable(ledger):  # the engines measure_pair builds are minipaged's: it is timed, not watched
        state = {"current": "measure_pair(...)"}

        def measure():
            out = []
            for a in arms or []:
                state["current"] = f"measure_pair({a[0]!r}, ...)"
                out.append(learner_call(ledger, *a, what=state["current"]))
            return out

        made["ledger"] = run_with_time_limit(measure, timeout, NAME, lambda: state["current"])

    def interval(control: list, treatment: list, same: bool = False, again: bool = False) -> None:
        """``same``: hand in these very lists (else copies); ``again``: they came in before, changed since."""
        what = f"speedup_interval(control={control}, treatment={treatment})" + (AGAIN if again else "")
        exp = ref_speedup_interval(control, treatment)
        got = learner_call(speedup_interval, *((control, treatment) if same else (list(control), list(treatment))),
                           what=what)
        if not (isinstance(got, tuple) and len(got) == 2 and all(_close(g, e, 1e-9) for g, e in zip(got, exp))):
            raise failure(f"{NAME}: {what} is wrong.", expected=f"({exp[0]:.6g}, {exp[1]:.6g})", got=f"{got!r}",
                          hint=REUSED_HINT if again else (
                              "pair the runs (repeat i of each arm): speed-ups r_i = control_i / treatment_i; the "
                              "interval is mean(r) -/+ T95[n - 1] * stdev(r) / sqrt(n), with n the repeats and "
                              "statistics.stdev (n - 1 in the denominator). Return a tuple (lo, hi)."))

    def body():
        ledger = made["ledger"]
        for control, treatment in _INTERVAL_CASES:
            r = [c / t for c, t in zip(control, treatment)]
            if len(set(r)) > 1:
                builds("varied repeats")
            if abs(statistics.mean(r) - statistics.mean(control) / statistics.mean(treatment)) > 1e-9:
                builds("paired samples")
            interval(control, treatment)
        # The same lists again, changed in place (a repeat timed anew): an interval kept by id() of an argument is
        # the old samples'.
        control, treatment = [2.0, 2.2, 1.8], [1.0, 1.0, 1.0]
        interval(control, treatment, same=True)
        control[2] = 3.0
        builds("reused object")
        interval(control, treatment, same=True, again=True)
        for lo, hi in _VERDICT_CASES:
            if WORTH in (lo, hi):
                builds("exactly at a bound")
            if any(0 < abs(end - WORTH) <= 0.02 for end in (lo, hi)):
                builds("just beside a bound")
            what = f"verdict({lo}, {hi})"
            got = learner_call(verdict, lo, hi, what=what)
            exp = ref_verdict(lo, hi)
            if got != exp:
                raise failure(f"{NAME}: {what} is wrong.", expected=repr(exp), got=f"{got!r}",
                              hint=(f"'keep' when the whole interval is above {WORTH} (surely at least 5% faster), "
                                    f"'reject' when it is all below {WORTH}, 'inconclusive' when it holds {WORTH} "
                                    "(an end exactly at it included)."))
        if not isinstance(ledger, (list, tuple)) or not ledger:
            raise failure(f"{NAME}: the ledger is empty.", expected="a list of entries", got=repr(ledger),
                          hint="append one entry a measured optimisation.")
        names = []
        for e in ledger:
            name = e.get("optimisation", "?") if isinstance(e, dict) else "?"
            names.append(name)
            builds("measured")  # its runs timed by ledger_run
            title = f"{NAME}: the ledger's entry {name!r}:"
            if not isinstance(e, dict) or not all(k in e for k in ("control", "treatment", "interval", "verdict")):
                raise failure(f"{title} it lacks a field.", expected="a dict with optimisation, control, treatment, "
                              "interval, verdict", got=repr(e)[:200], hint="build the entry as the workbook shows.")
            c, t = list(e["control"]), list(e["treatment"])
            if not all(isinstance(r, LedgerRun) for r in c + t):
                raise failure(f"{title} a sample is not a ledger run.", expected="the LedgerRun ledger_run returned",
                              got=repr([type(r).__name__ for r in c + t]),
                              hint="time every run with ledger_run, which records the requests it served.")
            if len(c) < 3 or len(c) != len(t):
                raise failure(f"{title} {len(c)} control runs and {len(t)} treatment runs.",
                              expected="at least 3 repeats of each arm, as many of one as of the other", got=f"{len(c)} and {len(t)}",
                              hint="one noisy run decides nothing: repeat both arms at least three times.")
            if any(r.arm != "control" for r in c) or any(r.arm != "treatment" for r in t):
                raise failure(f"{title} the arms are mixed up.", expected="control runs under control, treatment under treatment",
                              got=f"{[r.arm for r in c]} / {[r.arm for r in t]}", hint="keep each arm's runs in its own list.")
            if len({r.requests for r in c + t}) != 1:
                raise failure(f"{title} the runs served different requests.", expected="one digest of prompts and "
                              "sampling parameters (seeds included) for every run of both arms",
                              got=f"{sorted({r.requests for r in c + t})}",
                              hint="a matched control serves exactly the requests the treatment serves, with the same seeds.")
            orders = [r.order for r in c + t]
            if len(set(orders)) != len(orders):
                raise failure(f"{title} a run is counted twice.", expected="a new run for every sample",
                              got=f"runs {orders}", hint="call ledger_run once for every sample.")
            if any(abs(a.order - b.order) != 1 for a, b in zip(c, t)):
                raise failure(f"{title} a repeat's two runs were not back to back.", expected="control and treatment "
                              "of each repeat run one right after the other", got=f"control runs {[r.order for r in c]}, "
                              f"treatment runs {[r.order for r in t]}",
                              hint="interleave the arms (for each repeat: control, then treatment), so a slow moment of "
                                   "a shared machine hits both arms of a pair.")
            exp = ref_speedup_interval([r.seconds for r in c], [r.seconds for r in t])
            iv = e["interval"]
            if not (isinstance(iv, tuple) and len(iv) == 2 and all(_close(g, x, 1e-9) for g, x in zip(iv, exp))):
                raise failure(f"{title} its interval is not the one its own samples give.",
                              expected=f"({exp[0]:.4g}, {exp[1]:.4g}), from its {len(c)} pairs of runs",
                              got=f"{iv!r}", hint="compute the interval from this entry's own samples' seconds.")
            if e["verdict"] != ref_verdict(*exp):
                raise failure(f"{title} the verdict {e['verdict']!r} contradicts its interval.",
                              expected=f"{ref_verdict(*exp)!r} for a speed-up interval of {exp[0]:.3g}-{exp[1]:.3g}",
                              got=repr(e["verdict"]), hint="write the verdict your own interval supports, whatever you hoped.")
        for need in ("prefix caching", "speculative decoding"):
            if need not in names:
                raise failure(f"{NAME}: the ledger has no entry {need!r}.", expected="an entry for prefix caching and one "
                              "for speculative decoding", got=f"{names}", hint="measure both optimisations.")

    _run(body, "the ledger", timeout)
    ledger = made["ledger"]
    for e in ledger:
        c, t = [r.seconds for r in e["control"]], [r.seconds for r in e["treatment"]]
        print(f"  {e['optimisation']:<22} control {statistics.median(c):.2f} s, treatment {statistics.median(t):.2f} s "
              f"(medians of {len(c)}): speed-up {e['interval'][0]:.2f}-{e['interval'][1]:.2f} -> {e['verdict']}")
    passed(f"the ledger: {len(ledger)} entries, each against a matched control, repeated, with the verdict its own "
           "interval supports.")
    return ledger


__all__ = ["NAME", "T95", "WORTH", "ALL_REDUCE_LATENCY_S", "PREDICTIONS", "LedgerRun", "beside", "latencies",
           "serve_on_clock", "measured_goodput", "measured_knee",
           "ledger_run", "check_kv_capacity", "check_knee", "check_goodput", "check_gain", "check_tensor_parallel",
           "check_break_even", "check_ledger"]
