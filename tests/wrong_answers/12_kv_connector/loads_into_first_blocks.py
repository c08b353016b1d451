"""update_state_after_alloc takes the FIRST blocks of block_ids as its own: it loads over the device hit, into the wrong blocks."""
CHECK = "minipaged.checks.kv_connector:check_connector"
EXPECT = ["device KV cache differs after start_load_kv", "only the LAST"]
UNEXPECTED = ["saved before it was full"]

from _base import GoodConnector


class MyHostConnector(GoodConnector):
    def my_blocks(self, block_ids, n):
        return range(n)
