"""match_prefix() skips a block that is not cached and goes on (continue, not break): after an eviction in the middle
of a cached prefix, it returns a later block whose own hash is still cached, though the block before it is gone. Only
the story that evicts the middle block of a cached prefix catches it."""
CHECK = "minipaged.checks.prefix_cache:check_lookup_and_eviction"
EXPECT = ["match_prefix", "returned other blocks", "the middle of a cached prefix"]
HINT = "the match ends at the first block that is not cached"

from _base import GoodPrefixCache


class MyPrefixCache(GoodPrefixCache):
    def match_prefix(self, token_ids):
        usable = self.usable(token_ids)
        return [self.block_of[h] for h in self.chain(usable, len(usable) // self.block_size) if h in self.block_of]
