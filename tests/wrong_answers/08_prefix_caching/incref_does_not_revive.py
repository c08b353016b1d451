"""incref() of a cached block that no table holds (a hit) does not take it out of the evictable blocks: it is counted
free while a table holds it, and could be evicted under that table."""
CHECK = "minipaged.checks.prefix_cache:check_lookup_and_eviction"
EXPECT = ["num_free_blocks differs after c.incref"]
HINT = "a hit revives an evictable block"

from _base import GoodPrefixCache


class MyPrefixCache(GoodPrefixCache):
    def incref(self, b):
        self.pool.incref(b)  # forgot: self.evictable.pop(b, None)
