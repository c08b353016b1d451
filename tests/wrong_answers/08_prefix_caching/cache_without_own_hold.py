"""cache_blocks() remembers the hashes but takes no reference of its own (no self.pool.incref), while ref_count still
subtracts the cache's hold: a cached block shows one holder too few."""
CHECK = "minipaged.checks.prefix_cache:check_lookup_and_eviction"
EXPECT = ["ref counts differ after c.cache_blocks"]
HINT = "takes one reference of its own"

from _base import GoodPrefixCache


class MyPrefixCache(GoodPrefixCache):
    def cache_blocks(self, token_ids, blocks):
        for i, h in enumerate(self.chain(token_ids, self.num_full(token_ids, blocks))):
            b = blocks[i]
            if h in self.block_of or b in self.hash_of:
                continue
            self.block_of[h], self.hash_of[b] = b, h  # forgot: self.pool.incref(b)
