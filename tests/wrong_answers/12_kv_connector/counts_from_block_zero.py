"""get_num_new_matched_tokens counts from block 0, ignoring the device prefix cache's hit (num_computed_tokens)."""
CHECK = "minipaged.checks.kv_connector:check_connector"
EXPECT = ["returned another count", "AFTER them"]

from _base import GoodConnector


class MyHostConnector(GoodConnector):
    def first_block(self, num_computed_tokens):
        return 0
