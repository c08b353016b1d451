"""One sequence's page table: logical token positions -> physical blocks -> cache slots.

Owns the list of physical blocks a sequence holds and how many token slots it uses.
It takes blocks from, and gives them back to, a BlockAllocator; it never touches K/V data.
"""
from __future__ import annotations

import torch

from .block_allocator import OutOfBlocksError
from .parts import allocate_many, cdiv


class BlockTable:
    """Logical block ``i`` of the sequence lives in physical block ``blocks[i]``.

    Token position ``p`` is at offset ``p % block_size`` of logical block ``p // block_size``,
    so its cache slot is ``blocks[p // block_size] * block_size + p % block_size``.

    Its public members are exactly those of :class:`minipaged.interfaces.BlockTableProtocol`;
    forking, padding into a batch row and invariant checks are free functions
    (:mod:`minipaged.parts`, the runner).
    """

    def __init__(self, allocator) -> None:
        self.allocator = allocator
        self.block_size = allocator.block_size
        self.blocks: list[int] = []
        self.num_tokens = 0  # token slots in use (written, or about to be written this step)

    def blocks_needed(self, num_new_tokens: int) -> int:
        """Extra blocks needed to hold ``num_new_tokens`` more tokens."""
        return max(0, cdiv(self.num_tokens + num_new_tokens, self.block_size) - len(self.blocks))

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
        new_blocks = allocate_many(self.allocator, need)
        self.blocks.extend(new_blocks)
        self.num_tokens += num_new_tokens
        return new_blocks

    def free(self) -> None:
        """Give every block back to the allocator, last block first (the sequence finished or was preempted)."""
        for b in reversed(self.blocks):
            self.allocator.free(b)
        self.blocks = []
        self.num_tokens = 0

    def slot_mapping(self, start: int, end: int) -> torch.Tensor:
        """Cache slots of positions ``start..end-1`` as an int64 tensor of shape (end - start,)."""
        if not 0 <= start <= end <= self.num_tokens:
            raise IndexError(
                f"slot range [{start}, {end}) is outside this sequence's {self.num_tokens} token slot(s); "
                "call append_tokens first"
            )
        bs = self.block_size
        if end - start <= 16:  # a decode's one slot (most calls): plain ints, one small tensor
            return torch.tensor([self.blocks[p // bs] * bs + p % bs for p in range(start, end)], dtype=torch.int64)
        pos = torch.arange(start, end, dtype=torch.int64)
        table = torch.tensor(self.blocks, dtype=torch.int64) if self.blocks else torch.zeros(0, dtype=torch.int64)
        return table[pos // bs] * bs + pos % bs

    def __repr__(self) -> str:
        return f"BlockTable(blocks={self.blocks}, num_tokens={self.num_tokens})"
