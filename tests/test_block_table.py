"""The page table: position -> (block, offset) -> slot, growth, release, sharing.

A hypothesis state machine runs several tables over one small pool (appends that may
run the pool dry, frees, forks) and checks every table and the allocator after each step.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from minipaged.runner import pad_block_tables
from minipaged.parts import allocate_many, check_pool, check_table, fork_table, num_reserved_slots
from minipaged.block_allocator import BlockAllocator, OutOfBlocksError
from minipaged.block_table import BlockTable


def _shuffled_pool(num_blocks: int, block_size: int, order: list[int]) -> BlockAllocator:
    """A pool whose free list hands out blocks in ``order`` (so tables get scattered blocks)."""
    a = BlockAllocator(num_blocks, block_size=block_size)
    taken = allocate_many(a, num_blocks)
    for b in order:
        a.free(taken[b])
    return a


# -- address translation ------------------------------------------------------------------------
def test_position_to_block_offset_and_slot():
    a = _shuffled_pool(6, 4, [5, 2, 0, 3, 1, 4])
    t = BlockTable(a)
    assert t.append_tokens(10) == [5, 2, 0]
    assert t.blocks == [5, 2, 0] and t.num_tokens == 10 and num_reserved_slots(t) == 12
    assert [int(t.slot_mapping(p, p + 1)) for p in range(10)] == [20, 21, 22, 23, 8, 9, 10, 11, 0, 1]
    sm = t.slot_mapping(2, 9)
    assert sm.dtype == torch.int64 and sm.shape == (7,)
    assert sm.tolist() == [int(t.slot_mapping(p, p + 1)) for p in range(2, 9)]
    assert t.slot_mapping(4, 4).shape == (0,)
    row = pad_block_tables([t.blocks], pad=-1, width=5)[0]
    assert row.dtype == torch.int32 and row.tolist() == [5, 2, 0, -1, -1]
    check_table(t)


def test_grow_one_token_at_a_time_takes_a_block_only_at_boundaries():
    a = BlockAllocator(4, block_size=3)
    t = BlockTable(a)
    taken = [len(t.append_tokens(1)) for _ in range(9)]
    assert taken == [1, 0, 0, 1, 0, 0, 1, 0, 0]
    assert t.blocks_needed(0) == 0 and t.blocks_needed(1) == 1 and t.blocks_needed(4) == 2
    check_table(t)


def test_grow_by_many_then_free_returns_every_block_at_once():
    a = BlockAllocator(8, block_size=2)
    t = BlockTable(a)
    t.append_tokens(5)
    t.append_tokens(6)
    assert len(t.blocks) == 6 and a.num_free_blocks == 2
    t.free()
    assert t.blocks == [] and t.num_tokens == 0 and a.num_free_blocks == 8
    check_table(t)
    check_pool(a)
    t.free()  # freeing an empty table is harmless
    assert a.num_free_blocks == 8


def test_append_is_all_or_nothing_when_pool_runs_dry():
    a = BlockAllocator(3, block_size=2)
    t = BlockTable(a)
    t.append_tokens(3)
    before = (list(t.blocks), t.num_tokens, a.num_free_blocks)
    with pytest.raises(OutOfBlocksError) as e:
        t.append_tokens(6)
    assert "needs 3 more block(s) for 6 token(s)" in str(e.value) and "1 free" in str(e.value)
    assert (t.blocks, t.num_tokens, a.num_free_blocks) == before
    check_table(t)
    check_pool(a)


def test_fork_shares_blocks_with_references():
    a = BlockAllocator(4, block_size=2)
    parent = BlockTable(a)
    parent.append_tokens(3)
    child = fork_table(parent)
    assert child.blocks == parent.blocks and child.blocks is not parent.blocks
    assert all(a.ref_count(b) == 2 for b in parent.blocks)
    parent.free()
    assert a.num_free_blocks == 2, "the child still holds the shared blocks"
    check_table(child)
    child.free()
    assert a.num_free_blocks == 4
    check_pool(a)


@pytest.mark.parametrize("block_size", [1, 7, 64, 256])
def test_every_block_size_maps_positions_consistently(block_size):
    a = _shuffled_pool(5, block_size, [3, 0, 4, 1, 2])
    t = BlockTable(a)
    n = 3 * block_size + 1 if block_size < 256 else 2 * block_size
    t.append_tokens(n)
    sm = t.slot_mapping(0, n)
    assert sm.tolist() == [t.blocks[p // block_size] * block_size + p % block_size for p in range(n)]
    assert len(set(sm.tolist())) == n


# -- error paths ------------------------------------------------------------------------------
def test_negative_growth_is_an_error():
    t = BlockTable(BlockAllocator(2))
    with pytest.raises(ValueError, match="num_new_tokens must be >= 0, got -1"):
        t.append_tokens(-1)


def test_position_outside_the_table():
    t = BlockTable(BlockAllocator(2, block_size=4))
    t.append_tokens(3)
    for pos in (-1, 3, 100):
        with pytest.raises(IndexError, match=r"is outside this sequence's 3 token slot"):
            t.slot_mapping(pos, pos + 1)


def test_slot_range_past_the_end_tells_to_append_first():
    t = BlockTable(BlockAllocator(2, block_size=4))
    t.append_tokens(3)
    for start, end in [(0, 4), (-1, 2), (3, 2)]:
        with pytest.raises(IndexError, match=r"call append_tokens first"):
            t.slot_mapping(start, end)


def test_padded_row_width_too_small():
    t = BlockTable(BlockAllocator(4, block_size=1))
    t.append_tokens(3)
    with pytest.raises(ValueError, match="width 2 is smaller than the 3 blocks"):
        pad_block_tables([t.blocks], width=2)


def test_check_invariants_catches_corruption():
    a = BlockAllocator(4, block_size=2)
    t = BlockTable(a)
    t.append_tokens(3)
    t.num_tokens = 5  # claims more tokens than its blocks hold
    with pytest.raises(AssertionError, match="need 3 blocks"):
        check_table(t)
    t.num_tokens = 3
    a.free(t.blocks[0])  # someone freed a block the table still uses
    with pytest.raises(AssertionError, match="allocator says it is free"):
        check_table(t)


# -- property: many tables, one pool ----------------------------------------------------------
class TablesMachine(RuleBasedStateMachine):
    @initialize(
        num_blocks=st.integers(1, 16),
        block_size=st.one_of(st.integers(1, 8), st.sampled_from([16, 32, 64])),
        order_seed=st.randoms(use_true_random=False),
    )
    def setup(self, num_blocks, block_size, order_seed):
        order = list(range(num_blocks))
        order_seed.shuffle(order)
        self.a = _shuffled_pool(num_blocks, block_size, order)
        self.bs = block_size
        self.tables: list[BlockTable] = []

    @rule()
    def new_table(self):
        self.tables.append(BlockTable(self.a))

    @precondition(lambda self: self.tables)
    @rule(data=st.data(), n=st.integers(0, 70))
    def append(self, data, n):
        t = data.draw(st.sampled_from(self.tables))
        before_blocks, before_tokens, free = list(t.blocks), t.num_tokens, self.a.num_free_blocks
        need = -(-(before_tokens + n) // self.bs) - len(before_blocks)
        if need > free:
            with pytest.raises(OutOfBlocksError):
                t.append_tokens(n)
            assert (t.blocks, t.num_tokens, self.a.num_free_blocks) == (before_blocks, before_tokens, free)
        else:
            new = t.append_tokens(n)
            assert len(new) == need and t.blocks == before_blocks + new
            assert t.num_tokens == before_tokens + n
            assert all(self.a.ref_count(b) == 1 for b in new)

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def free(self, data):
        t = self.tables.pop(data.draw(st.integers(0, len(self.tables) - 1)))
        t.free()
        assert t.blocks == [] and t.num_tokens == 0

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def fork(self, data):
        self.tables.append(fork_table(data.draw(st.sampled_from(self.tables))))

    @invariant()
    def consistent(self):
        if not hasattr(self, "a"):
            return
        check_pool(self.a)
        holders: dict[int, int] = {}
        for t in self.tables:
            check_table(t)
            for b in t.blocks:
                holders[b] = holders.get(b, 0) + 1
            # The slot mapping and the scalar path agree, and every slot lies in the pool.
            sm = t.slot_mapping(0, t.num_tokens).tolist()
            assert sm == [int(t.slot_mapping(p, p + 1)) for p in range(t.num_tokens)]
            assert all(0 <= s < self.a.num_blocks * self.bs for s in sm)
        # No block is shared without a reference, and no reference is left unaccounted for.
        for b in range(self.a.num_blocks):
            assert self.a.ref_count(b) == holders.get(b, 0), f"block {b}"

    def teardown(self):
        if not hasattr(self, "a"):
            return
        for t in self.tables:
            t.free()
        check_pool(self.a)
        assert self.a.num_free_blocks == self.a.num_blocks, "a block leaked after every table was freed"


TablesMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_block_tables_state_machine = TablesMachine.TestCase


@settings(max_examples=50, deadline=None)
@given(block_size=st.integers(1, 256), n=st.integers(0, 600), start=st.integers(0, 600), length=st.integers(0, 600))
def test_slot_mapping_range_matches_formula(block_size, n, start, length):
    a = BlockAllocator(-(-max(n, 1) // block_size), block_size=block_size)
    t = BlockTable(a)
    t.append_tokens(n)
    start = min(start, n)
    end = min(start + length, n)
    sm = t.slot_mapping(start, end).tolist()
    assert sm == [t.blocks[p // block_size] * block_size + p % block_size for p in range(start, end)]
