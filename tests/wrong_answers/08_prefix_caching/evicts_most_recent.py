"""allocate() evicts the most recently released cached block instead of the least recently released."""
CHECK = "minipaged.checks.prefix_cache:check_lookup_and_eviction"
EXPECT = ["returned a different block", "LEAST recently"]
UNEXPECTED = ["never-cached free block was available"]  # the cause is the order, not handing out cached blocks early
HINT = "evict the cached block released LEAST recently"

from _base import GoodPrefixCache


class MyPrefixCache(GoodPrefixCache):
    def evict(self):
        b, _ = self.evictable.popitem()
        return b
