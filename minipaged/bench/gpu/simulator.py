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
from ...sequence import FinishReason, Sequence
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
    finish_times: list = field(default_factory=list, repr=False)  # per request, s (NaN: rejected)

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d.pop("batch_sizes")
        d.pop("finish_times")
        return d


def build_scheduler(system: str | System, kv_tokens: int, block_size: int = 16, max_len: int = 2048,
                    max_num_seqs: int = MAX_NUM_SEQS, max_num_batched_tokens: int = MAX_NUM_BATCHED_TOKENS,
                    allocator_cls: type = BlockAllocator, block_table_cls: type = BlockTable,
                    scheduler_cls: type = Scheduler, placement: str | None = "buddy",
                    max_batch: int | None = None) -> Any:
    """The parts for ``system`` over a KV cache of ``kv_tokens`` token slots.

    vLLM: the scheduler over a pool of ``kv_tokens // block_size`` blocks. A baseline: the same
    scheduler over that pool plus one spare block per sequence (so block rounding never binds),
    wrapped in a :class:`ReservingScheduler` holding ``kv_tokens`` of reservations, placed by
    ``placement`` (``buddy``: the paper's assumption for Orca; ``first_fit``; None: anywhere);
    ``max_batch``: the most requests a static batch takes at once (None: as many as fit).
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
    return ReservingScheduler(inner, s.reservation, kv_tokens, max_len, static=s.static, max_batch=max_batch,
                              placement=placement)


class LengthStop:
    """The simulator's stop rule, attached to each of its sequences (a scheduler keeps a stop
    checker it finds): EOS never comes, so a request stops after its output length, or when it
    reaches the model's context (``max_model_len``), the same two rules and the same order as
    :class:`minipaged.detokenizer.StopChecker` with ``ignore_eos``. It also says how many
    tokens are left, and advances several at once for the skip-ahead."""

    __slots__ = ("seq", "limit", "num_output_tokens", "finish_reason")

    def __init__(self, seq: Sequence, max_model_len: int | None = None) -> None:
        self.seq, self.num_output_tokens, self.finish_reason = seq, 0, None
        self.limit = seq.max_tokens
        if max_model_len is not None:
            self.limit = min(self.limit, max(1, max_model_len - seq.num_prompt_tokens))

    def append(self, token_id: int) -> tuple:
        if self.finish_reason is not None:
            raise RuntimeError("a token was appended to a finished request")
        self.num_output_tokens += 1
        if self.num_output_tokens >= self.limit:
            self.finish_reason = FinishReason.LENGTH
        return self.finish_reason, ""

    @property
    def remaining(self) -> int:
        """Tokens still to sample; the last of them finishes the request."""
        return self.limit - self.num_output_tokens

    def advance(self, k: int, token_id: int = 1) -> None:
        """``k`` tokens sampled without finishing (``k < remaining``), added to the sequence too."""
        if not 0 <= k < self.remaining:
            raise ValueError(f"cannot advance {k} tokens with {self.remaining} left before the end")
        self.num_output_tokens += k
        self.seq.output_token_ids.extend([token_id] * k)


def _allocator_of(sched: Any) -> Any:
    """The block pool under ``sched`` (a scheduler, or a wrapper with ``inner``)."""
    while not hasattr(sched, "allocator") and hasattr(sched, "inner"):
        sched = sched.inner
    return sched.allocator


def _max_len_of(sched: Any) -> int | None:
    while not hasattr(sched, "max_model_len") and hasattr(sched, "inner"):
        sched = sched.inner
    return getattr(sched, "max_model_len", None)


def _decode_window(running: list, free_blocks: int) -> int:
    """How many decode-only steps the running sequences can take with none finishing and no
    block pool running dry: the most ``k`` with every ``remaining > k`` and the blocks that
    ``k`` more tokens need, summed over the sequences, within ``free_blocks``."""
    k = min(s.stop_checker.remaining for s in running) - 1
    if k <= 0:
        return 0

    def need(j: int) -> int:
        return sum(s.block_table.blocks_needed(j) for s in running)

    if need(k) <= free_blocks:
        return k
    lo, hi = 0, k  # need(lo) <= free < need(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if need(mid) <= free_blocks:
            lo = mid
        else:
            hi = mid
    return lo


def run(sched: Any, requests: Seq[tuple[int, int]], arrivals: Seq[float], cost: StepCostModel,
        system: str = "?", rate: float = 0.0, progress: Callable[[int], None] | None = None,
        keep_batches: bool = False, skip_ahead: bool = True) -> SimResult:
    """Serve ``requests`` ((prompt_len, output_len) pairs) arriving at ``arrivals`` (seconds,
    sorted) through ``sched`` on the simulated clock of ``cost``. ``progress(k)`` is called
    with the number of requests that finished since the last call.

    ``skip_ahead``: after a step that only decoded (every running sequence got one token; none
    was admitted, preempted or finished), the steps that follow are the same step again, one
    token further on, for as long as no sequence finishes, the pool does not run dry, and no
    request arrives that could be admitted (one that arrives behind a blocked queue is queued
    at its time, as a step would). Those steps are taken here without calling ``schedule`` and
    ``update``: each is timed by the cost model from the same totals, and the sequences, their
    stop rules and block tables are moved on together at the end. The results equal the
    step-by-step run's (tests/test_simgpu.py checks it); ``skip_ahead=False`` runs every step
    through the scheduler.
    """
    n = len(requests)
    if len(arrivals) != n:
        raise ValueError(f"got {len(arrivals)} arrival times for {n} requests")
    if skip_ahead and getattr(cost, "attention_profile", None) is not None:
        raise ValueError("skip_ahead prices decode steps from totals, which a measured attention profile cannot: "
                         "run with skip_ahead=False")
    max_len = _max_len_of(sched)
    seqs = [Sequence(i, [0] * p, max_tokens=o, ignore_eos=True) for i, (p, o) in enumerate(requests)]
    for s in seqs:
        s.stop_checker = LengthStop(s, max_len)
    finish = [0.0] * n
    t, k, steps, done, preempt = 0.0, 0, 0, 0, 0
    rejected = 0
    last_arrival = arrivals[-1] if n else 0.0
    batch_sum = batch_steps = 0
    batches: list[int] = []
    step_time = cost.step_time
    decode_time = cost.decode_totals_time
    allocator = _allocator_of(sched) if skip_ahead else None
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
        m = len(sched_list)
        if t <= last_arrival:
            batch_sum += m
            batch_steps += 1
        if keep_batches:
            batches.append(m)
        if not skip_ahead or finished or out.preempted:
            continue
        running = sched.running
        if len(running) != m or any(s.is_prefill for s in sched_list):
            continue  # not a pure decode step: something was admitted, or a prefill goes on
        # -- skip ahead: the same decode step again, as long as nothing else can happen --------
        window = _decode_window(running, allocator.num_free_blocks)
        if window <= 0:
            continue
        queue_blocked = bool(sched.waiting)  # the last step admitted none of them: nor will the next
        ctx = sum(s.num_computed_tokens for s in running) + m  # each reads start + 1 keys
        j = 0
        while j < window:
            if k < n and arrivals[k] <= t:
                if not queue_blocked:
                    break  # it could be admitted: the next step is the scheduler's
                while k < n and arrivals[k] <= t:  # queued behind the blocked head, as a step would
                    if not sched.add_request(seqs[k]):
                        rejected += 1
                        finish[k] = float("nan")
                    k += 1
            t += decode_time(m, ctx)
            ctx += m
            j += 1
            steps += 1
            if t <= last_arrival:
                batch_sum += m
                batch_steps += 1
            if keep_batches:
                batches.append(m)
        if j:
            for s in running:
                s.block_table.append_tokens(j)
                s.num_computed_tokens += j
                s.stop_checker.advance(j)
    served = [i for i in range(n) if finish[i] == finish[i]]
    lat = [finish[i] - arrivals[i] for i in served]
    norm = [(finish[i] - arrivals[i]) / requests[i][1] for i in served]
    out_tokens = sum(requests[i][1] for i in served)
    duration = t - (arrivals[0] if n else 0.0)
    return SimResult(system, rate, n, sum(norm) / max(1, len(norm)), sum(lat) / max(1, len(lat)),
                     batch_sum / batch_steps if batch_steps else 0.0, out_tokens / duration if duration > 0 else 0.0,
                     steps, preempt, duration, rejected, batches, finish)
