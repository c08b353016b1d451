"""The learner hands in minipaged's own PrefixCache: the check must not grade the reference."""
CHECK = "minipaged.checks.prefix_cache:check_lookup_and_eviction"
EXPECT = ["is minipaged's own", "Write your own"]

from minipaged.prefix_cache import PrefixCache


class MyPrefixCache(PrefixCache):
    pass
