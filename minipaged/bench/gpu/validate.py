"""The cost model checked where it can be measured: the real engine on this machine's CPU.

Owns the validation's logic; ``scripts/validate_simgpu_cpu.py`` is its command line. The same
:class:`~.cost.StepCostModel` the paper runner uses is given this machine instead of a GPU: its
measured read bandwidth and fp32 GEMM rate (``minipaged.bench.hardware``), the served model's
shape from its own config, fp32 weights and KV (the plain route, ``fast_paths=False``). Then:

1. **calibrate** (one calibration, stated): from a few measured steps, fit the two overheads
   (per step, per sequence) and the share of the GEMM rate a whole step reaches
   (:func:`fit_calibration`); the bandwidth is taken as measured (efficiency 1.0). Given the
   route's operator profiles (:class:`~.cost.LinearProfile`, :class:`~.cost.AttentionProfile`:
   what this CPU's libraries take at each shape, timed alone, never the engine), the matmuls
   and attention are priced by them, and the fit is the overheads per step, sequence and token;
2. **predict** what was not used to fit: the decode step time at other batches, and the
   throughput of a small offline workload, both replayed step by step (the cost model alone,
   on the engine's own steps) and simulated (the real scheduler on the simulated clock,
   :func:`~.simulator.run`, with no model);
3. **predict the factorial bench** (``minipaged bench``: {contiguous, paged} x {static,
   continuous} and naive, :mod:`minipaged.bench.serving`): the same calibration, no other
   tuning; each cell's workload and engine settings (:class:`FactorialSetup`, read the way
   ``run_bench`` builds them) served by the simulator's policies (:func:`factorial_scheduler`:
   contiguous = a reservation of the bench's longest request in whole blocks, static = no
   refill until the batch drains), its throughput against the bench measured in the same
   process (:func:`measure_factorial`);
4. **report** each error (prediction / measurement - 1); the target is within 25%.

The measuring half (:func:`record_steps`, :func:`measure_decode`, :func:`measure_workload`,
:func:`measure_factorial`) drives a real engine and times its steps; everything else is
arithmetic on what it records, tested on tiny inputs (tests/test_simgpu.py).
"""
from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass, replace
from typing import Any, Sequence as Seq

from .cost import AttentionProfile, Calibration, LinearProfile, StepCostModel
from .policies import Reservation, System
from .simulator import build_scheduler, run
from .specs import GPUSpec, ModelSpec

TARGET_ERROR = 0.25  # the bar: predictions within 25% of the measurement

Step = tuple  # ((start, num_new), ...): one engine step, as the scheduler scheduled it


def machine_spec(read_bytes_per_s: float, gemm_flops_per_s: float, memory_bytes: int = 0,
                 name: str = "this-cpu") -> GPUSpec:
    """This machine as the cost model's "GPU": its measured read bandwidth and GEMM rate."""
    return GPUSpec(name, memory_bytes, float(read_bytes_per_s), float(gemm_flops_per_s),
                   "measured here: minipaged.bench.hardware (STREAM-like read, square fp32 GEMM)")


def model_spec_of(model: Any, name: str | None = None, dtype_bytes: int | None = None) -> ModelSpec:
    """The :class:`ModelSpec` of a minipaged model, read from its config and its parameters
    (``dtype_bytes``: default the parameters' element size, 4 on the plain fp32 route)."""
    import torch

    c = model.config
    p = next(model.parameters())
    db = dtype_bytes or (p.element_size() if isinstance(p, torch.Tensor) else 4)
    tied = bool(getattr(c, "tie_word_embeddings", True))
    spec = ModelSpec(name or getattr(c, "name", "model"), c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads,
                     c.head_dim, c.intermediate_size, c.vocab_size, c.max_position_embeddings, 0, "gated", tied,
                     "the served model's own config", db)
    # the matrices the shape implies (norms are a rounding error): what a step reads and multiplies
    return replace(spec, num_params=spec.shape_params())


def cost_model(machine: GPUSpec, model: ModelSpec, calibration: Calibration,
               profile: LinearProfile | None = None, attention: AttentionProfile | None = None,
               fused_decode: Any = None) -> StepCostModel:
    return StepCostModel(machine, model, calibration, dtype_bytes=model.dtype_bytes, linear_profile=profile,
                         attention_profile=attention, fused_decode=fused_decode)


def route_decode_groups(backend: Any) -> Any:
    """The rule by which ``backend`` (an engine's ``AttentionBackend``) splits a step's decodes into
    calls, for :class:`AttentionProfile`: PyTorch's padded gather has one
    (``torch_sdpa.decode_groups``); any other backend is taken as one call."""
    from ...attention import torch_sdpa

    return torch_sdpa.decode_groups if backend.paged_attention is torch_sdpa.paged_attention else None


# -- calibration ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Sample:
    """One measured step: what it computed and how long it took (seconds)."""

    step: Step
    seconds: float


def _fit_overheads(residuals: list[tuple[int, float]]) -> tuple[float, float]:
    """Least squares of ``r = a + b * seqs`` over ``(seqs, r)`` pairs, with ``a, b >= 0``."""
    n = len(residuals)
    if n == 0:
        return 0.0, 0.0
    xs, ys = [s for s, _ in residuals], [r for _, r in residuals]
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx > 0 else 0.0
    a = my - b * mx
    if b < 0:  # no per-sequence cost shows: one constant
        a, b = my, 0.0
    if a < 0:  # no per-step cost shows: through the origin
        a = 0.0
        b = sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs) if any(xs) else 0.0
    return max(a, 0.0), max(b, 0.0)


def fit_calibration(machine: GPUSpec, model: ModelSpec, decode: Seq[Sample], prefill: Seq[Sample] = (),
                    rounds: int = 8, max_compute_efficiency: float = 1.5,
                    profile: LinearProfile | None = None, attention: AttentionProfile | None = None) -> Calibration:
    """The calibration that makes the roofline meet the measured steps.

    * ``compute_efficiency``: from the ``prefill`` samples (compute-bound steps: many tokens),
      the share of the measured GEMM rate they reach, after the overheads (the median over
      samples); 1.0 when none are given;
    * ``step_overhead_s`` and ``seq_overhead_s``: from the ``decode`` samples, the least-squares
      line through what the roofline leaves unexplained against the number of sequences
      (both >= 0); two batches at least to separate them.

    The two depend on each other (a compute-bound decode step's roofline uses the efficiency;
    the prefill's overhead is the line's), so they are refined together for a few ``rounds``.
    The bandwidth is not fitted: the measured read rate is what a step can reach. With a
    ``profile`` the linear layers' measured time is taken off first, and the efficiency is
    attention's alone (the only FLOPs left to the roofline); an ``attention`` profile takes the
    decodes' attention off the same way. When it times the prefills' attention too, nothing is
    left to an efficiency: the decode samples give the overheads per step and per sequence, the
    prefill samples (many tokens, one sequence) the overhead per token, refined together."""
    if attention is not None and attention.prefill is not None:
        # every matmul and all attention measured: what is left is overhead, per step, per sequence
        # and per token (the ops no profile covers)
        bare = cost_model(machine, model, Calibration(1.0, 1.0, 0.0, 0.0), profile, attention)
        dec = [(len(s.step), s.seconds - bare.step_time(s.step)) for s in decode]
        pre = [(len(s.step), sum(n for _, n in s.step), s.seconds - bare.step_time(s.step)) for s in prefill]
        a = b = c = 0.0
        for _ in range(max(1, rounds)):  # the decodes pin a and b, the prefills' many tokens c
            a, b = _fit_overheads([(n, r - c * n) for n, r in dec])
            per_token = [(r - a - b * n) / t for n, t, r in pre if t > 0]
            c = max(statistics.median(per_token), 0.0) if per_token else 0.0
        return Calibration(1.0, 1.0, a, b, c)
    cal = Calibration(bandwidth_efficiency=1.0, compute_efficiency=1.0, step_overhead_s=0.0, seq_overhead_s=0.0)
    for _ in range(max(1, rounds)):
        bare = cost_model(machine, model, replace(cal, step_overhead_s=0.0, seq_overhead_s=0.0), profile, attention)
        res = [(len(s.step), s.seconds - bare.step_time(s.step)) for s in decode]
        a, b = _fit_overheads(res)
        eff = cal.compute_efficiency
        effs = []
        for s in prefill:
            c = cost_model(machine, model, Calibration(1.0, 1.0, 0.0, 0.0), profile, attention).cost(s.step)
            compute_time = s.seconds - (a + b * len(s.step)) - c.linear_s - c.attention_s
            if compute_time > 0 and c.flops > 0:
                effs.append(c.flops / machine.peak_flops / compute_time)
        if effs:
            eff = min(max(statistics.median(effs), 1e-3), max_compute_efficiency)
        cal = Calibration(1.0, eff, a, b)
    return cal


def mean_sample(a: Sample, b: Sample) -> Sample:
    """Two measurements of the same step (two passes): the mean of their seconds."""
    if a.step != b.step:
        raise ValueError(f"mean_sample needs the same step twice, got {a.step[:2]}... and {b.step[:2]}...")
    return Sample(a.step, (a.seconds + b.seconds) / 2)


def mean_profile(a: dict, b: dict, keys: tuple) -> dict:
    """Two passes of a ``hardware`` profile (same grid): ``a`` with each of ``keys`` (a list, or a
    list of lists) replaced by the element-wise mean."""
    def mean(x: Any, y: Any) -> Any:
        if isinstance(x, list):
            if not isinstance(y, list) or len(x) != len(y):
                raise ValueError("mean_profile needs two profiles on the same grid")
            return [mean(p, q) for p, q in zip(x, y)]
        return (x + y) / 2

    return {**a, **{k: mean(a[k], b[k]) for k in keys}}


def mean_cells(a: dict, b: dict) -> dict:
    """Two passes of :func:`measured_cells` (the same bench, the same steps): each cell's seconds
    averaged, its throughput the output tokens over that mean; ``passes_tokens_per_s`` keeps both."""
    out = {}
    for cell in a:
        x, y = a[cell], b.get(cell)
        if y is None or x["steps"] != y["steps"] or x["output_tokens"] != y["output_tokens"]:
            raise ValueError(f"mean_cells: the two passes of {cell!r} ran different steps or tokens")
        sec = (x["seconds"] + y["seconds"]) / 2
        out[cell] = {**x, "seconds": sec, "tokens_per_s": x["output_tokens"] / sec,
                     "passes_tokens_per_s": [x["tokens_per_s"], y["tokens_per_s"]]}
    return out


# -- prediction -----------------------------------------------------------------------------------
def predict_steps(cost: StepCostModel, steps: Seq[Step]) -> list[float]:
    return [cost.step_time(s) for s in steps]


def error(predicted: float, measured: float) -> float:
    """The relative error, prediction / measurement - 1 (positive: predicted too slow)."""
    return predicted / measured - 1.0 if measured > 0 else float("inf")


def decode_step(batch: int, context: int) -> Step:
    """A decode step of ``batch`` sequences, each reading ``context`` tokens (its new one too)."""
    return tuple([(context - 1, 1)] * batch)


# The settings the engine and the simulated scheduler share (so they schedule alike): EngineConfig keywords.
ENGINE_SHAPE = {"block_size": 16, "num_blocks": 512, "max_num_seqs": 64, "max_num_batched_tokens": 512,
                "max_model_len": 2048, "enable_prefix_caching": False}


def engine_shape(**changes: Any) -> dict:
    """:data:`ENGINE_SHAPE` with ``changes`` (EngineConfig keywords): give it to the engine
    (``LLMEngine(model, tok, **shape)``) and to :func:`simulate_workload`."""
    from ...config import CONFIG_FIELDS

    bad = sorted(set(changes) - set(CONFIG_FIELDS))
    if bad:
        raise ValueError(f"not EngineConfig settings: {', '.join(bad)}")
    return {**ENGINE_SHAPE, **changes}


def simulate_workload(cost: StepCostModel, requests: Seq[tuple[int, int]], shape: dict) -> dict:
    """The workload (``(prompt_len, output_len)`` pairs, all arriving at once) through minipaged's
    scheduler and block pool on the simulated clock: seconds, steps, output tokens per second."""
    bs = shape["block_size"]
    sched = build_scheduler("vllm", shape["num_blocks"] * bs, bs, shape["max_model_len"], shape["max_num_seqs"],
                            shape["max_num_batched_tokens"])
    res = run(sched, list(requests), [0.0] * len(requests), cost, system="vllm", skip_ahead=False)
    tokens = sum(o for _, o in requests)
    return {"seconds": res.duration, "steps": res.num_steps, "output_tokens": tokens,
            "tokens_per_s": tokens / res.duration if res.duration > 0 else 0.0, "preemptions": res.num_preemptions}


def workload(n: int, prompt: tuple[int, int], output: tuple[int, int], seed: int = 0) -> list[tuple[int, int]]:
    """``n`` requests with prompt and output lengths uniform in the given ranges (seeded)."""
    rng = random.Random(seed)
    return [(rng.randint(*prompt), rng.randint(*output)) for _ in range(n)]


# -- the factorial bench (minipaged bench) through the simulator --------------------------------------
FACTORIAL_CELLS = ("naive", "static_contiguous", "static_paged", "continuous_contiguous", "continuous_paged")


@dataclass(frozen=True)
class FactorialSetup:
    """What ``minipaged bench`` (``serving.run_bench``) gives every cell: the requests
    (``(prompt_len, output_len)``, all arriving at 0), the KV blocks every system shares, the
    contiguous reservation (the longest prompt + the longest output), the seats and the token
    budget; naive serves only the requests ``naive_served`` (by index), one at a time."""

    requests: tuple
    num_blocks: int
    block_size: int
    reserve_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    naive_served: tuple

    def requests_of(self, cell: str) -> list[tuple[int, int]]:
        return [self.requests[i] for i in self.naive_served] if cell == "naive" else list(self.requests)


def factorial_setup(config: Any, quick: bool = True, workload_name: str = "sharegpt", seed: int = 0,
                    block_size: int = 16, max_num_batched_tokens: int = 1024, **shape_overrides: Any) -> FactorialSetup:
    """The bench's workload and settings for a model of ``config``, built as ``run_bench`` builds
    them (its QUICK or FULL shape, then ``shape_overrides``: ``num_requests``, ``static_batch``,
    ``max_output``, ``naive_requests``, ...). :func:`check_setup` compares it with what a bench
    run reports, so a change to the bench cannot pass unnoticed."""
    from ... import parts
    from ..serving import FULL, QUICK
    from ..workloads import synthetic

    shape = dict(QUICK if quick else FULL)
    shape.update({k: v for k, v in shape_overrides.items() if v is not None})
    max_out = min(shape["max_output"], config.max_position_embeddings // 2)
    max_prompt = min(shape["max_prompt"], config.max_position_embeddings - max_out)
    wl = synthetic(workload_name, shape["num_requests"], seed, vocab_size=config.vocab_size, max_output=max_out,
                   max_prompt=max_prompt, prompt_scale=shape["prompt_scale"], output_scale=shape["output_scale"])
    reqs = tuple((len(r.prompt_token_ids), r.max_tokens) for r in wl.requests)
    n = len(reqs)
    reserve = max(p for p, _ in reqs) + max(o for _, o in reqs)
    k = shape["naive_requests"]
    served = tuple(range(n)) if k is None or k >= n else tuple(round(j * (n - 1) / max(k - 1, 1)) for j in range(k))
    return FactorialSetup(reqs, shape["static_batch"] * parts.cdiv(reserve, block_size), block_size, reserve, max(n, 1),
                          max_num_batched_tokens, served)


def check_setup(setup: FactorialSetup, bench: dict) -> None:
    """Raise if a bench result (``run_bench``'s dict) was not run on ``setup``'s workload and budget."""
    kb, w = bench["kv_budget"], bench["workload"]
    p = [q for q, _ in setup.requests]
    o = [q for _, q in setup.requests]
    want = {"blocks": setup.num_blocks, "block_size": setup.block_size, "reserve_len": setup.reserve_len,
            "num_requests": len(setup.requests), "prompt_max": max(p), "prompt_mean": sum(p) / len(p),
            "output_max": max(o), "output_mean": sum(o) / len(o)}
    got = {"blocks": kb["blocks"], "block_size": kb["block_size"], "reserve_len": kb["reserve_len"],
           "num_requests": w["num_requests"], "prompt_max": w["prompt_len"]["max"],
           "prompt_mean": w["prompt_len"]["mean"], "output_max": w["output_len"]["max"],
           "output_mean": w["output_len"]["mean"]}
    bad = {k: (want[k], got[k]) for k in want if abs(want[k] - got[k]) > 1e-9}
    if bad:
        raise RuntimeError(f"the bench ran another workload or budget than the validation simulates "
                           f"(validation, bench): {bad}; keep factorial_setup in step with serving.run_bench")


def factorial_scheduler(cell: str, setup: FactorialSetup) -> Any:
    """The simulator's parts for one cell of the bench, through the same seams as the paper's
    baselines (:mod:`.policies`), over the bench's KV blocks:

    * ``continuous_paged``: minipaged's scheduler and block pool, as the bench's engine;
    * ``*_contiguous``: a reservation of ``reserve_len`` slots in whole blocks (the bench's
      contiguous block table holds that from admission to finish), slots placed anywhere;
    * ``static_paged``: a reservation of each request's peak (prompt + output - 1) in whole
      blocks, the size by which the bench forms its static paged batches;
    * ``static_*``: no refill, a batch is formed when the last one has drained, at most
      ``max_num_seqs`` requests;
    * ``naive``: the paged scheduler with one seat."""
    bs, kv = setup.block_size, setup.num_blocks * setup.block_size
    common = dict(block_size=bs, max_len=setup.reserve_len, max_num_batched_tokens=setup.max_num_batched_tokens)
    if cell == "naive":
        return build_scheduler("vllm", kv, max_num_seqs=1, **common)
    if cell == "continuous_paged":
        return build_scheduler("vllm", kv, max_num_seqs=setup.max_num_seqs, **common)
    if cell not in FACTORIAL_CELLS:
        raise ValueError(f"unknown cell {cell!r}: one of {', '.join(FACTORIAL_CELLS)}")
    policy, layout = cell.split("_")
    static = policy == "static"
    reservation = Reservation("max" if layout == "contiguous" else "peak", block_size=bs)
    return build_scheduler(System(cell, cell, reservation, static=static), kv, max_num_seqs=setup.max_num_seqs,
                           placement=None, max_batch=setup.max_num_seqs if static else None, **common)


def simulate_cell(cost: StepCostModel, cell: str, setup: FactorialSetup) -> dict:
    """One cell of the bench on the simulated clock: seconds, steps, output tokens per second,
    how many requests completed, the largest batch of a step and the preemptions."""
    reqs = setup.requests_of(cell)
    res = run(factorial_scheduler(cell, setup), reqs, [0.0] * len(reqs), cost, system=cell, keep_batches=True,
              skip_ahead=False)
    tokens = sum(o for _, o in reqs)
    return {"seconds": res.duration, "steps": res.num_steps, "output_tokens": tokens,
            "tokens_per_s": res.throughput_tokens, "completed": len(reqs) - res.rejected,
            "peak_batch": max(res.batch_sizes, default=0), "preemptions": res.num_preemptions}


def measured_cells(bench: dict) -> dict:
    """Each factorial cell of a ``run_bench`` result (with its ``_runs``): output tokens per
    second, seconds, engine steps, requests completed, the largest batch of a step, preemptions."""
    out = {}
    for cell in FACTORIAL_CELLS:
        d = bench["systems"].get(cell)
        r = bench.get("_runs", {}).get(cell)
        if d is None or r is None:
            continue
        tr = r.trace
        out[cell] = {"tokens_per_s": d["output_tokens_per_s"], "seconds": d["seconds"], "steps": r.engine.num_steps,
                     "output_tokens": d["output_tokens"], "completed": len(r.finish),
                     "peak_batch": max((len(s.batch) for s in tr.steps), default=0) if tr is not None else None,
                     "preemptions": d.get("preemptions"), "num_batches": d.get("num_batches")}
    return out


def compare_factorial(cost: StepCostModel, setup: FactorialSetup, measured: dict) -> dict:
    """Predicted against measured throughput for every measured cell (no timing happens here)."""
    cells = {}
    for cell in FACTORIAL_CELLS:
        if cell not in measured:
            continue
        me, sim = measured[cell], simulate_cell(cost, cell, setup)
        cells[cell] = {"measured": me, "predicted": sim, "error": error(sim["tokens_per_s"], me["tokens_per_s"]),
                       "same_steps_as_engine": sim["steps"] == me["steps"],
                       "same_requests_completed": sim["completed"] == me["completed"]
                       and sim["output_tokens"] == me["output_tokens"]}
    errs = [abs(c["error"]) for c in cells.values()]
    return {"cells": cells, "requests": len(setup.requests), "naive_requests": len(setup.naive_served),
            "kv_blocks": setup.num_blocks, "block_size": setup.block_size, "reserve_len": setup.reserve_len,
            "max_num_seqs": setup.max_num_seqs, "max_num_batched_tokens": setup.max_num_batched_tokens,
            "worst_error": max(errs) if errs else None,
            "within_target": bool(errs) and max(errs) <= TARGET_ERROR}


# -- measuring the real engine ----------------------------------------------------------------------
class record_steps:
    """Within ``with record_steps(engine) as rec:``, every ``engine.step()`` called through
    ``rec.step()`` is timed, and what its scheduler scheduled is kept: ``rec.samples``. Every
    step scheduled inside the block, whoever drives the engine (``LLM.generate`` too), is kept
    untimed in ``rec.steps``: its ``(start, num_new)`` pairs, to price with a cost model."""

    def __init__(self, engine: Any) -> None:
        self.engine, self.samples, self.steps, self._last = engine, [], [], None

    def __enter__(self) -> "record_steps":
        sched = self.engine.scheduler
        self._orig = sched.schedule

        def schedule(*a: Any, **k: Any) -> Any:
            out = self._orig(*a, **k)
            self._last = tuple((s.start, s.num_new_tokens) for s in out.scheduled)
            if self._last:
                self.steps.append(self._last)
            return out

        sched.schedule = schedule  # an instance attribute: the engine calls self.scheduler.schedule()
        return self

    def __exit__(self, *exc: Any) -> None:
        del self.engine.scheduler.schedule

    def step(self) -> list:
        self._last = None
        t = time.perf_counter()
        outs = self.engine.step()
        dt = time.perf_counter() - t
        if self._last:
            self.samples.append(Sample(self._last, dt))
        return outs

    def run(self) -> list[Sample]:
        """Step until every request finished; the samples of those steps."""
        first = len(self.samples)
        while self.engine.has_unfinished_requests():
            self.step()
        return self.samples[first:]


def _add(engine: Any, prompt_len: int, max_tokens: int, seed: int) -> None:
    from ...sampling import SamplingParams

    rng = random.Random(seed)
    vocab = engine.model.config.vocab_size
    ids = [rng.randrange(3, vocab) for _ in range(prompt_len)]
    engine.add_request(ids, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


def measure_decode(engine: Any, batch: int, prompt_len: int, steps: int, skip: int = 1, seed: int = 0) -> Sample:
    """``batch`` prompts of ``prompt_len`` at once, decoded for ``skip + steps`` steps; the median
    of the last ``steps`` pure-decode steps (every sequence one token), as one Sample of the
    median context. The prefill steps are returned by :func:`measure_prefill` separately."""
    for i in range(batch):
        _add(engine, prompt_len, 1 + skip + steps, seed * 1000 + i)
    with record_steps(engine) as rec:
        samples = rec.run()
    dec = [s for s in samples if len(s.step) == batch and all(n == 1 for _, n in s.step)][skip:]
    if not dec:
        raise RuntimeError(f"no pure decode step at batch {batch}: raise max_num_seqs or the KV cache")
    mid = dec[len(dec) // 2]
    return Sample(mid.step, statistics.median(s.seconds for s in dec))


def measure_prefill(engine: Any, tokens: int, repeats: int = 3, seed: int = 1) -> Sample:
    """The median time of a step computing ``tokens`` prompt tokens of fresh sequences (one
    prompt per step: its prefill and first token)."""
    got = []
    for r in range(repeats):
        _add(engine, tokens, 1, seed * 1000 + r)
        with record_steps(engine) as rec:
            got += [s for s in rec.run() if sum(n for _, n in s.step) == tokens]
    if not got:
        raise RuntimeError(f"no step computed {tokens} prompt tokens at once: raise max_num_batched_tokens")
    return Sample(got[0].step, statistics.median(s.seconds for s in got))


def measure_workload(engine: Any, requests: Seq[tuple[int, int]], seed: int = 2) -> tuple[dict, list[Sample]]:
    """The workload served by the real engine, all requests at once: wall seconds, steps, output
    tokens per second, and each step's Sample (for the replay)."""
    for i, (p, o) in enumerate(requests):
        _add(engine, p, o, seed * 100_000 + i)
    t = time.perf_counter()
    with record_steps(engine) as rec:
        samples = rec.run()
    wall = time.perf_counter() - t
    tokens = sum(o for _, o in requests)
    return ({"seconds": wall, "steps": len(samples), "output_tokens": tokens, "tokens_per_s": tokens / wall,
             "step_seconds_sum": sum(s.seconds for s in samples)}, samples)


def measure_factorial(model: Any, setup_kwargs: dict, seed: int = 0, roofline_batches: tuple = (1, 16),
                      engine: dict | None = None) -> tuple[FactorialSetup, dict]:
    """``minipaged bench`` run here on ``model`` (``serving.run_bench``: naive and all four
    factorial cells, no online sweep, no shared-prefix run; ``engine``: EngineConfig settings,
    default the plain route, ``fast_paths=False``), and the setup it ran, checked against it.
    ``setup_kwargs``: :func:`factorial_setup`'s keywords (``quick``, ``num_requests``, ...)."""
    from ..serving import run_bench

    kw = dict(setup_kwargs)
    setup = factorial_setup(model.config, seed=seed, **kw)
    quick = kw.pop("quick", True)
    kw["workload"] = kw.pop("workload_name", "sharegpt")
    for k in ("block_size", "max_num_batched_tokens"):
        kw.setdefault(k, getattr(setup, k))
    bench = run_bench(quick=quick, model=model, systems=FACTORIAL_CELLS, seed=seed, progress=False, online_requests=0,
                      shared_prefix=False, roofline_batches=roofline_batches,
                      engine={"fast_paths": False} if engine is None else engine, **kw)
    check_setup(setup, bench)
    return setup, bench


# -- the whole validation -------------------------------------------------------------------------
def compare(machine: GPUSpec, model: ModelSpec, calibration_decode: Seq[Sample], calibration_prefill: Seq[Sample],
            validation_decode: Seq[Sample], workload_requests: Seq[tuple[int, int]] = (),
            workload_measured: dict | None = None, workload_samples: Seq[Sample] = (),
            shape: dict | None = None, factorial: tuple[FactorialSetup, dict] | None = None,
            profile: LinearProfile | None = None, attention: AttentionProfile | None = None) -> dict:
    """Calibrate on the calibration samples, predict the rest, and report every error (no
    timing happens here: the measurements are arguments). ``factorial``: the bench's setup and
    its measured cells (:func:`measured_cells`), each predicted with the same calibration.
    ``profile``: the linear layers' measured times (``hardware.linear_profile``), which replace
    the roofline's weight terms; ``attention``: attention's measured times (decodes from
    ``hardware.attention_profile``, prefills from its ``prefill`` timer where given), which replace
    the roofline's K/V reads and attention FLOPs; without them, the roofline alone."""
    cal = fit_calibration(machine, model, calibration_decode, calibration_prefill, profile=profile,
                          attention=attention)
    cost = cost_model(machine, model, cal, profile, attention)

    def row(s: Sample, role: str) -> dict:
        p = cost.step_time(s.step)
        c = cost.cost(s.step)
        return {"role": role, "batch": len(s.step), "tokens": sum(n for _, n in s.step),
                "context": max(a + n for a, n in s.step), "measured_s": s.seconds, "predicted_s": p,
                "bound": c.bound, "error": error(p, s.seconds)}

    rows = ([row(s, "calibration") for s in calibration_decode] + [row(s, "calibration") for s in calibration_prefill]
            + [row(s, "validation") for s in validation_decode])
    out: dict = {"machine": {"read_GBps": machine.bandwidth / 1e9, "gemm_GFLOPs": machine.peak_flops / 1e9},
                 "model": {"name": model.name, "params": model.num_params, "dtype_bytes": model.dtype_bytes},
                 "calibration": {"bandwidth_efficiency": cal.bandwidth_efficiency,
                                 "compute_efficiency": cal.compute_efficiency,
                                 "step_overhead_s": cal.step_overhead_s, "seq_overhead_s": cal.seq_overhead_s,
                                 "token_overhead_s": cal.token_overhead_s,
                                 "fitted_on": ("the calibration rows: decode steps (overheads per step and per "
                                               "sequence), prefill steps (per token); every matmul and all attention "
                                               "measured by the profiles" if attention is not None and
                                               attention.prefill is not None else
                                               "the calibration rows: decode steps (overheads), prefill steps "
                                               "(compute efficiency); the bandwidth as measured")},
                 "linear_profile": profile.to_dict() if profile is not None else None,
                 "attention_profile": attention.to_dict() if attention is not None else None,
                 "steps": rows, "target_error": TARGET_ERROR}
    errors = [abs(r["error"]) for r in rows if r["role"] == "validation"]
    if workload_measured is not None:
        sim = simulate_workload(cost, workload_requests, engine_shape() if shape is None else shape)
        replay = sum(predict_steps(cost, [s.step for s in workload_samples]))
        tokens = workload_measured["output_tokens"]
        w = {"requests": len(workload_requests), "output_tokens": tokens, "measured": workload_measured,
             "replayed": {"seconds": replay, "tokens_per_s": tokens / replay if replay > 0 else 0.0,
                          "steps": len(workload_samples)},
             "simulated": sim}
        w["replayed"]["error"] = error(w["replayed"]["tokens_per_s"], workload_measured["tokens_per_s"])
        w["simulated"]["error"] = error(sim["tokens_per_s"], workload_measured["tokens_per_s"])
        w["same_steps_as_engine"] = sim["steps"] == workload_measured["steps"]
        out["workload"] = w
        errors += [abs(w["replayed"]["error"]), abs(w["simulated"]["error"])]
    if factorial is not None:
        out["factorial"] = compare_factorial(cost, *factorial)
        errors += [abs(c["error"]) for c in out["factorial"]["cells"].values()]
    out["worst_validation_error"] = max(errors) if errors else None
    out["within_target"] = bool(errors) and max(errors) <= TARGET_ERROR
    return out


def format_report(res: dict) -> str:
    m, c = res["machine"], res["calibration"]
    lines = [f"this CPU: read {m['read_GBps']:.1f} GB/s, fp32 GEMM {m['gemm_GFLOPs']:.0f} GFLOP/s; "
             f"{res['model']['name']} at {res['model']['dtype_bytes']} bytes/weight (the plain route)",
             ("linear layers: their measured time at each row count (hardware.linear_profile, on the model's own "
              "weights)" if res.get("linear_profile") else
              "linear layers: the roofline (weights read once a step, 2 FLOPs a weight a token)"),
             ("attention: its measured time as the route runs it, call by call (hardware.attention_profile for "
              "decodes, hardware.attention_timer for each prefill shape)"
              if res.get("attention_profile") else "attention: the roofline (each context's K and V read once)"),
             f"calibration: step overhead {c['step_overhead_s'] * 1e3:.2f} ms, per sequence "
             f"{c['seq_overhead_s'] * 1e3:.3f} ms, per token {c.get('token_overhead_s', 0.0) * 1e3:.3f} ms, compute efficiency {c['compute_efficiency']:.2f} of the GEMM rate"
             f"{' (attention)' if res.get('linear_profile') else ''}, "
             f"bandwidth as measured",
             f"{'role':<12}{'batch':>6}{'tokens':>7}{'context':>8}{'measured ms':>13}{'predicted ms':>14}"
             f"{'bound':>9}{'error':>8}"]
    for r in res["steps"]:
        lines.append(f"{r['role']:<12}{r['batch']:>6}{r['tokens']:>7}{r['context']:>8}{r['measured_s'] * 1e3:>13.2f}"
                     f"{r['predicted_s'] * 1e3:>14.2f}{r['bound']:>9}{r['error']:>+8.0%}")
    w = res.get("workload")
    if w:
        me = w["measured"]
        lines.append(f"workload: {w['requests']} requests, {w['output_tokens']} output tokens, all at once")
        lines.append(f"  measured   {me['tokens_per_s']:8.1f} tok/s  ({me['seconds']:.2f} s, {me['steps']} steps)")
        for k in ("replayed", "simulated"):
            lines.append(f"  {k:<10} {w[k]['tokens_per_s']:8.1f} tok/s  ({w[k]['seconds']:.2f} s, "
                         f"{w[k]['steps']} steps)  error {w[k]['error']:+.0%}")
        lines.append(f"  the simulated scheduler took {'the same' if w['same_steps_as_engine'] else 'a different'} "
                     f"number of steps as the engine")
    f = res.get("factorial")
    if f:
        lines.append(f"factorial bench (minipaged bench, plain route): {f['requests']} requests (naive: "
                     f"{f['naive_requests']}), {f['kv_blocks']} KV blocks of {f['block_size']}, contiguous reservation "
                     f"{f['reserve_len']} tokens")
        lines.append(f"  {'cell':<22}{'measured tok/s':>15}{'predicted tok/s':>16}{'error':>8}"
                     f"{'steps (engine/sim)':>20}{'peak batch':>12}")
        for cell, c in f["cells"].items():
            me, pr = c["measured"], c["predicted"]
            lines.append(f"  {cell:<22}{me['tokens_per_s']:>15.1f}{pr['tokens_per_s']:>16.1f}{c['error']:>+8.0%}"
                         f"{str(me['steps']) + ' / ' + str(pr['steps']):>20}"
                         f"{str(me['peak_batch']) + ' / ' + str(pr['peak_batch']):>12}")
        if f["worst_error"] is not None:
            lines.append(f"  worst cell error {f['worst_error']:.0%}: {'within' if f['within_target'] else 'outside'} "
                         f"the {TARGET_ERROR:.0%} target")
    worst = res["worst_validation_error"]
    if worst is not None:
        lines.append(f"worst validation error {worst:.0%}: {'within' if res['within_target'] else 'outside'} "
                     f"the {TARGET_ERROR:.0%} target")
    return "\n".join(lines)


__all__ = ["TARGET_ERROR", "FACTORIAL_CELLS", "Sample", "LinearProfile", "AttentionProfile", "route_decode_groups", "mean_sample",
           "mean_profile", "mean_cells", "ENGINE_SHAPE", "engine_shape", "FactorialSetup", "machine_spec",
           "model_spec_of", "cost_model", "fit_calibration", "predict_steps", "error", "decode_step",
           "simulate_workload", "workload",
           "factorial_setup", "check_setup", "factorial_scheduler", "simulate_cell", "measured_cells",
           "compare_factorial", "record_steps", "measure_decode", "measure_prefill", "measure_workload",
           "measure_factorial", "compare", "format_report"]
