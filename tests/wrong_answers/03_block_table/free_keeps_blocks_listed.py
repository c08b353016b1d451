"""free() gives every block back and sets num_tokens to 0, but leaves self.blocks listing the freed blocks. The hint must
say the table must hold nothing, not that blocks leaked (they did go back)."""
CHECK = "minipaged.checks.block_table:check_free"
EXPECT = ["blocks differ after t1.free()"]
UNEXPECTED = ["leaks", "boundary"]
HINT = "after free() the table holds nothing: set self.blocks = []"

from _base import GoodBlockTable


class MyBlockTable(GoodBlockTable):
    def free(self):
        for b in self.blocks:
            self.allocator.free(b)
        self.num_tokens = 0  # forgot: self.blocks = []
