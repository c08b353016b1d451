"""Gives blocks back by changing the BlockAllocator's insides (its ref counts and free list) instead of
calling allocator.free(b): right on a BlockAllocator, wrong on the engine's prefix cache."""
CHECK = "minipaged.checks.spec_decode:check_truncate"
EXPECT = ["without calling allocator.free(b)", "prefix cache"]
HINT = "use only the pool's members of the contract"

from _base import GoodBlockTable


class MyBlockTable(GoodBlockTable):
    def give_back(self, dropped):
        pool = self.allocator
        for b in reversed(dropped):
            pool._ref_counts[b] -= 1
            if pool._ref_counts[b] == 0:
                pool._free.append(b)
