"""slot_mapping() returns the positions themselves: it never looks at the physical blocks."""
CHECK = "minipaged.checks.block_table:check_slot_mapping"
EXPECT = ["maps to the wrong slot", "the table was not used", "physical block"]
HINT = "your slot equals the position itself"

import torch

from _base import GoodBlockTable


class MyBlockTable(GoodBlockTable):
    def slot_mapping(self, start, end):
        return torch.arange(start, end)
