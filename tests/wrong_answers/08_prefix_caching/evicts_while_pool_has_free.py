"""allocate() evicts a cached block although the inner pool still has never-cached free blocks."""
CHECK = "minipaged.checks.prefix_cache:check_lookup_and_eviction"
EXPECT = ["returned a different block", "a never-cached free block was available"]
UNEXPECTED = ["LEAST recently"]
HINT = "a never-cached free block was available"

from _base import GoodPrefixCache


class MyPrefixCache(GoodPrefixCache):
    def allocate(self):
        if self.evictable:
            b = self.evict()
            del self.block_of[self.hash_of.pop(b)]
            self.num_evictions += 1
            return b
        return super().allocate()
