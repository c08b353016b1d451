"""append_tokens() takes the right blocks but returns None instead of the new blocks."""
CHECK = "minipaged.checks.block_table:check_growth"
EXPECT = ["returned the wrong list of new blocks", "return the blocks this call took"]
HINT = "return the blocks this call took"

from _base import GoodBlockTable


class MyBlockTable(GoodBlockTable):
    def append_tokens(self, num_new_tokens=1):
        super().append_tokens(num_new_tokens)
