"""Keeps num_tokens // block_size blocks: the partly filled last block is dropped with its slots."""
CHECK = "minipaged.checks.spec_decode:check_truncate"
EXPECT = ["blocks differ", "keep ceil(num_tokens / block_size) blocks", "not num_tokens // block_size."]
HINT = "the last block kept still holds"

from _base import GoodBlockTable


class MyBlockTable(GoodBlockTable):
    def keep(self, num_tokens):
        return num_tokens // self.block_size
