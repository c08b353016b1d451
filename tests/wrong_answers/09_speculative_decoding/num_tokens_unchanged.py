"""truncate gives the blocks back but leaves num_tokens as it was."""
CHECK = "minipaged.checks.spec_decode:check_truncate"
EXPECT = ["num_tokens differs", "self.num_tokens = num_tokens"]
HINT = "set self.num_tokens = num_tokens"

from _base import GoodBlockTable


class MyBlockTable(GoodBlockTable):
    def truncate(self, num_tokens):
        n = self.num_tokens
        super().truncate(num_tokens)
        self.num_tokens = n
