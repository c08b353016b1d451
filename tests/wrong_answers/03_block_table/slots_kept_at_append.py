"""Keeps its own list of slots, filled by append_tokens: a forked table (parts.fork_table copies blocks and
num_tokens, the table's state) has none, so its slot_mapping is wrong."""
CHECK = "minipaged.checks.block_table:check_slot_mapping"
EXPECT = ["a forked table", "t1.slot_mapping(0, 6)"]
HINT = "has slot_mapping right; the fork has not"

import torch

from _base import GoodBlockTable


class MyBlockTable(GoodBlockTable):
    def __init__(self, allocator):
        super().__init__(allocator)
        self._slots = []

    def append_tokens(self, num_new_tokens=1):
        new = super().append_tokens(num_new_tokens)
        bs = self.block_size
        for p in range(len(self._slots), self.num_tokens):
            self._slots.append(self.blocks[p // bs] * bs + p % bs)
        return new

    def slot_mapping(self, start, end):
        return torch.tensor(self._slots[start:end], dtype=torch.int64)
