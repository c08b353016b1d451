"""Simulated runs: the real Scheduler driven by a fake model, and static batching played on paper.

Owns request-length sampling and the two simulators that produce a :class:`minipaged.trace.Trace`
without a model (for pictures, widgets and workbook checks): :func:`simulate` records the steps of
the one scheduler-on-a-clock loop (``minipaged.bench.clock``), :func:`simulate_static` plays static
batching on paper. It measures nothing: timings here are step units or a given ``step_time``; the
measured systems are in ``minipaged.bench.baselines``.
"""
from __future__ import annotations

import math
import random
from typing import Any, Callable, Sequence as Seq

from .. import parts
from ..block_allocator import BlockAllocator
from ..block_table import BlockTable
from ..scheduler import Scheduler
from ..config import EngineConfig
from ..trace import StepRecord, Trace, is_prefill
from .clock import run_clock, unit_steps

StepTime = Callable[[int, int], float]  # (prefill tokens, decode tokens) of a step -> its seconds


def make_scheduler(scheduler_cls: type, allocator: Any, block_table_cls: type, config: EngineConfig) -> Any:
    """``scheduler_cls(allocator, block_table_cls, config)``: the constructor the contract fixes
    (minipaged.interfaces), so a simulation and the engine build a scheduler the same way."""
    return scheduler_cls(allocator, block_table_cls, config)


def sample_requests(
    n: int,
    seed: int = 0,
    prompt_len: tuple[int, int] = (8, 64),
    output_median: int = 24,
    output_max: int = 256,
    sigma: float = 1.0,
) -> list[tuple[int, int]]:
    """``n`` (prompt_len, output_len) pairs: prompts uniform, outputs log-normal (a long tail).

    Real chat traffic looks like this: most answers are short, a few are very long, and a
    contiguous cache has to reserve for the longest.
    """
    rng = random.Random(seed)
    lo, hi = prompt_len
    return [
        (rng.randint(lo, hi), max(1, min(output_max, int(round(rng.lognormvariate(math.log(output_median), sigma))))))
        for _ in range(n)
    ]


def simulate(
    requests: Seq[tuple[int, int]],
    num_blocks: int,
    block_size: int = 16,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 256,
    arrivals: Seq[int] | None = None,
    seed: int = 0,
    enable_chunked_prefill: bool = True,
    step_time: StepTime | None = None,
    vocab_size: int = 1000,
    check_invariants: bool = False,
    allocator_cls: type = BlockAllocator,
    block_table_cls: type = BlockTable,
    scheduler_cls: type = Scheduler,
    max_steps: int | None = None,
) -> Trace:
    """Run the real Scheduler on ``requests`` (list of (prompt_len, output_len)) with a fake model.

    The fake model samples random token ids and EOS is ignored, so every request produces
    exactly ``output_len`` tokens. Time is one unit per step unless ``step_time`` says otherwise;
    ``arrivals[i]`` is when request ``i`` arrives on that clock (default: all at 0), so in steps
    by default. While nothing can run the engine keeps stepping, and those empty steps are
    recorded too. Request ``i`` gets seq_id ``i``; requests that can never fit are in
    ``trace.rejected``.
    """
    n = len(requests)
    arrivals = [0] * n if arrivals is None else list(arrivals)
    if len(arrivals) != n:
        raise ValueError(f"got {len(arrivals)} arrival steps for {n} requests: give one per request")
    rng = random.Random(seed)
    alloc = allocator_cls(num_blocks, block_size)
    config = EngineConfig(block_size=block_size, num_blocks=num_blocks, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=max_num_batched_tokens, enable_chunked_prefill=enable_chunked_prefill)
    sched = make_scheduler(scheduler_cls, alloc, block_table_cls, config)
    trace = Trace(kind="paged")
    trace.meta.update(requests=[tuple(r) for r in requests], arrivals=arrivals, max_num_seqs=max_num_seqs,
                      max_num_batched_tokens=max_num_batched_tokens, time_unit="s" if step_time else "steps")
    if max_steps is None:
        max_steps = 10 * (sum(p + o for p, o in requests) + max(arrivals, default=0) + 10)

    def on_step(out: Any, finished: list, t: float) -> None:
        if check_invariants:
            parts.check_scheduler(sched, max_num_seqs)
        trace.record(sched, out, t)

    run = run_clock(sched, requests, arrivals, _two_part(step_time) if step_time else unit_steps,
                    tokens=lambda k: [rng.randrange(vocab_size) for _ in range(k)], idle_steps=True, on_step=on_step,
                    max_steps=max_steps)
    trace.rejected.extend(run.rejected)
    return trace


def _two_part(step_time: StepTime) -> Callable[[Seq[Any]], float]:
    """``step_time(prefill_tokens, decode_tokens)`` as the clock's step cost."""
    def cost(scheduled: Seq[Any]) -> float:
        pf = sum(s.num_new_tokens for s in scheduled if is_prefill(s))
        return step_time(pf, sum(s.num_new_tokens for s in scheduled) - pf)
    return cost


def simulate_static(
    requests: Seq[tuple[int, int]],
    batch_size: int,
    max_len: int | None = None,
    step_time: StepTime | None = None,
) -> Trace:
    """Static batching on a contiguous cache: the baseline continuous batching is measured against.

    Requests go in fixed batches of ``batch_size`` in order. Prompts are padded to the batch's
    longest; the batch runs until its longest output is done, and only then does the next batch
    start. Every request's slot reserves ``max_len`` KV slots (default: the most any request
    needs, prompt + output - 1) for the whole batch. Time is one unit per step unless
    ``step_time`` says otherwise; a step is one forward pass of the whole padded batch.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    reqs = [tuple(r) for r in requests]
    batches = [list(range(i, min(i + batch_size, len(reqs)))) for i in range(0, len(reqs), batch_size)]
    need = max((max(reqs[j][0] for j in b) + max(reqs[j][1] for j in b) - 1 for b in batches), default=1)
    max_len = need if max_len is None else max_len
    if need > max_len:
        raise ValueError(f"a padded batch needs {need} KV slots per request but max_len={max_len}: raise max_len")
    trace = Trace(kind="static")
    trace.max_len = max_len
    trace.meta.update(requests=reqs, batch_size=batch_size, time_unit="s" if step_time else "steps")
    t, step = 0.0, 0
    for bi, batch in enumerate(batches):
        p_max = max(reqs[j][0] for j in batch)
        n_steps = max(reqs[j][1] for j in batch)
        waiting = tuple(j for later in batches[bi + 1:] for j in later)
        slots = {j: s for s, j in enumerate(batch)}
        t_batch = t
        for k in range(n_steps):
            prefill = len(batch) * p_max if k == 0 else 0
            decode = 0 if k == 0 else len(batch)  # finished rows still compute (padding)
            t += step_time(prefill, decode) if step_time else 1.0
            trace.steps.append(StepRecord(
                step=step, time=t, running=tuple(batch), waiting=waiting, batch=tuple(batch),
                prefill_tokens=prefill, decode_tokens=decode,
                sampled_tokens=sum(1 for j in batch if k < reqs[j][1]), preemptions=0,
                reserved_slots=len(batch) * max_len,
                used_slots=sum(min(reqs[j][0] + k, reqs[j][0] + reqs[j][1] - 1) for j in batch),
                slots=slots,
            ))
            step += 1
        for s, j in enumerate(batch):
            o = reqs[j][1]
            trace._closed.append({
                "request": j, "slot": s, "start": step - n_steps, "end": step, "start_time": t_batch, "end_time": t,
                "finish": step - n_steps + o, "finish_time": trace.steps[step - n_steps + o - 1].time, "outcome": "length",
            })
    return trace
