"""ref_count(b) includes the cache's own hold on a cached block."""
CHECK = "minipaged.checks.prefix_cache:check_lookup_and_eviction"
EXPECT = ["ref counts differ", "cache's own hold"]
HINT = "is not one of them: subtract it"

from _base import GoodPrefixCache


class MyPrefixCache(GoodPrefixCache):
    def ref_count(self, b):
        return self.pool.ref_count(b)

    def free(self, b):
        if self.pool.ref_count(b) - (1 if b in self.hash_of else 0) == 0:
            raise ValueError("double free")
        self.pool.free(b)
        if b in self.hash_of and self.pool.ref_count(b) == 1:
            self.evictable[b] = None
