"""truncate that hands the work to minipaged's own rollback (minipaged.spec_decode.truncate_table) on a
plain BlockTable holding the same blocks, and takes the result back."""
CHECK = "minipaged.checks.spec_decode:check_truncate"
EXPECT = ["called minipaged.spec_decode.truncate_table", "minipaged's own implementation"]
HINT = None  # a refusal: the message says what to do, with no hint

from minipaged import BlockTable, spec_decode
from _base import GoodBlockTable


class MyBlockTable(GoodBlockTable):
    def truncate(self, num_tokens):
        plain = BlockTable(self.allocator)
        plain.blocks, plain.num_tokens = list(self.blocks), self.num_tokens
        spec_decode.truncate_table(plain, num_tokens)
        self.blocks, self.num_tokens = plain.blocks, plain.num_tokens
