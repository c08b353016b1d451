"""allocate() evicts the least recently released block but forgets to drop its hash: the block handed out is still
"cached", so ref_count subtracts a hold the cache no longer has."""
CHECK = "minipaged.checks.prefix_cache:check_lookup_and_eviction"
EXPECT = ["after c.allocate()", "evict"]
HINT = "drop its hash when you evict it"

from minipaged import OutOfBlocksError

from _base import GoodPrefixCache


class MyPrefixCache(GoodPrefixCache):
    def allocate(self):
        if self.pool.num_free_blocks > 0:
            return self.pool.allocate()
        if not self.evictable:
            raise OutOfBlocksError("full")
        b = self.evict()  # forgot: del self.block_of[self.hash_of.pop(b)]
        self.num_evictions += 1
        return b
