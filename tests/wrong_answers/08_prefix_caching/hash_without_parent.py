"""hash_block hashes the block's tokens alone, without its parent's hash."""
CHECK = "minipaged.checks.prefix_cache:check_hash_chain"
EXPECT = ["two different parents", "include its parent's hash"]
HINT = "its hash must include its parent's hash"

import hashlib

from _base import GoodPrefixCache


class MyPrefixCache(GoodPrefixCache):
    def hash_block(self, parent, token_ids):
        return hashlib.sha256(str(list(token_ids)).encode()).digest()
