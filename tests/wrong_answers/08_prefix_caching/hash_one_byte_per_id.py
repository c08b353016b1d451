"""Packs each token id into one byte (`% 256`): fine for the small ids of a toy, a collision in a real vocabulary."""
CHECK = "minipaged.checks.prefix_cache:check_hash_chain"
EXPECT = ["token ids 256 apart", "every token id must go in whole"]
HINT = "one byte per id (bytes(ids), % 256) cannot tell 1 from 257"

import hashlib

from _base import GoodPrefixCache


class MyPrefixCache(GoodPrefixCache):
    def hash_block(self, parent, token_ids):
        return hashlib.sha256(parent + bytes(t % 256 for t in token_ids)).digest()
