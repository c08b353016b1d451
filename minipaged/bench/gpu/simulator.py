"""The simulated GPU: the paper's systems served on the clock of a roofline cost model.

Owns the paper's parts and measures. :func:`build_scheduler` builds a system (minipaged's
scheduler and block pool, or a baseline: the same parts under a reservation policy);
:func:`run` serves requests through it on :func:`minipaged.bench.clock.run_clock` (the one
scheduler-on-a-clock loop), priced by a :class:`~.cost.StepCostModel` on the named GPU, and
reads what the paper measures: each request's end-to-end latency, and the number of requests
batched in each step. EOS never comes, so each request produces exactly its output length.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence as Seq

from ...block_allocator import BlockAllocator
from ...block_table import BlockTable
from ...config import EngineConfig
from ...scheduler import Scheduler
from ..clock import LengthStop, run_clock
from ..simulate import make_scheduler
from .cost import MAX_NUM_BATCHED_TOKENS, MAX_NUM_SEQS, StepCostModel
from .policies import SYSTEMS, ReservingScheduler, System
from .specs import get_model


@dataclass
class SimResult:
    """One system at one request rate."""

    system: str
    rate: float
    num_requests: int
    normalized_latency: float  # mean over requests of (finish - arrival) / output tokens, s/token
    mean_latency: float  # s
    mean_batched_requests: float  # mean over steps, while requests still arrive
    throughput_tokens: float  # output tokens / s over the whole run
    num_steps: int
    num_preemptions: int
    duration: float  # simulated seconds
    rejected: int = 0
    batch_sizes: list = field(default_factory=list, repr=False)  # per step (kept when asked)
    finish_times: list = field(default_factory=list, repr=False)  # per request, s (NaN: rejected)

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d.pop("batch_sizes")
        d.pop("finish_times")
        return d


@dataclass(frozen=True)
class Setting:
    """One simulated setting (GPU, model, dataset and the scheduler's limits): what every run of
    ``minipaged bench paper``'s experiments (``paper.py``, ``sharing.py``) is given."""

    gpu: str = "a100-40gb"
    model: str = "opt-13b"
    dataset: str = "sharegpt"
    block_size: int = 16
    memory_bytes: int | None = None  # override the GPU's memory (a dial)
    max_num_seqs: int = MAX_NUM_SEQS
    max_num_batched_tokens: int = MAX_NUM_BATCHED_TOKENS
    seed: int = 0
    kv_cache_dtype: str = "auto"  # "auto": the weights' 16 bits; fp8/int8: 1 byte a value (int8's scales ignored)

    def spec(self):
        """The model's spec, its KV at ``kv_cache_dtype``'s bytes."""
        from dataclasses import replace

        m = get_model(self.model)
        return m if self.kv_cache_dtype == "auto" else replace(m, kv_dtype_bytes=1)

    def max_len(self) -> int:
        return min(get_model(self.model).max_len, 2048) if self.model.startswith("opt") else get_model(self.model).max_len


def pool_map(fn, tasks: list, workers: int, on_result=None) -> list:
    """``[fn(t) for t in tasks]``, over ``workers`` forked processes (in order; ``on_result(res, t)``
    after each)."""
    if workers <= 1 or len(tasks) <= 1:
        out = []
        for t in tasks:
            out.append(fn(t))
            if on_result:
                on_result(out[-1], t)
        return out
    import multiprocessing as mp

    ctx = mp.get_context("fork") if "fork" in mp.get_all_start_methods() else mp.get_context()
    out = []
    with ctx.Pool(workers) as pool:
        # the slowest tasks first, so the two workers finish together
        for res, t in zip(pool.imap(fn, tasks), tasks):
            out.append(res)
            if on_result:
                on_result(res, t)
    return out


def build_scheduler(system: str | System, kv_tokens: int, block_size: int = 16, max_len: int = 2048,
                    max_num_seqs: int = MAX_NUM_SEQS, max_num_batched_tokens: int = MAX_NUM_BATCHED_TOKENS,
                    allocator_cls: type = BlockAllocator, block_table_cls: type = BlockTable,
                    scheduler_cls: type = Scheduler, placement: str | None = "buddy",
                    max_batch: int | None = None, prefix_caching: bool = False) -> Any:
    """The parts for ``system`` over a KV cache of ``kv_tokens`` token slots.

    vLLM: the scheduler over a pool of ``kv_tokens // block_size`` blocks. A baseline: the same
    scheduler over that pool plus one spare block per sequence (so block rounding never binds),
    wrapped in a :class:`ReservingScheduler` holding ``kv_tokens`` of reservations, placed by
    ``placement`` (``buddy``: the paper's assumption for Orca; ``first_fit``; None: anywhere);
    ``max_batch``: the most requests a static batch takes at once (None: as many as fit);
    ``prefix_caching``: the pool keeps computed blocks for later prompts that start alike (vLLM
    only: the paper's baselines share nothing).
    """
    s = SYSTEMS[system] if isinstance(system, str) else system
    num_blocks = kv_tokens // block_size
    if num_blocks < 1:
        raise ValueError(f"a KV cache of {kv_tokens} token slots holds no block of {block_size}")
    if s.reservation is not None:
        num_blocks += max_num_seqs
        if prefix_caching:
            raise ValueError(f"{s.label} reserves contiguous KV per request and shares nothing: prefix caching is vLLM's")
    config = EngineConfig(block_size=block_size, num_blocks=num_blocks, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_len,
                          enable_prefix_caching=prefix_caching, record_trace=False)
    pool = allocator_cls(num_blocks, block_size)
    if prefix_caching:
        from ...prefix_cache import PrefixCache

        pool = PrefixCache(pool)
    inner = make_scheduler(scheduler_cls, pool, block_table_cls, config)
    if s.reservation is None:
        return inner
    return ReservingScheduler(inner, s.reservation, kv_tokens, max_len, static=s.static, max_batch=max_batch,
                              placement=placement)


def run(sched: Any, requests: Seq[tuple[int, int]], arrivals: Seq[float], cost: StepCostModel,
        system: str = "?", rate: float = 0.0, keep_batches: bool = False, skip_ahead: bool = True,
        **clock: Any) -> SimResult:
    """Serve ``requests`` ((prompt_len, output_len) pairs) arriving at ``arrivals`` (seconds,
    sorted) through ``sched`` on the simulated clock of ``cost`` (:func:`~..clock.run_clock`).

    ``skip_ahead`` (the default): runs of identical decode steps are priced from totals without
    the scheduler (``run_clock`` says when); the results equal the step-by-step run's
    (tests/test_simgpu.py checks it). ``skip_ahead=False`` runs every step through the
    scheduler, as a measured attention profile needs. ``clock``: passed on to ``run_clock``
    (``make_request``, ``after_update``, ``on_step``: the sharing experiments, ``sharing.py``).
    """
    if skip_ahead and getattr(cost, "attention_profile", None) is not None:
        raise ValueError("skip_ahead prices decode steps from totals, which a measured attention profile cannot: "
                         "run with skip_ahead=False")
    r = run_clock(sched, requests, arrivals, cost, skip_ahead=skip_ahead, **clock)
    n = len(requests)
    served = r.served
    lat = [r.finish[i] - arrivals[i] for i in served]
    norm = [(r.finish[i] - arrivals[i]) / requests[i][1] for i in served]
    out_tokens = sum(requests[i][1] for i in served)
    duration = r.end - (arrivals[0] if n else 0.0)
    last_arrival = arrivals[-1] if n else 0.0
    # Fig. 13's measure: the mean batch over the steps that end while requests still arrive
    loaded = [m for m, t in zip(r.batch_sizes, r.step_ends) if t <= last_arrival]
    return SimResult(system, rate, n, sum(norm) / max(1, len(norm)), sum(lat) / max(1, len(lat)),
                     sum(loaded) / len(loaded) if loaded else 0.0, out_tokens / duration if duration > 0 else 0.0,
                     r.num_steps, r.num_preemptions, duration, len(r.rejected),
                     r.batch_sizes if keep_batches else [], r.finish)


__all__ = ["Setting", "SimResult", "build_scheduler", "LengthStop", "pool_map", "run"]
