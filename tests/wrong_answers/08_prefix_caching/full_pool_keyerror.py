"""allocate() with no free and no evictable block pops an empty OrderedDict: KeyError, not OutOfBlocksError."""
CHECK = "minipaged.checks.prefix_cache:check_lookup_and_eviction"
EXPECT = ["every block held", "raised KeyError, not OutOfBlocksError"]
HINT = "when the inner pool has no free block and no cached block is evictable, raise OutOfBlocksError"

from _base import GoodPrefixCache


class MyPrefixCache(GoodPrefixCache):
    def allocate(self):
        if self.pool.num_free_blocks > 0:
            return self.pool.allocate()
        b, _ = self.evictable.popitem(last=False)
        del self.block_of[self.hash_of.pop(b)]
        self.num_evictions += 1
        return b
