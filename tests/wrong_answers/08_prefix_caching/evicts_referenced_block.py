"""allocate() evicts the oldest cached block even while a block table still holds it."""
CHECK = "minipaged.checks.prefix_cache:check_lookup_and_eviction"
EXPECT = ["returned a different block", "still held by", "only a cached block at ref count 0 may be evicted"]
HINT = "only a cached block at ref count 0 may be evicted"

from _base import GoodPrefixCache
from minipaged import OutOfBlocksError


class MyPrefixCache(GoodPrefixCache):
    def allocate(self):
        if self.pool.num_free_blocks > 0:
            return self.pool.allocate()
        if not self.hash_of:
            raise OutOfBlocksError("full")
        b = next(iter(self.hash_of))  # the first block ever cached, held or not
        self.evictable.pop(b, None)
        del self.block_of[self.hash_of.pop(b)]
        self.num_evictions += 1
        return b
