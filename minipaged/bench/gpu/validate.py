"""The cost model checked where it can be measured: the real engine on this machine's CPU.

Owns the validation's logic; ``scripts/validate_simgpu_cpu.py`` is its command line. The same
:class:`~.cost.StepCostModel` the paper runner uses is given this machine instead of a GPU: its
measured read bandwidth and fp32 GEMM rate (``minipaged.bench.hardware``), the served model's
shape from its own config, fp32 weights and KV (the plain route, ``fast_paths=False``). Then:

1. **calibrate** (one calibration, stated): from a few measured steps, fit the two overheads
   (per step, per sequence) and the share of the GEMM rate a whole step reaches
   (:func:`fit_calibration`); the bandwidth is taken as measured (efficiency 1.0);
2. **predict** what was not used to fit: the decode step time at other batches, and the
   throughput of a small offline workload, both replayed step by step (the cost model alone,
   on the engine's own steps) and simulated (the real scheduler on the simulated clock,
   :func:`~.simulator.run`, with no model);
3. **report** each error (prediction / measurement - 1); the target is within 25%.

The measuring half (:func:`record_steps`, :func:`measure_decode`, :func:`measure_workload`)
drives a real engine and times its steps; everything else is arithmetic on what it records,
tested on tiny inputs (tests/test_simgpu.py).
"""
from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass, replace
from typing import Any, Sequence as Seq

from .cost import Calibration, StepCostModel
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


def cost_model(machine: GPUSpec, model: ModelSpec, calibration: Calibration) -> StepCostModel:
    return StepCostModel(machine, model, calibration, dtype_bytes=model.dtype_bytes)


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
                    rounds: int = 8, max_compute_efficiency: float = 1.5) -> Calibration:
    """The calibration that makes the roofline meet the measured steps.

    * ``compute_efficiency``: from the ``prefill`` samples (compute-bound steps: many tokens),
      the share of the measured GEMM rate they reach, after the overheads (the median over
      samples); 1.0 when none are given;
    * ``step_overhead_s`` and ``seq_overhead_s``: from the ``decode`` samples, the least-squares
      line through what the roofline leaves unexplained against the number of sequences
      (both >= 0); two batches at least to separate them.

    The two depend on each other (a compute-bound decode step's roofline uses the efficiency;
    the prefill's overhead is the line's), so they are refined together for a few ``rounds``.
    The bandwidth is not fitted: the measured read rate is what a step can reach."""
    cal = Calibration(bandwidth_efficiency=1.0, compute_efficiency=1.0, step_overhead_s=0.0, seq_overhead_s=0.0)
    for _ in range(max(1, rounds)):
        bare = cost_model(machine, model, replace(cal, step_overhead_s=0.0, seq_overhead_s=0.0))
        res = [(len(s.step), s.seconds - bare.step_time(s.step)) for s in decode]
        a, b = _fit_overheads(res)
        eff = cal.compute_efficiency
        effs = []
        for s in prefill:
            c = cost_model(machine, model, Calibration(1.0, 1.0, 0.0, 0.0)).cost(s.step)
            compute_time = s.seconds - (a + b * len(s.step))
            if compute_time > 0 and c.flops > 0:
                effs.append(c.flops / machine.peak_flops / compute_time)
        if effs:
            eff = min(max(statistics.median(effs), 1e-3), max_compute_efficiency)
        cal = Calibration(1.0, eff, a, b)
    return cal


# -- prediction -----------------------------------------------------------------------------------
def predict_steps(cost: StepCostModel, steps: Seq[Step]) -> list[float]:
    return [cost.step_time(s) for s in steps]


def error(predicted: float, measured: float) -> float:
    """The relative error, prediction / measurement - 1 (positive: predicted too slow)."""
    return predicted / measured - 1.0 if measured > 0 else float("inf")


def decode_step(batch: int, context: int) -> Step:
    """A decode step of ``batch`` sequences, each reading ``context`` tokens (its new one too)."""
    return tuple([(context - 1, 1)] * batch)


@dataclass(frozen=True)
class EngineShape:
    """The settings the engine and the simulated scheduler share (so they schedule alike)."""

    block_size: int = 16
    num_blocks: int = 512
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int = 2048

    def engine_kwargs(self) -> dict:
        return {"block_size": self.block_size, "num_blocks": self.num_blocks, "max_num_seqs": self.max_num_seqs,
                "max_num_batched_tokens": self.max_num_batched_tokens, "max_model_len": self.max_model_len,
                "enable_prefix_caching": False}


def simulate_workload(cost: StepCostModel, requests: Seq[tuple[int, int]], shape: EngineShape) -> dict:
    """The workload (``(prompt_len, output_len)`` pairs, all arriving at once) through minipaged's
    scheduler and block pool on the simulated clock: seconds, steps, output tokens per second."""
    sched = build_scheduler("vllm", shape.num_blocks * shape.block_size, shape.block_size, shape.max_model_len,
                            shape.max_num_seqs, shape.max_num_batched_tokens)
    res = run(sched, list(requests), [0.0] * len(requests), cost, system="vllm", skip_ahead=False)
    tokens = sum(o for _, o in requests)
    return {"seconds": res.duration, "steps": res.num_steps, "output_tokens": tokens,
            "tokens_per_s": tokens / res.duration if res.duration > 0 else 0.0, "preemptions": res.num_preemptions}


def workload(n: int, prompt: tuple[int, int], output: tuple[int, int], seed: int = 0) -> list[tuple[int, int]]:
    """``n`` requests with prompt and output lengths uniform in the given ranges (seeded)."""
    rng = random.Random(seed)
    return [(rng.randint(*prompt), rng.randint(*output)) for _ in range(n)]


# -- measuring the real engine ----------------------------------------------------------------------
class record_steps:
    """Within ``with record_steps(engine) as rec:``, every ``engine.step()`` called through
    ``rec.step()`` is timed, and what its scheduler scheduled is kept: ``rec.samples``."""

    def __init__(self, engine: Any) -> None:
        self.engine, self.samples, self._last = engine, [], None

    def __enter__(self) -> "record_steps":
        sched = self.engine.scheduler
        self._orig = sched.schedule

        def schedule(*a: Any, **k: Any) -> Any:
            out = self._orig(*a, **k)
            self._last = tuple((s.start, s.num_new_tokens) for s in out.scheduled)
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


# -- the whole validation -------------------------------------------------------------------------
def compare(machine: GPUSpec, model: ModelSpec, calibration_decode: Seq[Sample], calibration_prefill: Seq[Sample],
            validation_decode: Seq[Sample], workload_requests: Seq[tuple[int, int]] = (),
            workload_measured: dict | None = None, workload_samples: Seq[Sample] = (),
            shape: EngineShape = EngineShape()) -> dict:
    """Calibrate on the calibration samples, predict the rest, and report every error (no
    timing happens here: the measurements are arguments)."""
    cal = fit_calibration(machine, model, calibration_decode, calibration_prefill)
    cost = cost_model(machine, model, cal)

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
                                 "fitted_on": "the calibration rows: decode steps (overheads), prefill steps "
                                              "(compute efficiency); the bandwidth as measured"},
                 "steps": rows, "target_error": TARGET_ERROR}
    errors = [abs(r["error"]) for r in rows if r["role"] == "validation"]
    if workload_measured is not None:
        sim = simulate_workload(cost, workload_requests, shape)
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
    out["worst_validation_error"] = max(errors) if errors else None
    out["within_target"] = bool(errors) and max(errors) <= TARGET_ERROR
    return out


def format_report(res: dict) -> str:
    m, c = res["machine"], res["calibration"]
    lines = [f"this CPU: read {m['read_GBps']:.1f} GB/s, fp32 GEMM {m['gemm_GFLOPs']:.0f} GFLOP/s; "
             f"{res['model']['name']} at {res['model']['dtype_bytes']} bytes/weight (the plain route)",
             f"calibration: step overhead {c['step_overhead_s'] * 1e3:.2f} ms, per sequence "
             f"{c['seq_overhead_s'] * 1e3:.3f} ms, compute efficiency {c['compute_efficiency']:.2f} of the GEMM rate, "
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
    worst = res["worst_validation_error"]
    if worst is not None:
        lines.append(f"worst validation error {worst:.0%}: {'within' if res['within_target'] else 'outside'} "
                     f"the {TARGET_ERROR:.0%} target")
    return "\n".join(lines)


__all__ = ["TARGET_ERROR", "Sample", "EngineShape", "machine_spec", "model_spec_of", "cost_model", "fit_calibration",
           "predict_steps", "error", "decode_step", "simulate_workload", "workload", "record_steps", "measure_decode",
           "measure_prefill", "measure_workload", "compare", "format_report"]
