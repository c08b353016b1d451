"""The one scheduler-on-a-clock loop (minipaged.bench.clock): its contracts, on tiny runs worked by hand."""
from __future__ import annotations

import math

import pytest

from minipaged.bench.clock import LinearStepCost, StaticBatching, poisson_arrivals, run_clock, unit_steps
from minipaged.bench.serving import online_summary, simulate_online, step_cost
from minipaged.bench.simulate import simulate
from minipaged.block_allocator import BlockAllocator
from minipaged.config import EngineConfig
from minipaged.scheduler import Scheduler


def _sched(num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 8) -> Scheduler:
    config = EngineConfig(block_size=block_size, num_blocks=num_blocks, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=64)
    return Scheduler(BlockAllocator(num_blocks, block_size), config=config)


def test_a_lone_request_by_hand():
    # prompt 4, 3 tokens out, 0.1 s a step: prefill (+ 1st token) at 1.1, then 1.2, 1.3
    r = run_clock(_sched(), [(4, 3)], [1.0], LinearStepCost(0.1, 0.0, 0.0), keep_token_times=True)
    assert r.first_token == [pytest.approx(1.1)] and r.finish == [pytest.approx(1.3)]
    assert r.token_times[0] == pytest.approx([1.1, 1.2, 1.3]) and r.batch_sizes == [1, 1, 1]
    assert r.computed_tokens == [4 + 2] and r.admitted == [1.0] and not r.rejected


def test_the_arrival_overhead_is_charged_once_per_request_before_the_scheduler_not_per_step():
    reqs, arr = [(8, 5)] * 6, [0.0] * 6
    cost = LinearStepCost(0.02, 0.005, 0.001)
    base = run_clock(_sched(), reqs, arr, cost)
    late = run_clock(_sched(), reqs, arr, cost, arrival_overhead=0.25)
    # every request reaches the scheduler 0.25 s later; the steps and their prices are the same
    assert late.admitted == [0.25] * 6 and late.batch_sizes == base.batch_sizes
    assert late.finish == pytest.approx([f + 0.25 for f in base.finish])
    # a function of the request's lengths: here only the long prompt pays, and waits for it
    per_prompt = run_clock(_sched(), [(8, 5), (40, 5)], [0.0, 0.0], cost, arrival_overhead=lambda p, o: 0.001 * p)
    assert per_prompt.admitted == pytest.approx([0.008, 0.04])
    # the replay's summary counts TTFT from the arrival, so the overhead is in it
    sims = [simulate_online(reqs, arr, cost, num_blocks=64, block_size=4, arrival_overhead=x) for x in (None, 0.25)]
    slo = {"ttft_s": 1.0, "tpot_s": 1.0}
    a, b = (online_summary(s, reqs, 1.0, slo) for s in sims)
    assert b["ttft_p50_s"] == pytest.approx(a["ttft_p50_s"] + 0.25) and b["tpot_p50_s"] == pytest.approx(a["tpot_p50_s"])


def test_static_batching_hands_over_a_batch_only_when_the_last_has_drained():
    r = run_clock(StaticBatching(_sched(), max_batch=2), [(4, 2), (4, 6), (4, 2)], [0.0, 0.0, 0.0], unit_steps)
    # requests 0 and 1 run together; 2 waits for 1's last token although 0 left a seat after step 2
    assert r.finish[:2] == [2.0, 6.0] and r.first_token[2] == 7.0 and r.batch_sizes == [2, 2, 1, 1, 1, 1, 1, 1]
    cont = run_clock(_sched(), [(4, 2), (4, 6), (4, 2)], [0.0, 0.0, 0.0], unit_steps)
    assert cont.first_token[2] == 1.0  # continuous batching takes it in at once


def test_idle_steps_are_taken_or_jumped():
    jump = run_clock(_sched(), [(4, 2), (4, 2)], [0.0, 10.0], unit_steps)
    tick = run_clock(_sched(), [(4, 2), (4, 2)], [0.0, 10.0], unit_steps, idle_steps=True)
    assert jump.finish == tick.finish == [2.0, 12.0]
    assert jump.num_steps == 4 and tick.num_steps == 12 and tick.batch_sizes[2:10] == [0] * 8


def test_a_request_that_can_never_fit_is_rejected_and_the_rest_are_served():
    r = run_clock(_sched(num_blocks=4), [(4, 2), (100, 2)], [0.0, 0.0], unit_steps)
    assert [i for i, _ in r.rejected] == [1] and "block" in r.rejected[0][1]
    assert math.isnan(r.finish[1]) and r.served == [0]
    with pytest.raises(ValueError, match="can never fit"):
        simulate_online([(4, 2), (100, 2)], [0.0, 0.0], step_cost(1.0, 0.0, 0.0), num_blocks=4, block_size=4)


def test_the_loop_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="decode_totals_time"):
        run_clock(_sched(), [(4, 2)], [0.0], unit_steps, skip_ahead=True)
    with pytest.raises(ValueError, match="on_step"):
        run_clock(_sched(), [(4, 2)], [0.0], unit_steps, skip_ahead=True, on_step=lambda *a: None)
    with pytest.raises(ValueError, match="arrival"):
        run_clock(_sched(), [(4, 2)], [0.0, 1.0], unit_steps)


def test_the_replay_and_the_trace_serve_alike_on_the_same_clock():
    reqs = [(9, 4), (3, 7), (20, 2), (5, 5), (12, 3)]
    arr = [0, 0, 2, 3, 9]
    trace = simulate(reqs, num_blocks=12, block_size=4, max_num_seqs=3, max_num_batched_tokens=16, arrivals=arr)
    sim = simulate_online(reqs, arr, step_cost(1.0, 0.0, 0.0), num_blocks=12, block_size=4, max_num_seqs=3,
                          max_num_batched_tokens=16)
    finish = {iv["request"]: iv["finish_time"] for iv in trace.timeline() if iv["outcome"] == "length"}
    assert finish == sim["finish"] and sim["steps"] == len([s for s in trace.steps if s.batch])


def test_step_cost_is_the_lessons_linear_fit():
    cost = step_cost(0.5, 0.1, 0.01)
    assert cost.params == (0.5, 0.1, 0.01)

    class Rec:
        def __init__(self, n: int, prefill: bool) -> None:
            self.num_new_tokens, self.is_prefill = n, prefill

    assert cost([Rec(30, True), Rec(1, False), Rec(1, False)]) == pytest.approx(0.5 + 0.3 + 0.3)
    assert len(poisson_arrivals(5, 2.0, seed=3)) == 5
