"""slot_mapping() divides with / : the slots come out as floats, which cannot index the cache."""
CHECK = "minipaged.checks.block_table:check_slot_mapping"
EXPECT = ["slots index the cache, so they must be integers", "use integer ops"]
HINT = "use integer ops"

import torch

from _base import GoodBlockTable


class MyBlockTable(GoodBlockTable):
    def slot_mapping(self, start, end):
        pos = torch.arange(start, end)
        table = torch.tensor(self.blocks + [0], dtype=torch.int64)
        return table[(pos / self.block_size).long()] * self.block_size + pos % self.block_size * 1.0
