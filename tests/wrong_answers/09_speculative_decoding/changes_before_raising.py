"""Checks the argument only after giving blocks back: truncate(-1) empties the table, then raises."""
CHECK = "minipaged.checks.spec_decode:check_truncate"
EXPECT = ["which must change nothing", "check the argument before changing anything"]
HINT = "check the argument before changing anything"

from _base import GoodBlockTable


class MyBlockTable(GoodBlockTable):
    def truncate(self, num_tokens):
        keep = max(0, self.keep(num_tokens))
        self.give_back(self.blocks[keep:])
        self.blocks = self.blocks[:keep]
        self.check_range(num_tokens)
        self.num_tokens = num_tokens
