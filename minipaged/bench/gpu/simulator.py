"""The simulated GPU's clock: a real scheduler and block pool served token by token, no model.

Owns the event loop. Requests arrive at their times; each step the scheduler (minipaged's, or
any parts meeting the contracts) picks who runs and how many tokens, the cost model says how
long that step takes on the named GPU, the clock moves on by that much, and every sequence that
samples gets a token (EOS never comes, so each request produces exactly its output length).
What comes out is what the paper measures: each request's end-to-end latency, and the number
of requests batched in each step.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence as Seq

from ...block_allocator import BlockAllocator
from ...block_table import BlockTable
from ...config import EngineConfig
from ...scheduler import Scheduler
from ...sequence import Sequence
from ..simulate import make_scheduler
from .cost import MAX_NUM_BATCHED_TOKENS, MAX_NUM_SEQS, StepCostModel
from .policies import SYSTEMS, ReservingScheduler, System


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

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d.pop("batch_sizes")
        return d


def build_scheduler(system: str | System, kv_tokens: int, block_size: int = 16, max_len: int = 2048,
                    max_num_seqs: int = MAX_NUM_SEQS, max_num_batched_tokens: int = MAX_NUM_BATCHED_TOKENS,
                    allocator_cls: type = BlockAllocator, block_table_cls: type = BlockTable,
                    scheduler_cls: type = Scheduler) -> Any:
    """The parts for ``system`` over a KV cache of ``kv_tokens`` token slots.

    vLLM: the scheduler over a pool of ``kv_tokens // block_size`` blocks. A baseline: the same
    scheduler over that pool plus one spare block per sequence (so block rounding never binds),
    wrapped in a :class:`ReservingScheduler` holding ``kv_tokens`` of reservations.
    """
    s = SYSTEMS[system] if isinstance(system, str) else system
    num_blocks = kv_tokens // block_size
    if num_blocks < 1:
        raise ValueError(f"a KV cache of {kv_tokens} token slots holds no block of {block_size}")
    if s.reservation is not None:
        num_blocks += max_num_seqs
    config = EngineConfig(block_size=block_size, num_blocks=num_blocks, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_len,
                          enable_prefix_caching=False, record_trace=False)
    inner = make_scheduler(scheduler_cls, allocator_cls(num_blocks, block_size), block_table_cls, config)
    if s.reservation is None:
        return inner
    return ReservingScheduler(inner, s.reservation, kv_tokens, max_len, static=s.static)


def run(sched: Any, requests: Seq[tuple[int, int]], arrivals: Seq[float], cost: StepCostModel,
        system: str = "?", rate: float = 0.0, progress: Callable[[int], None] | None = None,
        keep_batches: bool = False) -> SimResult:
    """Serve ``requests`` ((prompt_len, output_len) pairs) arriving at ``arrivals`` (seconds,
    sorted) through ``sched`` on the simulated clock of ``cost``. ``progress(k)`` is called
    with the number of requests that finished since the last call."""
    n = len(requests)
    if len(arrivals) != n:
        raise ValueError(f"got {len(arrivals)} arrival times for {n} requests")
    seqs = [Sequence(i, [0] * p, max_tokens=o, ignore_eos=True) for i, (p, o) in enumerate(requests)]
    finish = [0.0] * n
    t, k, steps, done, preempt = 0.0, 0, 0, 0, 0
    rejected = 0
    last_arrival = arrivals[-1] if n else 0.0
    batch_sum = batch_steps = 0
    batches: list[int] = []
    step_time = cost.step_time
    while k < n or sched.has_unfinished():
        if k < n and not sched.has_unfinished() and arrivals[k] > t:
            t = arrivals[k]  # idle: jump to the next arrival
        while k < n and arrivals[k] <= t:
            if not sched.add_request(seqs[k]):
                rejected += 1
                finish[k] = float("nan")
            k += 1
        out = sched.schedule()
        if out.is_empty:
            if k < n:
                t = arrivals[k]
                continue
            raise RuntimeError(f"the scheduler runs nothing although {len(sched.waiting)} request(s) wait: "
                               "check its admission rule")
        sched_list = out.scheduled
        t += step_time([(s.start, s.num_new_tokens) for s in sched_list])
        finished = sched.update(out, {s.seq.seq_id: 1 for s in sched_list if s.samples})
        preempt += len(out.preempted)
        for seq in finished:
            finish[seq.seq_id] = t
        if finished and progress is not None:
            progress(len(finished))
        done += len(finished)
        steps += 1
        if t <= last_arrival:
            batch_sum += len(sched_list)
            batch_steps += 1
        if keep_batches:
            batches.append(len(sched_list))
    served = [i for i in range(n) if finish[i] == finish[i]]
    lat = [finish[i] - arrivals[i] for i in served]
    norm = [(finish[i] - arrivals[i]) / requests[i][1] for i in served]
    out_tokens = sum(requests[i][1] for i in served)
    duration = t - (arrivals[0] if n else 0.0)
    return SimResult(system, rate, n, sum(norm) / max(1, len(norm)), sum(lat) / max(1, len(lat)),
                     batch_sum / batch_steps if batch_steps else 0.0, out_tokens / duration if duration > 0 else 0.0,
                     steps, preempt, duration, rejected, batches)
