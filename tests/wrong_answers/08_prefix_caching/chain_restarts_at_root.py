"""The chain passes ROOT_HASH as every block's parent: a block is found by its tokens alone."""
CHECK = "minipaged.checks.prefix_cache:check_lookup_and_eviction"
EXPECT = ["match_prefix", "must chain from block i-1's hash"]
HINT = "must chain from block i-1's hash"

from _base import GoodPrefixCache
from minipaged.prefix_cache import ROOT_HASH


class MyPrefixCache(GoodPrefixCache):
    def chain(self, token_ids, n_blocks):
        bs = self.block_size
        return [self.hash_block(ROOT_HASH, token_ids[i * bs : (i + 1) * bs]) for i in range(n_blocks)]
