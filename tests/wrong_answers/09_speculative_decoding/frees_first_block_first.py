"""Gives the dropped blocks back first block first."""
CHECK = "minipaged.checks.spec_decode:check_truncate"
EXPECT = ["in another order", "last block first"]
HINT = "give the dropped blocks back last block first"

from _base import GoodBlockTable


class MyBlockTable(GoodBlockTable):
    def give_back(self, dropped):
        for b in dropped:
            self.allocator.free(b)
