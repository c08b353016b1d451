"""free() gives every block back and empties self.blocks, but leaves num_tokens as it was: the empty table still claims
its tokens. The hint must name num_tokens, not a leak (the blocks did go back)."""
CHECK = "minipaged.checks.block_table:check_free"
EXPECT = ["num_tokens differs after t1.free()"]
UNEXPECTED = ["leaks"]
HINT = "set self.num_tokens = 0"

from _base import GoodBlockTable


class MyBlockTable(GoodBlockTable):
    def free(self):
        for b in self.blocks:
            self.allocator.free(b)
        self.blocks = []  # forgot: self.num_tokens = 0
