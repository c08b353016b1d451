"""get_num_new_matched_tokens counts the block holding the prompt's last token, which must be recomputed."""
CHECK = "minipaged.checks.kv_connector:check_connector"
EXPECT = ["returned another count", "never the last token"]

from _base import GoodConnector


class MyHostConnector(GoodConnector):
    def usable_blocks(self, seq):
        return seq.num_tokens // self.block_size
