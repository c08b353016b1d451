"""One sequence's page table: logical token positions -> physical blocks -> cache slots.

Owns the list of physical blocks a sequence holds and how many token slots it uses.
It takes blocks from, and gives them back to, a BlockAllocator; it never touches K/V data.
"""
from __future__ import annotations

import torch

from .block_allocator import BlockAllocator, BlockAllocatorError, OutOfBlocksError


class BlockTable:
    """Logical block ``i`` of the sequence lives in physical block ``blocks[i]``.

    Token position ``p`` is at offset ``p % block_size`` of logical block ``p // block_size``,
    so its cache slot is ``blocks[p // block_size] * block_size + p % block_size``.
    """

    def __init__(self, allocator: BlockAllocator) -> None:
        self.allocator = allocator
        self.block_size = allocator.block_size
        self.blocks: list[int] = []
        self.num_tokens = 0  # token slots in use (written, or about to be written this step)

    # -- sizes -----------------------------------------------------------------------------
    @property
    def num_reserved_slots(self) -> int:
        return len(self.blocks) * self.block_size

    def blocks_needed(self, num_new_tokens: int) -> int:
        """Extra blocks needed to hold ``num_new_tokens`` more tokens."""
        total = self.num_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(self.blocks))

    # -- growth and release ----------------------------------------------------------------
    def append_tokens(self, num_new_tokens: int = 1) -> list[int]:
        """Make room for ``num_new_tokens`` more tokens; return the blocks newly taken.

        All or nothing: if the pool runs dry, the table is left as it was and
        OutOfBlocksError is raised.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        need = self.blocks_needed(num_new_tokens)
        if need > self.allocator.num_free_blocks:
            raise OutOfBlocksError(
                f"sequence needs {need} more block(s) for {num_new_tokens} token(s) but the pool has "
                f"{self.allocator.num_free_blocks} free"
            )
        new_blocks = self.allocator.allocate_many(need)
        self.blocks.extend(new_blocks)
        self.num_tokens += num_new_tokens
        return new_blocks

    def free(self) -> None:
        """Give every block back to the allocator at once (the sequence finished or was preempted)."""
        for b in reversed(self.blocks):
            self.allocator.free(b)
        self.blocks = []
        self.num_tokens = 0

    def fork(self) -> "BlockTable":
        """A second table that shares all of this one's blocks (ref counts go up).

        Writing into a shared block would change the other sequence too; the engine in this
        course does not write into shared blocks (copy-on-write is left as an exercise).
        """
        child = type(self)(self.allocator)
        for b in self.blocks:
            self.allocator.incref(b)
        child.blocks = list(self.blocks)
        child.num_tokens = self.num_tokens
        return child

    # -- address translation ---------------------------------------------------------------
    def physical(self, pos: int) -> tuple[int, int]:
        """(physical block, offset) of token position ``pos``."""
        if not 0 <= pos < self.num_tokens:
            raise IndexError(f"position {pos} is outside this sequence's {self.num_tokens} token slot(s)")
        return self.blocks[pos // self.block_size], pos % self.block_size

    def slot(self, pos: int) -> int:
        block, offset = self.physical(pos)
        return block * self.block_size + offset

    def slot_mapping(self, start: int, end: int) -> torch.Tensor:
        """Cache slots of positions ``start..end-1`` as an int64 tensor of shape (end - start,)."""
        if not 0 <= start <= end <= self.num_tokens:
            raise IndexError(
                f"slot range [{start}, {end}) is outside this sequence's {self.num_tokens} token slot(s); "
                "call append_tokens first"
            )
        pos = torch.arange(start, end, dtype=torch.int64)
        table = torch.tensor(self.blocks, dtype=torch.int64) if self.blocks else torch.zeros(0, dtype=torch.int64)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def as_tensor(self, width: int | None = None, pad: int = 0) -> torch.Tensor:
        """The block ids as an int32 row, padded to ``width`` (rows of a batch must be equally long)."""
        width = len(self.blocks) if width is None else width
        if width < len(self.blocks):
            raise ValueError(f"width {width} is smaller than the {len(self.blocks)} blocks of this table")
        row = torch.full((width,), pad, dtype=torch.int32)
        row[: len(self.blocks)] = torch.tensor(self.blocks, dtype=torch.int32)
        return row

    # -- checks ----------------------------------------------------------------------------
    def check_invariants(self) -> None:
        assert len(self.blocks) == len(set(self.blocks)), f"a block appears twice in one table: {self.blocks}"
        assert len(self.blocks) == -(-self.num_tokens // self.block_size), (
            f"{self.num_tokens} tokens need {-(-self.num_tokens // self.block_size)} blocks of {self.block_size}, "
            f"the table holds {len(self.blocks)}"
        )
        for b in self.blocks:
            try:
                rc = self.allocator.ref_count(b)
            except BlockAllocatorError as e:  # pragma: no cover - message path
                raise AssertionError(str(e)) from e
            assert rc >= 1, f"the table holds block {b}, but the allocator says it is free"

    def __repr__(self) -> str:
        return f"BlockTable(blocks={self.blocks}, num_tokens={self.num_tokens})"
