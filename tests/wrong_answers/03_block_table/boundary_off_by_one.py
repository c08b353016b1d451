"""blocks_needed() adds a block too many when the tokens end exactly on a block boundary."""
CHECK = "minipaged.checks.block_table:check_growth"
EXPECT = ["blocks_needed(0) differs", "exact boundary"]
HINT = "Watch the exact boundary"

from _base import GoodBlockTable


class MyBlockTable(GoodBlockTable):
    def blocks_needed(self, num_new_tokens):
        total = self.num_tokens + num_new_tokens
        return max(0, total // self.block_size + 1 - len(self.blocks))
