"""hash_block is right, but match_prefix and cache_blocks first store the token ids in a uint16 array ("to save
memory"): an id above 65,535 wraps onto another (70000 -> 4464), so a prompt is matched to another prompt's block. The
hash-chain check calls hash_block directly and passes; only the lookup story with ids and their 16-bit aliases catches it."""
CHECK = "minipaged.checks.prefix_cache:check_lookup_and_eviction"
EXPECT = ["match_prefix", "returned other blocks", "16-bit aliases"]
HINT = "are equal modulo 65,536"

import numpy as np

from _base import GoodPrefixCache


class MyPrefixCache(GoodPrefixCache):
    def chain(self, token_ids, n_blocks):
        return super().chain(np.asarray(list(token_ids)).astype(np.uint16).tolist(), n_blocks)
