"""append_tokens() takes blocks one at a time and keeps the ones it got when the pool runs dry."""
CHECK = "minipaged.checks.block_table:check_growth"
EXPECT = ["ran out of blocks", "all or nothing"]
HINT = "all or nothing: when the pool cannot give every block needed, raise BEFORE taking any"

from _base import GoodBlockTable


class MyBlockTable(GoodBlockTable):
    def append_tokens(self, num_new_tokens=1):
        new = []
        for _ in range(self.blocks_needed(num_new_tokens)):
            b = self.allocator.allocate()  # raises OutOfBlocksError half way
            self.blocks.append(b)
            new.append(b)
        self.num_tokens += num_new_tokens
        return new
