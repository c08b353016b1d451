"""blocks_needed() counts on the room left in the last block, which append_tokens() keeps in an attribute of its own. A
forked table (parts.fork_table sets only blocks and num_tokens) never had that attribute set: it takes a block too many.
Only the growth check's fork story catches it there."""
CHECK = "minipaged.checks.block_table:check_growth"
EXPECT = ["t1.blocks_needed(1) differs", "a forked table"]
HINT = "has blocks_needed right; the fork has not"

from _base import GoodBlockTable


class MyBlockTable(GoodBlockTable):
    def __init__(self, allocator):
        super().__init__(allocator)
        self.room = 0  # free slots in the last block, kept up to date by append_tokens

    def blocks_needed(self, num_new_tokens):
        return max(0, -(-(num_new_tokens - self.room) // self.block_size))

    def append_tokens(self, num_new_tokens=1):
        new = super().append_tokens(num_new_tokens)
        self.room = len(self.blocks) * self.block_size - self.num_tokens
        return new

    def free(self):
        super().free()
        self.room = 0
