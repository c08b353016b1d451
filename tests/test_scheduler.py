"""Continuous batching under the one rule: property tests, the rule itself, and error paths.

The property tests drive a Scheduler with random workloads (arrivals at random steps with
random prompt and output lengths, random EOS, aborts, tiny pools that force preemption,
block sizes 1..64, small token budgets that force chunked prefill) and a fake model: a
"sampler" whose token depends only on (request, output index), and a KV cache that stores
(request, token) at each slot, so a block shared or reused by mistake shows up as a wrong
read-back. check_invariants() runs after every operation.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from minipaged.parts import check_scheduler, num_used_blocks
from minipaged.attention.reference import gather_kv
from minipaged.block_allocator import BlockAllocator
from minipaged.kv_cache import write_kv
from minipaged.scheduler import Scheduler
from minipaged.sequence import FinishReason, Sequence, SequenceStatus

EOS = 0


def fake_token(uid: int, i: int) -> int:
    """What the fake model samples as output token ``i`` of request ``uid`` (never EOS)."""
    return 1 + (uid * 31 + i * 7) % 97


# -- workloads --------------------------------------------------------------------------------
@dataclass
class Req:
    uid: int
    arrive: int  # step at which it is added
    prompt_len: int
    max_tokens: int
    eos_at: int | None  # output index at which the fake model samples EOS
    abort_at: int | None  # step at which the caller aborts it
    abort_mid_step: bool  # abort between schedule() and update(), as if cancelled while the model ran


@dataclass
class Workload:
    block_size: int
    num_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    chunked: bool
    max_model_len: int | None
    reqs: list[Req] = field(default_factory=list)


def _need_blocks(prompt_len: int, max_tokens: int, bs: int, mml: int | None) -> int:
    total = prompt_len + max_tokens - 1
    if mml is not None:
        total = min(total, mml)
    return -(-total // bs)


@st.composite
def workloads(draw, tight: bool = False, chunked: bool | None = None) -> Workload:
    """``tight``: the pool is just big enough for the largest request, so growth preempts."""
    # Tight pools need growth across block boundaries, which block size 64 with these lengths rarely has.
    bs = draw(st.one_of(st.integers(1, 8), st.sampled_from([16] if tight else [16, 32, 64])))
    n = draw(st.integers(3, 6) if tight else st.integers(1, 8))
    rare = 5 if tight else 2  # EOS and aborts end requests early; tight pools want them to grow
    reqs = []
    for uid in range(n):
        prompt_len = draw(st.integers(1, 40))
        max_tokens = draw(st.integers(1, 24))
        eos_at = draw(st.one_of(*[st.none()] * rare, st.integers(0, max_tokens)))
        abort_at = draw(st.one_of(*[st.none()] * (rare + 1), st.integers(0, 60)))
        reqs.append(Req(uid, draw(st.integers(0, 25)), prompt_len, max_tokens, eos_at, abort_at, draw(st.booleans())))
    mml = draw(st.one_of(*[st.none()] * rare, st.integers(2, 70)))
    if tight:
        largest = max(_need_blocks(r.prompt_len, r.max_tokens, bs, mml) for r in reqs)
        num_blocks = largest + draw(st.sampled_from([0, 0, 1]))
        for r in reqs:  # many requests at once, so they compete for the pool
            r.arrive = draw(st.integers(0, 3))
    else:  # from "nothing fits" (rejections) to roomy
        largest = max(_need_blocks(r.prompt_len, r.max_tokens, bs, mml) for r in reqs)
        num_blocks = draw(st.integers(1, 2 * largest + 2))
    return Workload(
        block_size=bs,
        num_blocks=num_blocks,
        max_num_seqs=draw(st.integers(2 if tight else 1, 6)),
        max_num_batched_tokens=draw(st.integers(1, 48) if chunked is not False else st.integers(1, 96)),
        chunked=draw(st.sampled_from([True, True, True, False])) if chunked is None else chunked,
        max_model_len=mml,
        reqs=reqs,
    )


# -- the driver: a fake engine that checks everything after every operation ---------------
class Run:
    def __init__(self, w: Workload, check_kv: bool = True) -> None:
        self.w = w
        self.alloc = BlockAllocator(w.num_blocks, block_size=w.block_size)
        self.sched = Scheduler(
            self.alloc,
            max_num_seqs=w.max_num_seqs,
            max_num_batched_tokens=w.max_num_batched_tokens,
            max_model_len=w.max_model_len,
            enable_chunked_prefill=w.chunked,
        )
        self.check_kv = check_kv
        # Fake KV: channel 0 holds (request + 1), channel 1 the token at that position.
        self.k_cache = torch.full((w.num_blocks, w.block_size, 1, 2), -1.0, dtype=torch.float64)
        self.v_cache = torch.full_like(self.k_cache, -1.0)
        self.seqs: dict[int, Sequence] = {}
        self.reqs = {r.uid: r for r in w.reqs}
        self.accepted: list[int] = []
        self.admitted_once: list[int] = []
        self.epochs: dict[int, list[list[tuple[int, int]]]] = {}  # uid -> one list of (start, n) per (re)computation
        self.busy_steps = 0
        self.num_preemptions = 0
        self.num_partial_chunks = 0  # steps that computed part of a prompt (or of a recompute)

    # The one place that knows what a correct run produces for a request, preemption or not.
    def expected_outputs(self, r: Req) -> tuple[list[int], FinishReason]:
        out: list[int] = []
        while True:
            i = len(out)
            out.append(EOS if i == r.eos_at else fake_token(r.uid, i))
            if out[-1] == EOS:
                return out, FinishReason.STOP
            if len(out) >= r.max_tokens:
                return out, FinishReason.LENGTH
            if self.w.max_model_len is not None and r.prompt_len + len(out) >= self.w.max_model_len:
                return out, FinishReason.LENGTH

    def should_reject(self, r: Req) -> bool:
        w = self.w
        total = r.prompt_len + r.max_tokens - 1
        if w.max_model_len is not None:
            if r.prompt_len >= w.max_model_len:
                return True
            total = min(total, w.max_model_len)
        if -(-total // w.block_size) > w.num_blocks:
            return True
        return not w.chunked and total > w.max_num_batched_tokens

    def check(self) -> None:
        check_scheduler(self.sched)
        assert len(self.sched.running) <= self.w.max_num_seqs
        # Running sequences hold disjoint blocks (nothing here forks), so none is shared.
        held = [b for s in self.sched.running for b in s.block_table.blocks]
        assert len(held) == len(set(held)), f"a block is held by two running sequences: {sorted(held)}"
        assert num_used_blocks(self.alloc) == len(held)

    def arrive(self, step: int) -> None:
        for r in self.w.reqs:
            if r.arrive != step:
                continue
            prompt = [1 + (r.uid * 13 + j) % 97 for j in range(r.prompt_len)]
            seq = Sequence(r.uid, prompt, max_tokens=r.max_tokens, eos_token_ids=(EOS,))
            self.seqs[r.uid] = seq
            ok = self.sched.add_request(seq)
            assert ok is not self.should_reject(r), (r, seq.reject_reason)
            if ok:
                assert seq.status is SequenceStatus.WAITING and seq.reject_reason is None
                self.accepted.append(r.uid)
                self.epochs[r.uid] = [[]]
            else:
                assert seq.status is SequenceStatus.REJECTED and seq.finish_reason is FinishReason.REJECTED
                assert isinstance(seq.reject_reason, str) and len(seq.reject_reason) > 20
                assert seq.block_table is None
            self.check()

    def abort(self, step: int, mid_step: bool) -> None:
        for r in self.w.reqs:
            if r.abort_at != step or r.abort_mid_step != mid_step or r.uid not in self.seqs:
                continue
            seq = self.seqs[r.uid]
            was_live = not seq.is_finished
            got = self.sched.abort(r.uid)
            assert (got is seq) if was_live else (got is None)
            if was_live:
                assert seq.status is SequenceStatus.FINISHED and seq.finish_reason is FinishReason.ABORT
                assert seq.block_table is None
            self.check()

    def step(self, step: int) -> None:
        sched, w = self.sched, self.w
        running_before = list(sched.running)
        waiting_before = list(sched.waiting)
        tokens_before = {s.seq_id: list(s.token_ids) for s in running_before + waiting_before}
        self.busy_steps += 1

        out = sched.schedule()
        self.check()

        # No deadlock: while anything is unfinished, every step does some work.
        assert not out.is_empty, f"step {step}: nothing scheduled, but running={running_before} waiting={waiting_before}"
        # Budgets.
        ns = [s.num_new_tokens for s in out.scheduled]
        assert all(n >= 1 for n in ns)
        assert out.num_batched_tokens == sum(ns) <= w.max_num_batched_tokens
        assert len(out.scheduled) <= w.max_num_seqs
        assert len({id(s.seq) for s in out.scheduled}) == len(out.scheduled), "a sequence scheduled twice"

        # Preemption: the most recently admitted go first, keep their tokens, restart from 0.
        k = len(out.preempted)
        assert out.preempted == running_before[::-1][:k]
        for p in out.preempted:
            assert p.status is SequenceStatus.WAITING and p.block_table is None and p.num_computed_tokens == 0
            assert p.token_ids == tokens_before[p.seq_id], "a preempted request lost or changed tokens"
            self.epochs[p.seq_id].append([])
        assert list(sched.waiting)[:k] == out.preempted[::-1], "preempted requests go to the front, oldest first"
        self.num_preemptions += k

        # Running first, oldest first; then admission from the head of the queue, in order.
        from_running = [s.seq for s in out.scheduled if s.seq in running_before]
        m = len(from_running)
        assert from_running == running_before[:m] and m + k <= len(running_before)
        admitted = [s.seq for s in out.scheduled[m:]]
        assert all(s.seq not in running_before for s in out.scheduled[m:])
        if k:
            assert not admitted, "a step that had to preempt must not admit"
        else:
            assert admitted == waiting_before[: len(admitted)]
        for seq in admitted:
            if seq.seq_id not in self.admitted_once:
                # FCFS, no starvation: nobody accepted earlier is still waiting for a first chance.
                earlier = self.accepted[: self.accepted.index(seq.seq_id)]
                assert all(u in self.admitted_once or self.seqs[u].is_finished for u in earlier), seq
                self.admitted_once.append(seq.seq_id)

        # The one rule: each scheduled request catches up from where its KV ends, in order.
        for s in out.scheduled:
            seq = s.seq
            assert seq.status is SequenceStatus.RUNNING
            assert s.start == seq.num_computed_tokens
            assert s.start + s.num_new_tokens <= seq.num_tokens
            assert seq.block_table.num_tokens == s.start + s.num_new_tokens
            epoch = self.epochs[seq.seq_id][-1]
            assert s.start == (epoch[-1][0] + epoch[-1][1] if epoch else 0)
            epoch.append((s.start, s.num_new_tokens))
            if not w.chunked:
                assert s.samples, "without chunked prefill every scheduled request reaches its end"
            self.num_partial_chunks += not s.samples

        # Fake forward: write every new token's KV, then read each context back by block table.
        if self.check_kv and out.scheduled:
            slots, ks = [], []
            for s in out.scheduled:
                slots.append(s.seq.block_table.slot_mapping(s.start, s.start + s.num_new_tokens))
                toks = s.seq.token_ids[s.start : s.start + s.num_new_tokens]
                ks.append(torch.tensor([[s.seq.seq_id + 1, t] for t in toks], dtype=torch.float64))
            k_new = torch.cat(ks).unsqueeze(1)
            write_kv(self.k_cache, self.v_cache, k_new, k_new, torch.cat(slots))
            for s in out.scheduled:
                ctx = s.start + s.num_new_tokens
                got = gather_kv(self.k_cache, torch.tensor(s.seq.block_table.blocks, dtype=torch.int32), ctx)[:, 0]
                want = torch.tensor([[s.seq.seq_id + 1, t] for t in s.seq.token_ids[:ctx]], dtype=torch.float64)
                assert torch.equal(got, want), f"step {step}: KV of request {s.seq.seq_id} overwritten or misplaced"

        self.abort(step, mid_step=True)

        # Fake sampling and update.
        sampled = {}
        for s in out.scheduled:
            if s.samples:
                r = self.reqs[s.seq.seq_id]
                i = len(s.seq.output_token_ids)
                sampled[s.seq.seq_id] = EOS if i == r.eos_at else fake_token(r.uid, i)
        n_out = {s.seq.seq_id: len(s.seq.output_token_ids) for s in out.scheduled}
        finished = sched.update(out, sampled)
        self.check()
        for s in out.scheduled:
            seq = s.seq
            if seq.finish_reason is FinishReason.ABORT:
                continue
            assert seq.num_computed_tokens == s.start + s.num_new_tokens
            assert len(seq.output_token_ids) == n_out[seq.seq_id] + (1 if s.seq.seq_id in sampled else 0)
        for seq in finished:
            assert seq.status is SequenceStatus.FINISHED and seq.block_table is None
            assert seq not in sched.running and seq not in sched.waiting

    def go(self) -> "Run":
        last_arrival = max(r.arrive for r in self.w.reqs)
        for step in range(10_000):
            self.arrive(step)
            if self.sched.has_unfinished():
                self.step(step)
            self.abort(step, mid_step=False)
            if step >= last_arrival and not self.sched.has_unfinished():
                break
        self.final_checks()
        return self

    def final_checks(self) -> None:
        sched = self.sched
        assert not sched.has_unfinished()
        self.check()
        assert self.alloc.num_free_blocks == self.alloc.num_blocks, "blocks leaked after every request ended"
        # Progress bound: every busy step advances the oldest running request, which is never
        # preempted, by at least one token, so no request can hold things up for longer than it has tokens.
        bound = sum(self.seqs[u].max_total_tokens for u in self.accepted)
        assert self.busy_steps <= bound, f"{self.busy_steps} busy steps > bound {bound}: starvation or livelock"
        for r in self.w.reqs:
            seq = self.seqs[r.uid]
            if r.uid not in self.accepted:
                assert seq.status is SequenceStatus.REJECTED and seq.reject_reason
                continue
            assert seq.status is SequenceStatus.FINISHED, seq
            if seq.finish_reason is FinishReason.ABORT:
                continue
            want, reason = self.expected_outputs(r)
            assert seq.output_token_ids == want, f"request {r.uid}: outputs {seq.output_token_ids} != {want}"
            assert seq.finish_reason is reason
            # The final computation covered every position but the last sampled token, once, in order.
            final = self.epochs[r.uid][-1]
            assert sum(n for _, n in final) == seq.num_tokens - 1
            assert final[0][0] == 0


PROPERTY = settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPERTY
@given(workloads())
def test_random_workloads_finish_correctly(w):
    run = Run(w).go()
    event(f"preempted: {run.num_preemptions > 0}")
    event(f"rejected: {len(run.accepted) < len(w.reqs)}")
    event(f"chunked: {run.num_partial_chunks > 0}")


@PROPERTY
@given(workloads(tight=True, chunked=True))
def test_tight_pools_preempt_and_recompute_correctly(w):
    run = Run(w).go()
    event(f"preempted: {run.num_preemptions > 0}")
    event(f"chunked: {run.num_partial_chunks > 0}")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(tight=True, chunked=False))
def test_without_chunked_prefill_never_deadlocks(w):
    run = Run(w).go()
    event(f"preempted: {run.num_preemptions > 0}")


def test_property_workloads_do_preempt():
    """The property tests above would prove little if their pools never ran dry."""
    rng = random.Random(0)
    total = 0
    for seed in range(40):
        rng.seed(seed)
        n = rng.randint(2, 5)
        reqs = [Req(u, rng.randint(0, 2), rng.randint(1, 20), rng.randint(4, 20), None, None, False) for u in range(n)]
        bs = rng.choice([1, 2, 4])
        num_blocks = max(_need_blocks(r.prompt_len, r.max_tokens, bs, None) for r in reqs)
        total += Run(Workload(bs, num_blocks, 4, rng.randint(4, 32), True, None, reqs)).go().num_preemptions
    assert total > 10


# -- the one rule, without any model ----------------------------------------------------------
def _drive(sched: Scheduler, seqs: list[Sequence], eos_after: dict | None = None, max_steps: int = 1000):
    """Run to the end; return {seq_id: [(start, num_new_tokens), ...]} and the step outputs."""
    for s in seqs:
        sched.add_request(s)
    chunks: dict = {}
    outs = []
    for _ in range(max_steps):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        outs.append(out)
        for s in out.scheduled:
            chunks.setdefault(s.seq.seq_id, []).append((s.start, s.num_new_tokens))
        sampled = {s.seq.seq_id: 5 for s in out.scheduled if s.samples}
        sched.update(out, sampled)
        check_scheduler(sched)
    assert not sched.has_unfinished()
    return chunks, outs


def test_prefill_decode_and_chunked_prefill_are_one_rule():
    sched = Scheduler(BlockAllocator(64, block_size=4), max_num_batched_tokens=8)
    a = Sequence("a", list(range(1, 21)), max_tokens=3)  # 20 prompt tokens: chunked 8 + 8 + 4
    chunks, _ = _drive(sched, [a])
    assert chunks["a"] == [(0, 8), (8, 8), (16, 4), (20, 1), (21, 1)]
    assert a.output_token_ids == [5, 5, 5] and a.finish_reason is FinishReason.LENGTH


def test_running_first_then_waiting_shares_the_budget():
    sched = Scheduler(BlockAllocator(64, block_size=4), max_num_batched_tokens=6)
    a = Sequence("a", [1, 2, 3, 4], max_tokens=3)
    b = Sequence("b", [1] * 9, max_tokens=2)
    chunks, outs = _drive(sched, [a, b])
    # step 0: a prefill 4, b gets the 2 left; step 1: a decodes 1, b 5 more; then both decode
    assert chunks["a"] == [(0, 4), (4, 1), (5, 1)]
    assert chunks["b"] == [(0, 2), (2, 5), (7, 2), (9, 1)]
    assert [o.num_batched_tokens for o in outs] == [6, 6, 3, 1]


def test_max_num_seqs_caps_the_batch():
    sched = Scheduler(BlockAllocator(64, block_size=4), max_num_seqs=2, max_num_batched_tokens=100)
    seqs = [Sequence(i, [1, 2], max_tokens=2) for i in range(3)]
    chunks, outs = _drive(sched, seqs)
    assert [len(o.scheduled) for o in outs] == [2, 2, 1, 1]
    assert chunks[2] == [(0, 2), (2, 1)]


def test_preemption_frees_blocks_keeps_tokens_and_recomputes_from_zero():
    # 4 blocks of 2: a and b (prompt 2 each) fit at first; growing, b (admitted last) is preempted.
    alloc = BlockAllocator(4, block_size=2)
    sched = Scheduler(alloc, max_num_batched_tokens=16)
    a = Sequence("a", [1, 2], max_tokens=5)
    b = Sequence("b", [3, 4], max_tokens=5)
    sched.add_request(a)
    sched.add_request(b)
    history = []
    for _ in range(100):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        check_scheduler(sched)
        history.append(([(s.seq.seq_id, s.start, s.num_new_tokens) for s in out.scheduled], [p.seq_id for p in out.preempted]))
        if out.preempted:
            assert out.preempted == [b] and b.num_computed_tokens == 0 and b.block_table is None
            assert b.token_ids == [3, 4, 7, 7, 7] and b.num_preemptions == 1 and sched.waiting[0] is b
            assert alloc.num_free_blocks == 4 - len(a.block_table.blocks)
        sched.update(out, {s.seq.seq_id: 7 for s in out.scheduled if s.samples})
        check_scheduler(sched)
    assert history == [
        ([("a", 0, 2), ("b", 0, 2)], []),
        ([("a", 2, 1), ("b", 2, 1)], []),
        ([("a", 3, 1), ("b", 3, 1)], []),  # the pool is full now: 2 blocks each
        ([("a", 4, 1)], ["b"]),  # a needs a third block, none is free: b, the newest, goes
        ([("a", 5, 1)], []),
        ([("b", 0, 5)], []),  # b's prompt *and* its 3 sampled tokens are recomputed from 0
        ([("b", 5, 1)], []),
    ]
    assert a.output_token_ids == b.output_token_ids == [7] * 5
    assert sched.num_preemptions == 1 and alloc.num_free_blocks == 4


def test_rejected_request_does_not_stop_the_others():
    sched = Scheduler(BlockAllocator(4, block_size=4), max_num_batched_tokens=16)
    ok1 = Sequence("ok1", [1] * 5, max_tokens=3)
    big = Sequence("big", [1] * 10, max_tokens=8)  # 17 tokens of KV: 5 blocks > 4
    ok2 = Sequence("ok2", [1] * 3, max_tokens=2)
    assert [sched.add_request(s) for s in (ok1, big, ok2)] == [True, False, True]
    assert big.status is SequenceStatus.REJECTED and big.finish_reason is FinishReason.REJECTED
    assert "needs 5 KV blocks" in big.reject_reason and "whole pool has 4" in big.reject_reason
    assert "max_tokens" in big.reject_reason and "KV budget" in big.reject_reason
    assert big not in sched.waiting
    _drive(sched, [])
    assert ok1.finish_reason is FinishReason.LENGTH and ok2.finish_reason is FinishReason.LENGTH


def test_request_that_exactly_fits_the_pool_is_accepted_and_runs():
    # prompt 5 + max_tokens 4 -> 8 tokens of KV (the last sampled token is never fed back) = 2 blocks of 4.
    alloc = BlockAllocator(2, block_size=4)
    sched = Scheduler(alloc, max_num_batched_tokens=16)
    s = Sequence("s", [1] * 5, max_tokens=4)
    assert sched.add_request(s)
    _drive(sched, [])
    assert len(s.output_token_ids) == 4 and alloc.num_free_blocks == 2
    assert not Scheduler(alloc).add_request(Sequence("t", [1] * 5, max_tokens=5))


def test_eos_and_stop_tokens_finish_early_and_free_blocks():
    alloc = BlockAllocator(8, block_size=2)
    sched = Scheduler(alloc)
    s = Sequence("s", [1, 2, 3], max_tokens=10, eos_token_ids=(5,))
    _drive(sched, [s])  # the driver samples 5 every time
    assert s.output_token_ids == [5] and s.finish_reason is FinishReason.STOP and alloc.num_free_blocks == 8
    t = Sequence("t", [1, 2, 3], max_tokens=10, eos_token_ids=(5,), ignore_eos=True)
    _drive(sched, [t])
    assert len(t.output_token_ids) == 10 and t.finish_reason is FinishReason.LENGTH
    u = Sequence("u", [1, 2, 3], max_tokens=10, stop_token_ids=(5,), ignore_eos=True)
    _drive(sched, [u])
    assert u.output_token_ids == [5] and u.finish_reason is FinishReason.STOP


def test_max_model_len_ends_generation():
    sched = Scheduler(BlockAllocator(16, block_size=4), max_model_len=6)
    s = Sequence("s", [1, 2, 3, 4], max_tokens=100)
    _drive(sched, [s])
    assert s.num_tokens == 6 and s.finish_reason is FinishReason.LENGTH


def test_abort_waiting_and_running_frees_at_once():
    alloc = BlockAllocator(8, block_size=2)
    sched = Scheduler(alloc, max_num_seqs=1)
    a = Sequence("a", [1, 2, 3], max_tokens=5)
    b = Sequence("b", [1, 2, 3], max_tokens=5)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    assert [s.seq for s in out.scheduled] == [a] and num_used_blocks(alloc) == 2
    assert sched.abort("b") is b and b.finish_reason is FinishReason.ABORT and b not in sched.waiting
    assert sched.abort("a") is a and alloc.num_free_blocks == 8 and a.block_table is None
    check_scheduler(sched)
    assert sched.update(out, {"a": 9}) == [], "a request aborted while its step ran is skipped"
    assert a.output_token_ids == [] and sched.abort("a") is None and sched.abort("nobody") is None
    assert not sched.has_unfinished()


def test_chunked_prefill_off_regression_no_deadlock_after_preemption():
    """Bug found by the property test: without chunking, a preempted request whose prompt plus
    output had outgrown the token budget could never be recomputed and blocked the queue forever.
    Such a request is now rejected up front, with the reason."""
    sched = Scheduler(BlockAllocator(5, block_size=1), max_num_batched_tokens=2, enable_chunked_prefill=False)
    a = Sequence("a", [1], max_tokens=4)
    assert not sched.add_request(a)
    assert "chunked prefill" in a.reject_reason and "recomputed" in a.reject_reason and "max_num_batched_tokens=2" in a.reject_reason
    ok = [Sequence(i, [1], max_tokens=2) for i in range(3)]  # 2 tokens of KV each: fits the budget
    _drive(sched, ok)
    assert all(s.finish_reason is FinishReason.LENGTH for s in ok)


# -- error paths --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, match",
    [({"max_num_seqs": 0}, "max_num_seqs must be an int >= 1, got 0"), ({"max_num_batched_tokens": 0}, "max_num_batched_tokens must be an int >= 1, got 0")],
)
def test_bad_scheduler_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Scheduler(BlockAllocator(4), **kwargs)


@pytest.mark.parametrize(
    "seq, kwargs, needles",
    [
        (Sequence("e", [], max_tokens=4), {}, ["prompt is empty"]),
        (Sequence("m", [1], max_tokens=0), {}, ["max_tokens must be >= 1, got 0"]),
        (Sequence("l", [1] * 8, max_tokens=1), {"max_model_len": 8}, ["8 tokens", "context is 8", "shorten"]),
        (Sequence("p", [1] * 30, max_tokens=4), {}, ["needs 9 KV blocks", "block size 4", "whole pool has 8"]),
        (Sequence("c", [1] * 10, max_tokens=4), {"enable_chunked_prefill": False, "max_num_batched_tokens": 12},
         ["chunked prefill off", "13 tokens", "max_num_batched_tokens=12", "turn chunked prefill on"]),
    ],
)
def test_rejection_reasons_say_what_to_change(seq, kwargs, needles):
    sched = Scheduler(BlockAllocator(8, block_size=4), **kwargs)
    assert sched.add_request(seq) is False
    assert seq.status is SequenceStatus.REJECTED and seq.finish_reason is FinishReason.REJECTED
    for needle in needles:
        assert needle in seq.reject_reason, (needle, seq.reject_reason)
    assert not sched.has_unfinished()


def test_update_without_a_sampled_token_names_the_request():
    sched = Scheduler(BlockAllocator(4, block_size=4))
    sched.add_request(Sequence("req-7", [1, 2], max_tokens=2))
    out = sched.schedule()
    with pytest.raises(KeyError, match="req-7"):
        sched.update(out, {})


def test_check_invariants_catches_a_leaked_block():
    alloc = BlockAllocator(4, block_size=2)
    sched = Scheduler(alloc)
    sched.add_request(Sequence("a", [1, 2, 3], max_tokens=2))
    sched.schedule()
    alloc.allocate()  # taken behind the scheduler's back
    with pytest.raises(AssertionError, match="leaked or over-freed"):
        check_scheduler(sched)
