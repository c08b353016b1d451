"""save_kv saves the block a step wrote into, full or not: in a prefill in chunks, a block whose tokens are all
known is saved before its K/V is all computed (and never saved again)."""
CHECK = "minipaged.checks.kv_connector:check_connector"
EXPECT = ["device KV cache differs", "saved before it was full"]

from _base import GoodConnector


class MyHostConnector(GoodConnector):
    def filled(self, sch):
        end = min(sch.start + sch.num_new_tokens, sch.seq.num_tokens)
        return range(sch.start // self.block_size, min(-(-end // self.block_size), sch.seq.num_tokens // self.block_size))
