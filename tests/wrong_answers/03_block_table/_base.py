"""A correct block table that the wrong answers here change one method of (not a wrong answer itself)."""
import torch

from minipaged import OutOfBlocksError, parts


class GoodBlockTable:
    def __init__(self, allocator):
        self.allocator = allocator
        self.block_size = allocator.block_size
        self.blocks = []
        self.num_tokens = 0

    def blocks_needed(self, num_new_tokens):
        total = self.num_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(self.blocks))

    def append_tokens(self, num_new_tokens=1):
        need = self.blocks_needed(num_new_tokens)
        if need > self.allocator.num_free_blocks:
            raise OutOfBlocksError(f"need {need}")
        new = parts.allocate_many(self.allocator, need)
        self.blocks.extend(new)
        self.num_tokens += num_new_tokens
        return new

    def slot_mapping(self, start, end):
        pos = torch.arange(start, end)
        table = torch.tensor(self.blocks + [0], dtype=torch.int64)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def free(self):
        for b in self.blocks:
            self.allocator.free(b)
        self.blocks = []
        self.num_tokens = 0
