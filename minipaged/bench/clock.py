"""The scheduler on a clock: requests arrive at their times, the real scheduler and block pool
decide every step, a step-cost function prices it, and the clock moves on. No model runs.

Owns the one event loop every simulation in ``minipaged.bench`` runs (:func:`run_clock`): the
simulated GPU (``gpu/simulator.py``: the paper's figures, the CPU validation in
``gpu/validate.py``), the lessons' replays (``serving.simulate_online``, lessons 06 and 09), the
traces the pictures draw (``simulate.simulate``) and ``minipaged bench disagg``'s GPUs
(``disagg.simulate``, with a scheduler of its own, ``disagg.OneGPU``). Each of those is a thin
caller: it builds the parts, picks a cost, and reads what it needs from the :class:`ClockRun`.
Also owns the arrivals (:func:`poisson_arrivals`) and the two small contracts a caller prices a
run with:

* a **step cost** (:class:`StepSeconds`): ``cost(scheduled) -> seconds``, given the step's
  scheduled records (``minipaged.data.ScheduledSeq``: ``start``, ``num_new_tokens``,
  ``is_prefill``, ``samples``; read, never changed), before the scheduler's ``update``. It is
  charged to the clock once per step. A cost that can also price a run of identical decode
  steps from totals (:class:`DecodeTotals`) lets the loop skip ahead over them;
* a **request overhead** (:class:`RequestSeconds`, the ``arrival_overhead`` argument):
  ``overhead(prompt_len, output_len) -> seconds``, charged once per request, where it happens:
  between the request's arrival and the scheduler's seeing it (an API server's HTTP parsing and
  tokenizing, done beside the engine's steps, not in them). Time to first token and latency are
  still counted from the arrival, so they include it; the engine's steps do not pay it. A cost
  that stalls the engine's steps instead (a front end sharing the engine's thread) belongs in
  the step cost.

The sequences are the scheduler's own ``Sequence`` objects (request ``i`` has ``seq_id`` ``i``)
with EOS ignored, so each produces exactly its output length (:class:`LengthStop`); their token
ids come from ``tokens`` (zeros by default: only a prefix cache reads them).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence as Seq

import numpy as np

from ..data import ScheduledSeq
from ..sequence import FinishReason, Sequence

NAN = float("nan")


# -- arrivals ------------------------------------------------------------------------------------
def poisson_arrivals(n: int, rate: float, seed: int = 0) -> list[float]:
    """``n`` arrival times (s) of a Poisson process of ``rate`` requests per second, the first
    at 0: exponential gaps (independent users), seeded. The one arrival process of the bench's
    online sweep, ``minipaged bench serve``, the lessons' replays, the simulated GPU and ``bench disagg``."""
    if not rate > 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate}")
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, n)
    return [0.0, *np.cumsum(gaps[1:]).tolist()][:n]


# -- the contracts -------------------------------------------------------------------------------
class StepSeconds(Protocol):
    """What one step costs on the clock: ``cost(scheduled) -> seconds`` (>= 0), from the step's
    scheduled records, read before the scheduler's ``update``."""

    def __call__(self, scheduled: Seq[ScheduledSeq]) -> float: ...


class DecodeTotals(StepSeconds, Protocol):
    """A step cost that can also price a decode-only step from totals: ``num_seqs`` sequences,
    one token each, whose contexts (the keys each reads, its new one too) sum to
    ``context_tokens``. It must equal the step cost of such a step; ``skip_ahead`` needs it."""

    def decode_totals_time(self, num_seqs: int, context_tokens: int) -> float: ...


class RequestSeconds(Protocol):
    """The once-per-request overhead before the scheduler sees a request (see the module)."""

    def __call__(self, prompt_len: int, output_len: int) -> float: ...


def unit_steps(scheduled: Seq[ScheduledSeq]) -> float:
    """Every step one unit of time, whatever it computes: a clock that counts steps."""
    return 1.0


@dataclass(frozen=True)
class LinearStepCost:
    """A step's seconds as ``fixed + per_seat * sequences in the step + per_prefill_token *
    prompt tokens in the step`` (prompt chunks and recomputation: every record that is not a
    decode): the three numbers a lesson fits to the steps it timed (lesson 06)."""

    fixed_s: float
    per_seat_s: float
    per_prefill_token_s: float

    @property
    def params(self) -> tuple[float, float, float]:
        return self.fixed_s, self.per_seat_s, self.per_prefill_token_s

    def __call__(self, scheduled: Seq[ScheduledSeq]) -> float:
        prefill = sum(s.num_new_tokens for s in scheduled if s.is_prefill)
        return self.fixed_s + self.per_seat_s * len(scheduled) + self.per_prefill_token_s * prefill


# -- the simulated requests ----------------------------------------------------------------------
class LengthStop:
    """The simulation's stop rule, attached to each of its sequences (a scheduler keeps a stop
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

    def advance(self, k: int, token_id: int = 0) -> None:
        """``k`` tokens sampled without finishing (``k < remaining``), added to the sequence too."""
        if not 0 <= k < self.remaining:
            raise ValueError(f"cannot advance {k} tokens with {self.remaining} left before the end")
        self.num_output_tokens += k
        self.seq.output_token_ids.extend([token_id] * k)


class StaticBatching:
    """Request-level (static) batching around any scheduler: requests queue here, and up to
    ``max_batch`` of them (FCFS) are handed to ``inner`` only when it has nothing left to run.
    ``add_request`` always queues; a request ``inner`` refuses later is in ``rejected``."""

    def __init__(self, inner: Any, max_batch: int) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.inner, self.max_batch, self.held, self.rejected = inner, max_batch, [], []

    @property
    def waiting(self) -> list:
        return self.held + list(self.inner.waiting)

    @property
    def running(self) -> list:
        return self.inner.running

    def add_request(self, seq: Sequence) -> bool:
        self.held.append(seq)
        return True

    def has_unfinished(self) -> bool:
        return bool(self.held) or self.inner.has_unfinished()

    def schedule(self) -> Any:
        if self.held and not self.inner.has_unfinished():
            batch, self.held = self.held[:self.max_batch], self.held[self.max_batch:]
            self.rejected += [seq for seq in batch if not self.inner.add_request(seq)]
        return self.inner.schedule()

    def update(self, out: Any, sampled: dict) -> list:
        return self.inner.update(out, sampled)


def _request_of(seq: Sequence) -> int:
    """The request a simulated sequence serves: ``seq.request`` when it has one (a fork, a beam, one
    of several copies), else its ``seq_id``."""
    return getattr(seq, "request", seq.seq_id)


def _inner_attr(sched: Any, name: str) -> Any:
    """``sched.name``, looked for through wrappers (``inner``) down to the scheduler."""
    while not hasattr(sched, name) and hasattr(sched, "inner"):
        sched = sched.inner
    return getattr(sched, name, None)


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


# -- the loop -------------------------------------------------------------------------------------
@dataclass
class ClockRun:
    """What a run on the clock did. Per request ``i`` (in the caller's order): ``arrival``,
    ``admitted`` (when the scheduler got it: the arrival plus its overhead), ``first_token`` and
    ``finish`` (the clock after the step that sampled its first and last token; NaN when it was
    rejected), ``computed_tokens`` (KV computed, recomputation after a preemption included) and,
    when kept, ``token_times`` (the clock at each of its tokens). Per step: ``batch_sizes``
    (sequences in it) and ``step_ends`` (the clock after it). ``rejected``: ``(i, reason)`` in
    the order the requests were refused."""

    arrival: list
    admitted: list
    first_token: list
    finish: list
    computed_tokens: list
    rejected: list = field(default_factory=list)
    batch_sizes: list = field(default_factory=list)
    step_ends: list = field(default_factory=list)
    num_preemptions: int = 0
    token_times: dict | None = None
    end: float = 0.0  # the clock when the last request finished

    @property
    def num_steps(self) -> int:
        return len(self.batch_sizes)

    @property
    def served(self) -> list[int]:
        """The requests that finished (not rejected), in order."""
        return [i for i, f in enumerate(self.finish) if not math.isnan(f)]


def run_clock(sched: Any, requests: Seq[tuple[int, int]], arrivals: Seq[float], cost: StepSeconds, *,
              arrival_overhead: RequestSeconds | float | None = None, tokens: Callable[[int], list] | None = None,
              idle_steps: bool = False, skip_ahead: bool = False, keep_token_times: bool = False,
              on_step: Callable[[Any, list, float], None] | None = None, max_steps: int | None = None,
              make_request: Callable[[int, int, int], Any] | None = None,
              after_update: Callable[[Any, list], list] | None = None) -> ClockRun:
    """Serve ``requests`` (``(prompt_len, output_len)`` pairs, EOS ignored) arriving at
    ``arrivals`` (on the clock: seconds, or steps under :func:`unit_steps`) through ``sched``
    (minipaged's ``Scheduler`` over its block pool, or any parts meeting the contracts, or a
    wrapper such as :class:`StaticBatching`), each step priced by ``cost``.

    * ``arrival_overhead``: seconds between a request's arrival and the scheduler's seeing it
      (a :class:`RequestSeconds`, or one number for every request; see the module);
    * ``tokens(k)``: ``k`` token ids for the fake model's prompts and samples (default zeros);
    * ``idle_steps``: while nothing can run, the engine keeps stepping (each empty step priced
      and observed, as a trace shows it); False: the clock jumps to the next arrival;
    * ``on_step(out, finished, t)``: called after each step the scheduler scheduled, with its
      output, the sequences it finished and the clock after it (not for skipped steps);
    * ``skip_ahead``: after a step that only decoded (every running sequence got one token, none
      was admitted, preempted or finished), the steps that follow are the same step again, one
      token further on, for as long as no sequence finishes, the pool does not run dry, and no
      request arrives that could be admitted (one that arrives behind a blocked queue is queued
      at its time, as a step would). Those steps are taken here without calling ``schedule``
      and ``update``: each is priced by ``cost.decode_totals_time`` (:class:`DecodeTotals`), and
      the sequences, their stop rules and block tables are moved on together at the end. The
      results equal the step-by-step run's (tests/test_simgpu.py checks it);
    * ``max_steps``: raise when the run has not finished by then (a stuck request);
    * ``make_request(i, prompt_len, output_len)``: the sequence(s) request ``i`` is served as
      (one ``Sequence`` or a list; default one ``Sequence`` with ``seq_id`` ``i`` and zeros). A
      sequence whose ``seq_id`` is not ``i`` names its request in ``seq.request``; with several
      sequences, or forks (parallel sampling: ``seq.forks``), the request's first token is its
      first sequence's and it finishes with its last. Each needs a stop rule (:class:`LengthStop`);
    * ``after_update(out, finished)``: called after each step's ``update`` (a caller's rule that
      changes the sequences, e.g. beam search forking and dropping beams); returns the sequences
      it finished. Needs ``skip_ahead=False``.
    """
    n = len(requests)
    if len(arrivals) != n:
        raise ValueError(f"got {len(arrivals)} arrival times for {n} requests: give one per request")
    if skip_ahead and after_update is not None:
        raise ValueError("skip_ahead takes steps without the scheduler, and after_update changes the sequences "
                         "every step: run with skip_ahead=False")
    if skip_ahead and on_step is not None:
        raise ValueError("skip_ahead takes steps without the scheduler, which on_step cannot observe: choose one")
    if skip_ahead and not hasattr(cost, "decode_totals_time"):
        raise ValueError("skip_ahead prices runs of decode steps from totals: the cost needs decode_totals_time "
                         "(DecodeTotals), or run with skip_ahead=False")
    tokens = tokens or (lambda k: [0] * k)
    if arrival_overhead is None:
        admitted = [float(a) for a in arrivals]
    elif callable(arrival_overhead):
        admitted = [a + arrival_overhead(p, o) for a, (p, o) in zip(arrivals, requests)]
    else:
        admitted = [a + float(arrival_overhead) for a in arrivals]
    order = sorted(range(n), key=lambda i: (admitted[i], i))
    ready = [admitted[i] for i in order]
    run = ClockRun(list(arrivals), admitted, [NAN] * n, [NAN] * n, [0] * n,
                   token_times={i: [] for i in range(n)} if keep_token_times else None)
    first, finish, computed, times = run.first_token, run.finish, run.computed_tokens, run.token_times
    batches, ends = run.batch_sizes, run.step_ends
    max_len = _inner_attr(sched, "max_model_len")
    allocator = _inner_attr(sched, "allocator") if skip_ahead else None

    def admit_until(t: float, k: int) -> int:
        while k < n and ready[k] <= t:
            i = order[k]
            p, o = requests[i]
            if make_request is None:
                seq = Sequence(i, tokens(p), max_tokens=o, ignore_eos=True)
                seq.stop_checker = LengthStop(seq, max_len)
                seqs = [seq]
            else:
                made = make_request(i, p, o)
                seqs = list(made) if isinstance(made, (list, tuple)) else [made]
            for seq in seqs:
                if not sched.add_request(seq):
                    run.rejected.append((i, seq.reject_reason))
                    break
            k += 1
        return k

    t, k = 0.0, 0
    while k < n or sched.has_unfinished():
        if not idle_steps and k < n and not sched.has_unfinished() and ready[k] > t:
            t = ready[k]  # idle: jump to the next arrival
        k = admit_until(t, k)
        out = sched.schedule()
        scheduled = out.scheduled
        if not scheduled:
            if not idle_steps and k < n:
                t = ready[k]
                continue
            if not idle_steps or (not sched.running and sched.waiting and k == n):
                raise RuntimeError(f"the scheduler runs nothing although {len(sched.waiting)} request(s) wait and "
                                   "nothing runs: check its admission rule")
        t += cost(scheduled)
        samplers = [q for s in scheduled if s.samples for q in (s.seq, *s.seq.forks)]
        ids = [q.seq_id for q in samplers]
        finished = sched.update(out, dict(zip(ids, tokens(len(ids)))))
        if after_update is not None:
            finished = list(finished) + list(after_update(out, finished))
        for s in scheduled:
            computed[_request_of(s.seq)] += s.num_new_tokens
        for i in dict.fromkeys(_request_of(q) for q in samplers):
            if first[i] != first[i]:
                first[i] = t
            if times is not None:
                times[i].append(t)
        for seq in finished:
            finish[_request_of(seq)] = t
        run.num_preemptions += len(out.preempted)
        m = len(scheduled)
        batches.append(m)
        ends.append(t)
        if on_step is not None:
            on_step(out, finished, t)
        if max_steps is not None and len(batches) >= max_steps:
            raise RuntimeError(f"simulation did not finish in {max_steps} steps: is a request stuck?")
        if not skip_ahead or finished or out.preempted:
            continue
        running = sched.running
        if len(running) != m or any(s.is_prefill for s in scheduled):
            continue  # not a pure decode step: something was admitted, or a prefill goes on
        # -- skip ahead: the same decode step again, as long as nothing else can happen --------
        window = _decode_window(running, allocator.num_free_blocks)
        if window <= 0:
            continue
        queue_blocked = bool(sched.waiting)  # the last step admitted none of them: nor will the next
        ctx = sum(s.num_computed_tokens for s in running) + m  # each reads start + 1 keys
        j = 0
        while j < window:
            if k < n and ready[k] <= t:
                if not queue_blocked:
                    break  # it could be admitted: the next step is the scheduler's
                k = admit_until(t, k)  # queued behind the blocked head, as a step would
            t += cost.decode_totals_time(m, ctx)
            ctx += m
            j += 1
            batches.append(m)
            ends.append(t)
            if times is not None:
                for i in dict.fromkeys(_request_of(s) for s in running):
                    times[i].append(t)
        if j:
            for s in running:
                s.block_table.append_tokens(j)
                s.num_computed_tokens += j
                s.stop_checker.advance(j)
                computed[_request_of(s)] += j
    run.end = t
    return run


__all__ = ["poisson_arrivals", "StepSeconds", "DecodeTotals", "RequestSeconds", "unit_steps", "LinearStepCost",
           "LengthStop", "StaticBatching", "ClockRun", "run_clock"]
