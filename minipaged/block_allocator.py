"""Physical KV blocks: a fixed pool, a free list and reference counts.

Owns which physical block is free and how many block tables point at each used one.
It knows nothing about sequences or tokens; that is the block table's job.
"""
from __future__ import annotations

from collections import deque


class BlockAllocatorError(ValueError):
    """A misuse of the allocator: freeing a free block, an id outside the pool, ..."""


class OutOfBlocksError(MemoryError):
    """The pool has no free block left. The scheduler catches this and preempts."""


class BlockAllocator:
    """A pool of ``num_blocks`` physical blocks of ``block_size`` token slots each.

    vLLM calls this the *block pool*. A block is either free (ref count 0, in the free
    list) or used (ref count >= 1, not in the free list). Blocks freed last are handed
    out last, so a block that was just released stays untouched for as long as possible
    (this is what lets a prefix cache find it again).

    Its public members are exactly those of :class:`minipaged.interfaces.BlockPool`;
    everything else (allocating several blocks, counting used ones, invariant checks) is a
    free function in :mod:`minipaged.parts` that works on any pool.
    """

    def __init__(self, num_blocks: int, block_size: int = 16) -> None:
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 1:
            raise BlockAllocatorError(
                f"num_blocks must be a positive int, got {num_blocks!r}: size the pool with "
                "minipaged.kv_cache.num_blocks_for_budget(...)"
            )
        if not isinstance(block_size, int) or isinstance(block_size, bool) or not 1 <= block_size <= 256:
            raise BlockAllocatorError(f"block_size must be an int in 1..256, got {block_size!r} (16 is the usual choice)")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._ref_counts: list[int] = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def ref_count(self, block_id: int) -> int:
        self._check_id(block_id)
        return self._ref_counts[block_id]

    def allocate(self) -> int:
        """Take the free block at the front of the free list; its ref count becomes 1."""
        if not self._free:
            raise OutOfBlocksError(
                f"no free KV block: all {self.num_blocks} blocks of the pool are in use. "
                "Free a finished sequence's blocks, preempt one, or give the engine a larger KV budget."
            )
        block_id = self._free.popleft()
        assert self._ref_counts[block_id] == 0, f"block {block_id} was in the free list with ref count {self._ref_counts[block_id]}"
        self._ref_counts[block_id] = 1
        return block_id

    def incref(self, block_id: int) -> None:
        """One more block table points at ``block_id`` (sharing, e.g. a forked sequence)."""
        self._check_id(block_id)
        if self._ref_counts[block_id] == 0:
            raise BlockAllocatorError(f"cannot share block {block_id}: it is free (ref count 0); allocate it first")
        self._ref_counts[block_id] += 1

    def free(self, block_id: int) -> None:
        """Drop one reference; the block goes to the back of the free list when none is left."""
        self._check_id(block_id)
        if self._ref_counts[block_id] == 0:
            raise BlockAllocatorError(
                f"double free: block {block_id} is already free (ref count 0, "
                f"{len(self._free)} of {self.num_blocks} blocks free). Each block table must free a block once."
            )
        self._ref_counts[block_id] -= 1
        if self._ref_counts[block_id] == 0:
            self._free.append(block_id)

    # -- private ---------------------------------------------------------------------------
    def _check_id(self, block_id: int) -> None:
        if not isinstance(block_id, int) or isinstance(block_id, bool) or not 0 <= block_id < self.num_blocks:
            raise BlockAllocatorError(f"block id {block_id!r} is not in this pool (valid ids: 0..{self.num_blocks - 1})")

    def _check_internal(self) -> None:
        """Called by parts.check_pool: the free list holds each ref-0 block exactly once."""
        free = list(self._free)
        free_set = set(free)
        assert len(free) == len(free_set), f"a block is listed twice in the free list: {sorted(b for b in free_set if free.count(b) > 1)}"
        for b, rc in enumerate(self._ref_counts):
            if rc == 0:
                assert b in free_set, f"block {b} has ref count 0 but is not in the free list (leaked)"
            else:
                assert b not in free_set, f"block {b} has ref count {rc} but is also in the free list (could be handed out twice)"

    def __repr__(self) -> str:
        return f"BlockAllocator(num_blocks={self.num_blocks}, block_size={self.block_size}, free={self.num_free_blocks})"
