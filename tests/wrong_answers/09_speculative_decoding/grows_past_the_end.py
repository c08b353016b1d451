"""No range check: truncate(n) with n past the end sets num_tokens to n (slots it holds no block for)."""
CHECK = "minipaged.checks.spec_decode:check_truncate"
EXPECT = ["did not raise", "never grows the table"]
HINT = "a rollback only ever cuts the table back"

from _base import GoodBlockTable


class MyBlockTable(GoodBlockTable):
    def check_range(self, num_tokens):
        pass
