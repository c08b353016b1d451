"""free() forgets the blocks without giving them back to the allocator."""
CHECK = "minipaged.checks.block_table:check_free"
EXPECT = ["the pool differs after t1.free()", "allocator.free(b)", "leaks"]
HINT = "Clearing the list alone leaks the blocks"

from _base import GoodBlockTable


class MyBlockTable(GoodBlockTable):
    def free(self):
        self.blocks = []
        self.num_tokens = 0
