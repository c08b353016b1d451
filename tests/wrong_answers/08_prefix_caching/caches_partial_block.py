"""cache_blocks also caches the partial last block, which is still being written."""
CHECK = "minipaged.checks.prefix_cache:check_lookup_and_eviction"
EXPECT = ["num_cached_blocks differs", "Only FULL blocks are cached"]
HINT = "Only FULL blocks are cached"

from _base import GoodPrefixCache


class MyPrefixCache(GoodPrefixCache):
    def num_full(self, token_ids, blocks):
        return min(-(-len(token_ids) // self.block_size), len(blocks))
