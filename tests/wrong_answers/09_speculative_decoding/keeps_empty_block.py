"""Keeps num_tokens // block_size + 1 blocks: right inside a block, one block too many at a block boundary."""
CHECK = "minipaged.checks.spec_decode:check_truncate"
EXPECT = ["blocks differ", "fill exactly", "not num_tokens // block_size + 1"]
HINT = "a block left holding no slot goes back too"

from _base import GoodBlockTable


class MyBlockTable(GoodBlockTable):
    def keep(self, num_tokens):
        return num_tokens // self.block_size + 1
