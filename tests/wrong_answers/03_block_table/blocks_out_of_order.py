"""append_tokens() puts the new blocks in front of the old ones: self.blocks is no longer in logical order."""
CHECK = "minipaged.checks.block_table:check_growth"
EXPECT = ["blocks differ after", "Page table of t0"]
HINT = "holds the right blocks in another order"

from minipaged import parts

from _base import GoodBlockTable


class MyBlockTable(GoodBlockTable):
    def append_tokens(self, num_new_tokens=1):
        need = self.blocks_needed(num_new_tokens)
        new = parts.allocate_many(self.allocator, need)
        self.blocks = new + self.blocks  # wrong: logical block 0 must stay first
        self.num_tokens += num_new_tokens
        return new
