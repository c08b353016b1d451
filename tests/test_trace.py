"""The trace recorder on real Scheduler runs, and the simulated static/continuous batching runs."""
from __future__ import annotations

import json
from collections import defaultdict

import pytest

from minipaged import BlockAllocator, BlockTable, Scheduler, Sequence
from minipaged import parts
from minipaged.config import EngineConfig
from minipaged.bench.simulate import make_scheduler, sample_requests, simulate, simulate_static
from minipaged.trace import Trace

REQS = sample_requests(40, seed=3, prompt_len=(8, 64), output_median=24, output_max=400)


def _check_slots(trace: Trace) -> None:
    tl = trace.timeline()
    by_slot = defaultdict(list)
    for iv in tl:
        assert iv["start"] < iv["end"] and iv["start_time"] <= iv["finish_time"] <= iv["end_time"]
        by_slot[iv["slot"]].append(iv)
    for slot, ivs in by_slot.items():
        ivs.sort(key=lambda iv: iv["start"])
        for a, b in zip(ivs, ivs[1:]):
            assert a["end"] <= b["start"], f"slot {slot}: {a} overlaps {b}"
            assert a["end_time"] <= b["start_time"]
    for r in trace.steps:
        assert len(set(r.slots.values())) == len(r.slots), f"step {r.step}: two requests share a slot {r.slots}"
    # lowest free slot first: slot ids stay compact
    assert max((iv["slot"] for iv in tl), default=-1) + 1 == trace.peak_concurrency


def test_owners_agree_with_the_allocator_every_step():
    alloc = BlockAllocator(24, block_size=8)
    sched = make_scheduler(Scheduler, alloc, BlockTable,
                           EngineConfig(block_size=8, num_blocks=24, max_num_seqs=6, max_num_batched_tokens=40))
    for i, (p, o) in enumerate(REQS[:12]):
        sched.add_request(Sequence(i, list(range(p)), max_tokens=o, ignore_eos=True))
    trace = Trace()
    t = 0
    while sched.has_unfinished():
        out = sched.schedule()
        sched.update(out, {s.seq.seq_id: 7 for s in out.scheduled if s.samples})
        t += 1
        rec = trace.record(sched, out, t)
        parts.check_scheduler(sched, 6)
        assert rec.blocks_used == parts.num_used_blocks(alloc) and rec.blocks_free == alloc.num_free_blocks
        for b, owner in enumerate(rec.owners):
            assert (owner is None) == (alloc.ref_count(b) == 0), f"step {rec.step}, block {b}"
            assert not isinstance(owner, tuple), "no block is shared in this run"
        assert sum(o is not None for o in rec.owners) == rec.blocks_used
        running = {s.seq_id: s for s in sched.running}
        assert set(rec.tables) == set(running) == set(rec.running)
        for sid, (blocks, ntok) in rec.tables.items():
            assert list(blocks) == running[sid].block_table.blocks and ntok == running[sid].block_table.num_tokens
            assert all(rec.owners[b] == sid for b in blocks)
        assert rec.reserved_slots == 8 * sum(len(b) for b, _ in rec.tables.values())
        assert rec.used_slots == sum(s.num_computed_tokens for s in sched.running) <= rec.reserved_slots
        assert rec.preemptions == sched.num_preemptions
    assert trace.steps[-1].preemptions > 0, "the pool is small enough that this run must preempt"
    assert trace.peak_blocks_used == 24
    _check_slots(trace)


def test_tiny_run_by_hand():
    # prompt 5, 3 output tokens, blocks of 4:
    # step 0 prefill 5 tokens (2 blocks, 8 slots, 5 used), step 1 decode (6 used),
    # step 2 decode and finish (blocks freed before the record: 0 reserved)
    trace = simulate([(5, 3)], num_blocks=4, block_size=4)
    assert [r.reserved_slots for r in trace.steps] == [8, 8, 0]
    assert [r.used_slots for r in trace.steps] == [5, 6, 0]
    assert trace.kv_waste() == pytest.approx((3 + 2) / 16)
    assert [(r.prefill_tokens, r.decode_tokens, r.sampled_tokens) for r in trace.steps] == [(5, 0, 1), (0, 1, 1), (0, 1, 1)]
    assert [r.blocks_used for r in trace.steps] == [2, 2, 0]
    assert trace.timeline() == [{"request": 0, "slot": 0, "start": 0, "end": 3, "start_time": 0.0, "end_time": 3.0,
                                 "finish": 3, "finish_time": 3.0, "outcome": "length"}]
    assert trace.peak_concurrency == 1 and trace.total_time == 3.0
    # time-weighted: the same here, since every step lasts one unit
    assert trace.kv_waste(by="time") == pytest.approx(5 / 16)


def test_static_by_hand():
    # two requests in one batch, max_len 10 each: 20 slots reserved for 3 steps
    trace = simulate_static([(5, 3), (2, 1)], batch_size=2, max_len=10)
    assert [r.reserved_slots for r in trace.steps] == [20, 20, 20]
    assert [r.used_slots for r in trace.steps] == [5 + 2, 6 + 2, 7 + 2]
    assert trace.kv_waste() == pytest.approx((13 + 12 + 11) / 60)
    assert [r.sampled_tokens for r in trace.steps] == [2, 1, 1]
    assert trace.steps[0].prefill_tokens == 2 * 5  # padded to the longest prompt
    tl = {iv["request"]: iv for iv in trace.timeline()}
    assert (tl[1]["start"], tl[1]["finish"], tl[1]["end"]) == (0, 1, 3)  # done after 1 step, slot held for 3
    assert (tl[0]["finish"], tl[0]["end"]) == (3, 3)
    assert trace.peak_blocks_used is None and trace.peak_concurrency == 2
    with pytest.raises(ValueError, match="max_len"):
        simulate_static([(5, 3)], batch_size=1, max_len=6)


def test_paged_waste_small_contiguous_large_on_a_long_tail():
    paged = simulate(REQS, num_blocks=200, block_size=16, max_num_seqs=8, check_invariants=True)
    static = simulate_static(REQS, batch_size=8)  # reserves what the longest padded batch needs
    assert paged.kv_waste() < 0.15
    assert static.kv_waste() > 0.6
    exact = simulate(REQS, num_blocks=3200, block_size=1, max_num_seqs=8)
    assert exact.kv_waste() == 0.0  # blocks of one token: nothing reserved is ever empty
    coarse = simulate(REQS, num_blocks=200, block_size=64, max_num_seqs=8)
    assert coarse.kv_waste() > paged.kv_waste()
    # the same tokens come out of both, and continuous batching is done sooner
    total_out = sum(o for _, o in REQS)
    assert paged.summary()["output_tokens"] == static.summary()["output_tokens"] == total_out
    assert paged.total_time < static.total_time
    for t in (paged, static, exact, coarse):
        _check_slots(t)


def test_preemption_and_chunked_prefill_still_count_right():
    reqs = [(60, 40), (50, 60), (30, 80), (70, 20), (10, 90)]
    trace = simulate(reqs, num_blocks=14, block_size=8, max_num_seqs=5, max_num_batched_tokens=24,
                     check_invariants=True)
    s = trace.summary()
    assert s["preemptions"] > 0 and not trace.rejected
    assert s["output_tokens"] == sum(o for _, o in reqs)
    assert any(iv["outcome"] == "preempted" for iv in trace.timeline())
    done = {iv["request"] for iv in trace.timeline() if iv["outcome"] == "length"}
    assert done == set(range(len(reqs)))
    assert max(r.prefill_tokens + r.decode_tokens for r in trace.steps) <= 24
    _check_slots(trace)


def test_prefill_decode_split_without_preemption():
    trace = simulate(REQS[:10], num_blocks=400, block_size=16, max_num_seqs=10, max_num_batched_tokens=32)
    assert trace.summary()["preemptions"] == 0
    assert sum(r.prefill_tokens for r in trace.steps) == sum(p for p, _ in REQS[:10])
    assert sum(r.decode_tokens for r in trace.steps) == sum(o - 1 for _, o in REQS[:10])


def test_arrivals_and_rejections():
    trace = simulate([(10, 5), (10, 5), (500, 5)], num_blocks=8, block_size=16, arrivals=[0, 12, 0])
    assert [i for i, _ in trace.rejected] == [2] and "blocks" in trace.rejected[0][1]
    tl = {iv["request"]: iv for iv in trace.timeline()}
    assert tl[0]["start"] == 0 and tl[1]["start"] == 12
    assert tl[1]["slot"] == 0, "request 0 is gone by then, so its slot is reused"
    idle = [r for r in trace.steps if not r.batch]
    assert idle, "steps 5..11 have nothing to run and are still recorded"
    with pytest.raises(ValueError, match="arrival"):
        simulate([(10, 5)], num_blocks=8, arrivals=[0, 1])


def test_to_dict_is_json_and_summary():
    trace = simulate(REQS[:8], num_blocks=40, block_size=8, max_num_seqs=4)
    d = json.loads(json.dumps(trace.to_dict()))
    assert d["num_blocks"] == 40 and d["block_size"] == 8 and len(d["steps"]) == len(trace)
    assert len(d["steps"][0]["owners"]) == 40
    assert d["summary"]["peak_concurrency"] == 4 == trace.peak_concurrency
    assert d["timeline"] == json.loads(json.dumps(trace.timeline()))
    json.dumps(simulate_static(REQS[:8], batch_size=4).to_dict())
    assert "KV waste" in repr(trace)
    assert trace.peak_step == max(range(len(trace)), key=lambda i: trace[i].reserved_slots)
    with pytest.raises(ValueError):
        trace.kv_waste(by="tokens")


def test_sample_requests_is_long_tailed_and_seeded():
    reqs = sample_requests(2000, seed=0, output_median=24, output_max=1000)
    outs = sorted(o for _, o in reqs)
    assert reqs == sample_requests(2000, seed=0, output_median=24, output_max=1000)
    assert 18 <= outs[len(outs) // 2] <= 30
    assert outs[-1] > 8 * outs[len(outs) // 2], "a long tail: the longest answers are many times the median"
    assert all(8 <= p <= 64 and 1 <= o <= 1000 for p, o in reqs)
