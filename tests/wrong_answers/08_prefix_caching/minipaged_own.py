"""The learner hands in minipaged's own PrefixCache: the check must not grade the reference."""
CHECK = "minipaged.checks.prefix_cache:check_lookup_and_eviction"
EXPECT = ["is minipaged's own", "Write your own"]
HINT = None  # a refusal: the message says what to do, with no hint

from minipaged.prefix_cache import PrefixCache


class MyPrefixCache(PrefixCache):
    pass
