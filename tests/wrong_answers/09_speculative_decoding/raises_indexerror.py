"""Raises IndexError, not ValueError, for a num_tokens outside the table."""
CHECK = "minipaged.checks.spec_decode:check_truncate"
EXPECT = ["raised IndexError, not ValueError"]
HINT = "raise ValueError for a num_tokens outside 0..self.num_tokens"

from _base import GoodBlockTable


class MyBlockTable(GoodBlockTable):
    def check_range(self, num_tokens):
        if not 0 <= num_tokens <= self.num_tokens:
            raise IndexError(f"{num_tokens} is out of range")
