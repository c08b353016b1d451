"""free() frees each block until its ref count is 0: right alone, wrong for a forked (shared) table."""
CHECK = "minipaged.checks.block_table:check_free"
EXPECT = ["a forked table shares its blocks", "lost a reference that another table still holds", "exactly once per block"]
HINT = "lost a reference that another table still holds"

from _base import GoodBlockTable


class MyBlockTable(GoodBlockTable):
    def free(self):
        for b in reversed(self.blocks):
            while self.allocator.ref_count(b) > 0:
                self.allocator.free(b)
        self.blocks = []
        self.num_tokens = 0
