"""get_num_new_matched_tokens counts every stored block, also those after a block the store does not hold."""
CHECK = "minipaged.checks.kv_connector:check_connector"
EXPECT = ["returned another count", "stop at the first block"]

from _base import GoodConnector


class MyHostConnector(GoodConnector):
    def get_num_new_matched_tokens(self, seq, num_computed_tokens):
        hashes = self._hashes(seq)
        n = sum(1 for i in range(self.first_block(num_computed_tokens), self.usable_blocks(seq)) if hashes[i] in self.store)
        return n * self.block_size
