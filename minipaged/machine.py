"""One model of this machine: what a step costs here, measured once, and predictions set beside measurements.

Owns the profile every lesson explains a time with (:func:`profile`), the predictions read from it
(:func:`predict_step`, :func:`knee`, :func:`ridge`, speculative decoding's break-even) and the one
format a prediction is printed and checked in (:func:`check_prediction`). The measuring is not
new: this machine's ceilings and the route's own operators timed alone, as Vidur (MLSys 2024)
profiles them (``minipaged.bench.hardware``), priced by the simulated GPU's step-cost model
(``minipaged.bench.gpu.cost``) with the overheads fitted on a few real engine steps
(``minipaged.bench.gpu.validate.fit_calibration``), the model the CPU validation holds within 25%.
It does not decide what runs; the engine's plan does, and the profile follows that plan's route.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable

from .bench.gpu.cost import AttentionProfile, Calibration, FusedDecodeProfile, LinearProfile, StepCostModel
from .bench.gpu.specs import ModelSpec

# The profile's grids. Quick: a lesson's budget (about 10 s for SmolLM2-135M on 2 CPU cores); full: the
# CPU validation's grids. Rows past a grid's last point extend its last segment (cost._interp).
QUICK = {"rows": (1, 2, 3, 4, 5, 6, 8, 16, 32, 64, 128), "linear_repeats": 5,
         "attention_batches": (1, 8, 64), "attention_contexts": (32, 128, 512), "attention_repeats": 2,
         "decode_batches": (1, 16), "decode_context": 32, "decode_steps": 3, "prefill_tokens": (256,),
         "fused_batches": (4, 32)}
FULL = {"rows": (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 20, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024),
        "linear_repeats": 5, "attention_batches": (1, 2, 4, 8, 16, 32, 64),
        "attention_contexts": (32, 64, 128, 256, 512, 1024), "attention_repeats": 5,
        "decode_batches": (1, 64), "decode_context": 64, "decode_steps": 8, "prefill_tokens": (256, 512),
        "fused_batches": (4, 16)}
# knee(): the decode steps whose slope is "the cost of one more sequence", at this context (the lessons'
# decode measurements run contexts of 32-128 tokens)
KNEE_BATCHES = (1, 32, 64)
# the prompt length after which a fused route's extra decode batches are timed (machine._time_fused_decode)
FUSED_PROMPT = 8
KNEE_CONTEXT = 32


@dataclass(frozen=True)
class MachineProfile:
    """This machine, measured for one model on one route: its two ceilings (read bandwidth in GB/s,
    fp32 GEMM rate in GFLOP/s), the route's linear layers by row count and decode attention by
    (batch, context), and the overheads per step, sequence and token fitted on real engine steps.
    ``measure_seconds``: what measuring it took; ``measured_at``: ``time.monotonic()`` then."""

    route: str
    read_GBps: float
    gemm_gflops: float
    linear: LinearProfile
    attention: AttentionProfile
    calibration: Calibration
    measure_seconds: float
    model_spec: ModelSpec
    measured_at: float = 0.0
    fused_decode: FusedDecodeProfile | None = None  # the route's fused whole-step decode, timed whole

    @property
    def ridge(self) -> float:
        """FLOPs this machine can do per byte it reads: GEMM rate / read bandwidth."""
        return self.gemm_gflops / self.read_GBps


# The most of a measured step the fitted overheads may explain before the calibration steps are measured
# again (overhead_share): the route's own operators, timed alone, carry nearly all of a step, so overheads
# that explain more than half of the smallest step mean the steps ran on a busier machine than the
# operators did (a shared CPU), not a cost of the engine.
MAX_OVERHEAD_SHARE = 0.5


def overhead_share(cal: Calibration, decode: Iterable[Any]) -> float:
    """The share of the smallest measured decode step (a ``validate.Sample``: ``step``, ``seconds``)
    that the fitted overheads (per step, per sequence and per token) explain: near 0 where the
    profile's operators carry the step, near 1 where the overheads stand for something else (a
    machine busier while the steps ran than while the operators were timed)."""
    smallest = min(decode, key=lambda smp: len(smp.step))
    n, tokens = len(smallest.step), sum(k for _, k in smallest.step)
    over = cal.step_overhead_s + cal.seq_overhead_s * n + cal.token_overhead_s * tokens
    return over / smallest.seconds if smallest.seconds > 0 else math.inf


def lower_envelope(seconds: list[float]) -> list[float]:
    """Times by growing row count, each no more than any later one's: a matmul of more rows never
    costs less than one of fewer, so a small-row time above a larger one's was a busy moment on a
    shared CPU (which only ever adds time), and the larger one's is kept for it."""
    out, low = [], math.inf
    for t in reversed(seconds):
        low = min(low, t)
        out.append(low)
    return out[::-1]


# -- measuring ------------------------------------------------------------------------------------
def _engine_of(llm_or_engine: Any) -> Any:
    eng = getattr(llm_or_engine, "engine", llm_or_engine)
    for attr in ("model", "plan", "backend", "executor", "config"):
        if not hasattr(eng, attr):
            raise TypeError(f"machine.profile needs an LLM or an LLMEngine (one device), got "
                            f"{type(llm_or_engine).__name__} without .{attr}")
    return eng


def route_of(engine: Any) -> str:
    """The route a step of ``engine`` takes, in words: its linear layers and its decode attention
    (and the whole-step decode where the plan runs it)."""
    r = engine.plan.routes
    whole = r.get("whole_step_decode", "off")
    return (f"{r['linear']} + {r['decode_attention']} attention"
            + ("" if whole.startswith("off") else f" + whole-step decode {whole}"))


def _time_route_linears(engine: Any, rows: tuple, repeats: int) -> dict:
    """``hardware.linear_profile``'s numbers for a route whose matmuls are not ``F.linear`` on the fp32
    weights (the GGUF blocks): the plan's ``ops.linear`` over every layer's matrices, and the LM
    head, at each row count (median of ``repeats``)."""
    import torch

    from .bench.hardware import _median

    model, ex = engine.model, engine.executor
    vocab = model.config.vocab_size
    lins = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    body = [m for m in lins if m.weight.shape[0] != vocab]
    head = [m for m in lins if m.weight.shape[0] == vocab] or [model.lm_head]

    @torch.inference_mode()
    def timed(mods: list, r: int) -> float:
        # one input per width, as in a forward pass, where q, k and v (and gate and up) read the same activation
        # while it is still in cache: 210 cold inputs of their own would time the memory traffic of inputs that
        # the real step never pays (a quarter of a 128-row prefill's matmuls on SmolLM2)
        x_of = {w: torch.randn(r, w) for w in {m.weight.shape[1] for m in mods}}
        return _median(lambda: [ex.plan.ops.linear(m, x_of[m.weight.shape[1]]) for m in mods], repeats)

    return {"rows": list(rows), "body_s": [timed(body, r) for r in rows], "head_s": [timed(head, r) for r in rows]}


def _private_engine(engine: Any, s: dict) -> Any:
    """An engine on the same model and route for the calibration's steps, so the caller's engine,
    its trace and its counters are left as they were."""
    from .engine import LLMEngine
    from .config import Parts

    top = max(s["decode_batches"])
    per_seq = -(-(max(s["decode_context"] + s["decode_steps"] + 4, max(s["prefill_tokens"]) + 2))
                // engine.config.block_size)
    cfg = engine.config.replace(num_blocks=top * per_seq + 8, kv_cache_bytes=None, max_num_seqs=max(top, 8),
                                max_num_batched_tokens=max(512, max(s["prefill_tokens"])), enable_prefix_caching=False,
                                record_trace=False, speculative_config=None)
    return LLMEngine(engine.model, None, config=cfg, parts=Parts(attention=engine.parts.attention))


def _measure(engine: Any, quick: bool, fresh: bool = False) -> MachineProfile:
    from .bench import hardware
    from .bench.gpu import validate as v

    t0 = time.perf_counter()
    s = dict(QUICK if quick else FULL)
    room = engine.config.max_model_len - 2  # a small model's positions bound the calibration's steps
    s["prefill_tokens"] = tuple(sorted({min(n, room) for n in s["prefill_tokens"]}))
    s["decode_context"] = min(s["decode_context"], room - s["decode_steps"] - 4)
    model, c = engine.model, engine.model.config
    ceil = hardware.ceilings(quick=quick, cache_s=hardware.CEILINGS_TTL_S)  # one roofline a sitting: each ceiling's best
    if engine.plan.routes["linear"].startswith("torch"):
        lp = hardware.linear_profile(model, rows=s["rows"], repeats=s["linear_repeats"])
    else:
        lp = _time_route_linears(engine, s["rows"], s["linear_repeats"])
    linear = LinearProfile(lp["rows"], lower_envelope(lp["body_s"]), lower_envelope(lp["head_s"]),
                           source=f"machine.profile: {route_of(engine)}")
    bs = engine.config.block_size
    ap = hardware.attention_profile(engine.backend, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, bs,
                                    batches=s["attention_batches"], contexts=s["attention_contexts"],
                                    repeats=s["attention_repeats"])
    timer = hardware.attention_timer(engine.backend, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, bs)
    attention = AttentionProfile(ap["batches"], ap["contexts"], ap["seconds"], groups=v.route_decode_groups(engine.backend),
                                 source=f"machine.profile: {engine.backend.name} attention", prefill=timer)
    machine = v.machine_spec(ceil["read_GBps"] * 1e9, ceil["gemm_gflops"] * 1e9)
    spec = v.model_spec_of(model)
    eng = _private_engine(engine, s)
    v.measure_decode(eng, 1, 8, 1, seed=99)  # warm-up: first touch, lazy init

    def fitted() -> tuple[Calibration, float, list]:
        # each step the fastest of two tries (a busy moment only adds time): one slow reading would
        # otherwise move the fitted overheads, and every prediction with them
        dec = [min((v.measure_decode(eng, b, s["decode_context"], s["decode_steps"], seed=b + 100 * k) for k in range(2)),
                   key=lambda x: x.seconds) for b in s["decode_batches"]]
        pre = [min((v.measure_prefill(eng, n, repeats=1, seed=n + 100 * k) for k in range(2)), key=lambda x: x.seconds)
               for n in s["prefill_tokens"]]
        c = v.fit_calibration(machine, spec, dec, pre, profile=linear, attention=attention)
        return c, overhead_share(c, dec), dec

    cal, share, dec = fitted()
    if share > MAX_OVERHEAD_SHARE:  # the operators were timed at a quieter moment than the steps: measure again
        print(f"machine profile: the fitted overheads are {share:.0%} of the smallest decode step measured (above "
              f"{MAX_OVERHEAD_SHARE:.0%}: the machine was busy while the steps ran?); measuring the steps again")
        cal, share, dec = min((cal, share, dec), fitted(), key=lambda csd: csd[1])
    fused = _time_fused_decode(engine, s, dec, attention) if fuses_decode(engine) else None
    return MachineProfile(route_of(engine), ceil["read_GBps"], ceil["gemm_gflops"], linear, attention, cal,
                          time.perf_counter() - t0, spec, time.monotonic(), fused)


def fuses_decode(engine: Any) -> bool:
    """True where the engine's plan runs a pure decode step as one fused call (the C whole-step decode)."""
    return engine.plan.routes.get("whole_step_decode", "off").startswith("c")


def _time_fused_decode(engine: Any, s: dict, dec: list, attention: AttentionProfile) -> FusedDecodeProfile:
    """The fused route's pure decode steps, timed whole at the calibration's batches (``dec``, at
    ``decode_batches`` and ``decode_context``: on this route they ran fused) and at ``fused_batches``.
    Each batch is the fastest of two more tries and the calibration's own step; the tries run after
    short prompts (``FUSED_PROMPT`` tokens: their prefill is most of what timing them costs) and are
    moved to ``decode_context`` by the attention profile. Then made non-decreasing in the batch, as
    :func:`lower_envelope` does for matmuls."""
    from .bench.gpu.validate import measure_decode
    from .config import Parts
    from .engine import LLMEngine

    more, ctx, n = s["fused_batches"], s["decode_context"], FUSED_PROMPT
    per_seq = -(-(n + s["decode_steps"] + 4) // engine.config.block_size)
    cfg = engine.config.replace(num_blocks=max(more) * per_seq + 8, kv_cache_bytes=None, max_num_seqs=max(more),
                                max_num_batched_tokens=max(512, max(more) * n), enable_prefix_caching=False,
                                record_trace=False, speculative_config=None)  # every prompt in one step, then decodes
    eng = LLMEngine(engine.model, None, config=cfg, parts=Parts(attention=engine.parts.attention))
    timed = {len(d.step): d.seconds for d in dec}
    for b in sorted(set(more) | set(timed)):  # the fastest of the tries: a busy moment only adds time
        smp = min((measure_decode(eng, b, n, s["decode_steps"], seed=7 + b + 100 * k) for k in range(2)),
                  key=lambda x: x.seconds)
        moved = smp.seconds - attention.decode([a + 1 for a, _ in smp.step]) + attention.decode([ctx] * b)
        timed[b] = min(moved, timed.get(b, math.inf))
    batches = sorted(timed)
    return FusedDecodeProfile(batches, lower_envelope([timed[b] for b in batches]), ctx,
                              source=f"machine.profile: {route_of(engine)}, whole steps")


def profile(llm_or_engine: Any, quick: bool = True, fresh: bool = False) -> MachineProfile:
    """This machine's profile for the engine's model on the engine's route, measured the first time
    it is asked for in this process and kept on the model (one per route and size) after that.
    Prints one line: what measuring took, or that it was cached. ``quick``: a lesson's grids
    (:data:`QUICK`); otherwise the CPU validation's (:data:`FULL`). ``fresh``: measure again and
    keep the new one (after a busy moment on a shared CPU skewed the first)."""
    eng = _engine_of(llm_or_engine)
    key = (route_of(eng), eng.config.block_size, bool(quick))
    kept = eng.model.__dict__.setdefault("_machine_profiles", {})
    if key in kept and not fresh:
        prof = kept[key]
        print(f"machine profile: cached (measured {time.monotonic() - prof.measured_at:.1f} s ago)")
        return prof
    prof = _measure(eng, quick, fresh)
    kept[key] = prof
    print(f"machine profile: measured in {prof.measure_seconds:.1f} s (route: {prof.route})")
    return prof


# -- predicting -----------------------------------------------------------------------------------
def cost_model(prof: MachineProfile) -> StepCostModel:
    """The step-cost model of this profile, for the scheduler-on-a-clock simulator (replays,
    goodput): ``simulator.run(..., skip_ahead=False)``, since measured attention prices each step's
    own groups of decodes. On a route that fuses a decode step into one call, a pure decode step
    is priced from that call's own timing (``prof.fused_decode``), every other step from its parts."""
    from .bench.gpu import validate as v

    return v.cost_model(v.machine_spec(prof.read_GBps * 1e9, prof.gemm_gflops * 1e9), prof.model_spec,
                        prof.calibration, prof.linear, prof.attention, fused_decode=prof.fused_decode)


def predict_step(prof: MachineProfile, step: Iterable[tuple[int, int]], logits_rows: int | None = None) -> float:
    """Seconds of one engine step: ``step`` holds one ``(start, num_new)`` pair per scheduled sequence.
    ``logits_rows``: rows the LM head runs on, where more than one a sequence (a verifying step of
    speculative decoding runs it on every new token); default one a sequence."""
    step = [(int(a), int(n)) for a, n in step]
    t = cost_model(prof).step_time(step)
    if logits_rows is not None:
        t += prof.linear.head(logits_rows) - prof.linear.head(len(step))
    return t


def predict_run(prof: MachineProfile, steps: Iterable[Iterable[tuple[int, int]]], spec_k: int = 0) -> float:
    """Seconds of a run of engine steps (each a list of ``(start, num_new)`` pairs, as
    ``validate.record_steps`` keeps them). ``spec_k``: the drafts a verifying step carries, when
    the run speculates: a sequence with 2 to ``spec_k + 1`` new tokens after its start is then
    a verifying one, whose every new token gets logits; a prompt (start 0) gets them on one row."""
    total = 0.0
    for step in steps:
        step = [(int(a), int(n)) for a, n in step]
        rows = sum(n if (spec_k and a > 0 and 1 < n <= spec_k + 1) else 1 for a, n in step)
        total += predict_step(prof, step, logits_rows=rows)
    return total


def predict_decode(prof: MachineProfile, batch: int, context: int) -> float:
    """Seconds of a decode step of ``batch`` sequences, each reading ``context`` tokens."""
    return predict_step(prof, [(context - 1, 1)] * batch)


def roofline_step(prof: MachineProfile, step: Iterable[tuple[int, int]]) -> float:
    """What the roofline alone says a step costs (weights and K/V read at the measured bandwidth,
    FLOPs at the square-GEMM rate, no profile, no overheads): the prediction a lesson sets beside
    the profile's to show what the roofline misses."""
    m = cost_model(prof)
    bare = StepCostModel(m.gpu, prof.model_spec, Calibration(1.0, 1.0, 0.0, 0.0, 0.0),
                         dtype_bytes=prof.model_spec.dtype_bytes)
    return bare.step_time([(int(a), int(n)) for a, n in step])


def knee(prof: MachineProfile, context: int = KNEE_CONTEXT, batches: tuple = KNEE_BATCHES) -> float:
    """The decode batch where a step turns compute-bound, read off the predicted steps as
    ``hardware.measured_knee`` reads measured ones: the batch-1 step's time (the floor) over the
    cost of one more sequence at the largest batches (the slope between the last two of
    ``batches``). ``inf`` where adding sequences costs nothing; never below 1 (a floor that a
    single sequence already doubles is compute-bound from the first batch)."""
    floor = predict_decode(prof, batches[0], context)
    a, b = batches[-2], batches[-1]
    slope = (predict_decode(prof, b, context) - predict_decode(prof, a, context)) / (b - a)
    if not slope > 0:
        return math.inf
    return max(floor / slope, 1.0)


def ridge(prof: MachineProfile) -> float:
    """FLOPs per byte read where this machine turns compute-bound (GEMM rate / read bandwidth)."""
    return prof.ridge


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens a verifying step of ``k`` drafts yields a sequence when each draft is kept with
    probability ``acceptance`` while the ones before it were: 1 + a + a^2 + ... + a^k."""
    return sum(acceptance ** i for i in range(k + 1))


def expected_speedup(acceptance: float, k: int, verify_cost_ratio: float) -> float:
    """Speculative decoding's speed-up over plain decoding: the tokens a verifying step yields over
    what it costs in plain steps (``verify_cost_ratio`` = T(k+1 tokens) / T(1 token), measured)."""
    if verify_cost_ratio <= 0:
        raise ValueError(f"verify_cost_ratio must be > 0 (T(k+1) / T(1)), got {verify_cost_ratio}")
    return expected_tokens(acceptance, k) / verify_cost_ratio


def break_even_acceptance(verify_cost_ratio: float, k: int) -> float:
    """The acceptance rate where verifying ``k`` drafts pays for itself: the ``a`` with
    1 + a + ... + a^k = ``verify_cost_ratio`` (0 where a verifying step costs no more than a plain
    one; ``inf`` where even a = 1 does not pay, the ratio at or above k + 1)."""
    if verify_cost_ratio <= 1.0:
        return 0.0
    if verify_cost_ratio >= k + 1:
        return math.inf
    lo, hi = 0.0, 1.0
    for _ in range(60):  # expected_tokens is increasing in a
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens(mid, k) < verify_cost_ratio else (lo, mid)
    return (lo + hi) / 2


# -- predictions beside measurements ------------------------------------------------------------------
@dataclass(frozen=True)
class Prediction:
    """One prediction set beside its measurement: ``off`` = |measured - predicted| / measured;
    ``ok``: within ``tolerance``; ``explained``: the cause of a miss, where one was given."""

    name: str
    predicted: float
    measured: float
    tolerance: float
    off: float
    ok: bool
    explained: str | None = None


def _num(x: float, unit: str) -> str:
    a = abs(x)
    s = (f"{x:,.0f}" if a >= 1000 else f"{x:.0f}" if a >= 100 else f"{x:.1f}" if a >= 10 else f"{x:.2f}" if a >= 1
         else f"{x:.3g}")
    return f"{s} {unit}" if unit else s


def check_prediction(name: str, predicted: float, measured: float, tolerance: float | None = None, unit: str = "",
                     explained: str | None = None, factor: float | None = None) -> Prediction:
    """Print ``prediction <name>: predicted X, measured Y (Z% off, tolerance T%)`` and return it.
    Beyond ``tolerance`` (a fraction: 0.25 = 25%) a miss must be explained: with ``explained`` (its
    cause, shown by a measurement beside it) the next line reads ``explained miss: <cause>``;
    without, AssertionError, which fails the cell.

    A derived quantity that is a ratio of measured differences (a knee: the batch-1 floor over the
    cost of one more sequence) is checked within a ``factor`` instead (1.5: the prediction lies
    between measured / 1.5 and measured x 1.5); the line then ends ``tolerance a factor of 1.5``.
    Give one of ``tolerance`` and ``factor``."""
    if (tolerance is None) == (factor is None):
        raise ValueError("give one of tolerance= (a fraction of the measurement, 0.25 = 25%) and factor= (1.5: "
                         "within measured / 1.5 .. measured x 1.5)")
    if tolerance is not None and not 0 < tolerance < 1:
        raise ValueError(f"tolerance is a fraction of the measurement (0.25 = 25%), got {tolerance}")
    if factor is not None and not 1 < factor <= 2:
        raise ValueError(f"factor is how far apart the two may be, between 1 and 2 (1.5: within measured / 1.5 .. "
                         f"measured x 1.5), got {factor}")
    predicted, measured = float(predicted), float(measured)
    off = abs(measured - predicted) / abs(measured) if measured else math.inf
    if factor is not None:
        ok = predicted > 0 < measured and max(predicted / measured, measured / predicted) <= factor
        tol_text = f"tolerance a factor of {factor:g}"
    else:
        ok = off <= tolerance
        tol_text = f"tolerance {tolerance * 100:g}%"
    line = (f"prediction {name}: predicted {_num(predicted, unit)}, measured {_num(measured, unit)} "
            f"({off * 100:.1f}% off, {tol_text})")
    print(line)
    if not ok:
        if not explained:
            raise AssertionError(
                f"{line}: beyond tolerance. Check that the prediction and the measurement are of the same thing "
                f"(route, batch, context, what is timed), then rerun the cell: a busy machine slows a measurement "
                f"(a shared CPU); a miss that stays needs its cause measured and passed as explained=")
        print(f"explained miss: {explained}")
    return Prediction(name, predicted, measured, tolerance if tolerance is not None else factor - 1, off, ok,
                      explained if not ok else None)


def _within(predicted: float, measured: float, tolerance: float | None, factor: float | None) -> bool:
    if factor is not None:
        return predicted > 0 < measured and max(predicted / measured, measured / predicted) <= factor
    return measured != 0 and abs(measured - predicted) <= tolerance * abs(measured)


# How many times a prediction is set beside a new measurement before a miss fails the cell: a shared CPU
# (a cloud VM, Colab) changes speed by 15-25% from one minute to the next, so a profile and a step timed
# a minute apart can miss by that much; each retry times both again within seconds of each other.
TRIES = 3


def check_measured(name: str, once: Callable[[bool], tuple[float, float]], tolerance: float | None = None,
                   unit: str = "", explained: str | Callable[[], str | None] | None = None,
                   factor: float | None = None, tries: int = TRIES,
                   again: str = "profiling and measuring again") -> Prediction:
    """:func:`check_prediction` on a measurement that a busy moment can skew. ``once(fresh)`` returns
    ``(predicted, measured)``; ``fresh=True`` asks it to profile (``profile(..., fresh=True)``) and
    measure again. A miss is measured again, saying so, up to ``tries`` readings in all; a miss
    that stays fails the cell (or is printed as explained). The retries keep a lesson honest (a
    wrong model misses every time) without failing on one noisy reading. ``explained`` may be a
    function of no arguments, called after the last reading: a cause read from the measurement
    that stands (its text, or None where that measurement shows no cause)."""
    if tries < 1:
        raise ValueError(f"tries is how many readings to take, at least 1, got {tries}")
    predicted, measured = once(False)
    for k in range(2, tries + 1):
        if _within(float(predicted), float(measured), tolerance, factor):
            break
        print(f"try {k - 1}: predicted {_num(predicted, unit)}, measured {_num(measured, unit)}; {again}")
        predicted, measured = once(True)
    why = explained
    if callable(explained):  # a cause read from the reading that stands, asked only on a miss
        why = None if _within(float(predicted), float(measured), tolerance, factor) else explained()
    return check_prediction(name, predicted, measured, tolerance, unit=unit, explained=why, factor=factor)


def check_decode_step(llm_or_engine: Any, name: str, batch: int, context: int, tolerance: float = 0.25,
                      steps: int = 6, quick: bool = True) -> tuple[MachineProfile, Prediction]:
    """The lessons' step-time check in one call: this machine's profile of the engine's route
    (cached), a real decode step of ``batch`` sequences with about ``context`` tokens each measured
    on a private engine of the same model and route (the median of ``steps``), and the profile's
    prediction of that very step, checked by :func:`check_measured` (a miss is measured again,
    profile included). Returns the profile and the prediction."""
    from .bench.gpu.validate import measure_decode

    eng = _engine_of(llm_or_engine)
    if batch < 1 or context < 2:
        raise ValueError(f"check_decode_step needs batch >= 1 and context >= 2, got batch={batch}, context={context}")
    used: list[MachineProfile] = []

    def once(fresh: bool) -> tuple[float, float]:
        prof = profile(eng, quick=quick, fresh=fresh)
        used.append(prof)
        s = _private_engine(eng, {"decode_batches": (batch,), "decode_context": context, "decode_steps": steps,
                                  "prefill_tokens": (2,)})
        measured = measure_decode(s, batch=batch, prompt_len=context, steps=steps)
        return predict_step(prof, measured.step) * 1e3, measured.seconds * 1e3

    pred = check_measured(name, once, tolerance, unit="ms")
    return used[-1], pred

__all__ = ["MachineProfile", "Prediction", "profile", "route_of", "cost_model", "predict_step", "predict_run", "predict_decode",
           "roofline_step", "knee", "ridge", "expected_tokens", "expected_speedup", "break_even_acceptance",
           "check_prediction", "check_measured", "TRIES", "check_decode_step", "overhead_share", "MAX_OVERHEAD_SHARE", "QUICK", "FULL", "KNEE_BATCHES", "KNEE_CONTEXT"]
