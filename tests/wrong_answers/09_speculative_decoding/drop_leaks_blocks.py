"""Cuts self.blocks but never gives the dropped blocks back to the pool."""
CHECK = "minipaged.checks.spec_decode:check_truncate"
EXPECT = ["the pool differs", "never went back to the pool"]
HINT = "never went back to the pool"

from _base import GoodBlockTable


class MyBlockTable(GoodBlockTable):
    def give_back(self, dropped):
        pass
