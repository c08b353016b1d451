"""slot_mapping() reads its positions from a table of 4096 made once: a sequence longer than that (up to the model's
max_model_len, 8192 for SmolLM2) gets too few slots. Only the check's long sequence catches it."""
CHECK = "minipaged.checks.block_table:check_slot_mapping"
EXPECT = ["t0.slot_mapping(0, 8192) has the wrong shape", "of 8192 tokens"]
HINT = "then stop: something in your slot_mapping holds only 4096 positions"

import torch

from _base import GoodBlockTable

_POSITIONS = torch.arange(4096)  # made once, to save an arange per call


class MyBlockTable(GoodBlockTable):
    def slot_mapping(self, start, end):
        pos = _POSITIONS[start:end]
        table = torch.tensor(self.blocks + [0], dtype=torch.int64)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size
