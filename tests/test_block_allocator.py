"""The block pool: free list, reference counts, and the errors a learner meets first.

A hypothesis state machine drives the allocator against a plain model (a ref count per
block and the free order) and calls check_invariants() after every operation.
"""
from __future__ import annotations

from collections import deque

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from minipaged.parts import allocate_many, check_pool, num_used_blocks, ref_counts
from minipaged.block_allocator import BlockAllocator, BlockAllocatorError, OutOfBlocksError


# -- examples ---------------------------------------------------------------------------------
def test_fresh_pool_is_all_free():
    a = BlockAllocator(5, block_size=4)
    check_pool(a)
    assert (a.num_free_blocks, num_used_blocks(a)) == (5, 0)
    assert all(a.ref_count(b) == 0 for b in range(5))


def test_allocate_and_free_round_trip():
    a = BlockAllocator(3, block_size=2)
    got = [a.allocate() for _ in range(3)]
    assert sorted(got) == [0, 1, 2]
    assert a.num_free_blocks == 0 and not (1 <= a.num_free_blocks) and (0 <= a.num_free_blocks)
    assert all(a.ref_count(b) == 1 for b in got)
    check_pool(a)
    for b in got:
        a.free(b)
        check_pool(a)
    assert a.num_free_blocks == 3


def test_shared_block_returns_only_after_last_reference():
    a = BlockAllocator(2)
    b = a.allocate()
    a.incref(b)
    a.incref(b)
    assert a.ref_count(b) == 3
    a.free(b)
    a.free(b)
    assert a.ref_count(b) == 1 and a.num_free_blocks == 1, "a block with references left must stay used"
    check_pool(a)
    a.free(b)
    assert a.ref_count(b) == 0 and a.num_free_blocks == 2
    check_pool(a)


def test_freed_blocks_are_handed_out_last():
    """FIFO reuse: a block just released stays untouched as long as other free blocks exist."""
    a = BlockAllocator(4)
    first = a.allocate()
    a.free(first)
    assert [a.allocate() for _ in range(4)] == [1, 2, 3, first]


def test_allocate_many_is_all_or_nothing():
    a = BlockAllocator(4)
    a.allocate()
    with pytest.raises(OutOfBlocksError):
        allocate_many(a, 4)
    assert a.num_free_blocks == 3, "a failed allocate_many must not take any block"
    check_pool(a)
    assert len(set(allocate_many(a, 3))) == 3
    assert allocate_many(a, 0) == []


@pytest.mark.parametrize("block_size", [1, 2, 16, 255, 256])
def test_block_sizes_1_to_256_accepted(block_size):
    assert BlockAllocator(1, block_size=block_size).block_size == block_size


# -- error paths: the message must say what went wrong and what to look at ----------------
def test_allocate_from_empty_pool_says_pool_is_full():
    a = BlockAllocator(2)
    allocate_many(a, 2)
    with pytest.raises(OutOfBlocksError) as e:
        a.allocate()
    msg = str(e.value)
    assert "all 2 blocks" in msg and "in use" in msg
    assert "preempt" in msg or "budget" in msg  # what the learner can do about it
    assert isinstance(e.value, MemoryError)


def test_allocate_many_over_free_count_names_both_numbers():
    a = BlockAllocator(4)
    allocate_many(a, 2)
    with pytest.raises(OutOfBlocksError, match=r"asked for 3 KV blocks but only 2 of 4 are free"):
        allocate_many(a, 3)


def test_double_free_names_the_block_and_the_state():
    a = BlockAllocator(4)
    b = a.allocate()
    a.free(b)
    with pytest.raises(BlockAllocatorError) as e:
        a.free(b)
    msg = str(e.value)
    assert f"block {b}" in msg and "already free" in msg and "ref count 0" in msg
    assert "4 of 4 blocks free" in msg
    check_pool(a)  # the failed free changed nothing


def test_free_of_never_allocated_block_is_an_error():
    a = BlockAllocator(4)
    with pytest.raises(BlockAllocatorError, match=r"block 2 is already free"):
        a.free(2)
    assert a.num_free_blocks == 4
    check_pool(a)


@pytest.mark.parametrize("bad", [-1, 4, 99, True, 1.0, "0", None])
def test_block_id_outside_pool(bad):
    a = BlockAllocator(4)
    allocate_many(a, 4)
    for op in (a.free, a.incref, a.ref_count):
        with pytest.raises(BlockAllocatorError, match=r"not in this pool \(valid ids: 0\.\.3\)"):
            op(bad)
    check_pool(a)


def test_incref_of_free_block_is_an_error():
    a = BlockAllocator(3)
    with pytest.raises(BlockAllocatorError, match=r"cannot share block 1: it is free"):
        a.incref(1)
    assert a.ref_count(1) == 0


@pytest.mark.parametrize("n", [0, -3, 2.5, "8"])
def test_bad_num_blocks_points_at_the_budget_helper(n):
    with pytest.raises(BlockAllocatorError, match="num_blocks_for_budget"):
        BlockAllocator(n)


@pytest.mark.parametrize("bs", [0, 257, -1, 16.0])
def test_bad_block_size(bs):
    with pytest.raises(BlockAllocatorError, match=r"block_size must be an int in 1\.\.256"):
        BlockAllocator(4, block_size=bs)


def test_check_invariants_catches_corruption():
    """The checker itself must be able to fail, or every test built on it proves nothing."""
    a = BlockAllocator(3)
    b = a.allocate()
    a._free.append(b)  # used and free at once
    with pytest.raises(AssertionError, match="also in the free list"):
        check_pool(a)

    a = BlockAllocator(3)
    a._free.popleft()  # ref 0 but not listed: leaked
    with pytest.raises(AssertionError, match="leaked"):
        check_pool(a)

    a = BlockAllocator(3)
    a._free.append(0)
    with pytest.raises(AssertionError, match="listed twice"):
        check_pool(a)


# -- property: long random operation sequences against a model --------------------------------
class AllocatorMachine(RuleBasedStateMachine):
    """Model: ref count per block and the free list's order (FIFO reuse is promised)."""

    @initialize(num_blocks=st.integers(1, 12), block_size=st.integers(1, 256))
    def setup(self, num_blocks, block_size):
        self.a = BlockAllocator(num_blocks, block_size=block_size)
        self.refs = [0] * num_blocks
        self.free_order = deque(range(num_blocks))

    def _used(self):
        return [b for b, r in enumerate(self.refs) if r > 0]

    @rule()
    def allocate(self):
        if not self.free_order:
            with pytest.raises(OutOfBlocksError):
                self.a.allocate()
            return
        b = self.a.allocate()
        assert b == self.free_order.popleft()
        assert self.refs[b] == 0
        self.refs[b] = 1

    @rule(n=st.integers(0, 6))
    def allocate_many(self, n):
        if n > len(self.free_order):
            with pytest.raises(OutOfBlocksError):
                allocate_many(self.a, n)
            return
        got = allocate_many(self.a, n)
        assert got == [self.free_order.popleft() for _ in range(n)]
        for b in got:
            self.refs[b] = 1

    @precondition(lambda self: any(self.refs))
    @rule(data=st.data())
    def incref(self, data):
        b = data.draw(st.sampled_from(self._used()))
        self.a.incref(b)
        self.refs[b] += 1

    @precondition(lambda self: any(self.refs))
    @rule(data=st.data())
    def free_used(self, data):
        b = data.draw(st.sampled_from(self._used()))
        self.a.free(b)
        self.refs[b] -= 1
        if self.refs[b] == 0:
            self.free_order.append(b)

    @precondition(lambda self: not all(self.refs))
    @rule(data=st.data())
    def free_free_block_fails(self, data):
        b = data.draw(st.sampled_from([b for b, r in enumerate(self.refs) if r == 0]))
        with pytest.raises(BlockAllocatorError, match=f"block {b} is already free"):
            self.a.free(b)

    @invariant()
    def matches_model(self):
        check_pool(self.a)
        assert ref_counts(self.a) == self.refs
        assert list(self.a._free) == list(self.free_order)
        assert self.a.num_free_blocks == self.refs.count(0)
        assert num_used_blocks(self.a) == len(self.refs) - self.refs.count(0)

    def teardown(self):
        # Releasing every reference must give the whole pool back: nothing leaks.
        for b, r in enumerate(self.refs):
            for _ in range(r):
                self.a.free(b)
        check_pool(self.a)
        assert self.a.num_free_blocks == self.a.num_blocks


AllocatorMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_allocator_state_machine = AllocatorMachine.TestCase
