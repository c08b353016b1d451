"""Packs each token id into two bytes (`% 65536`, as a uint16 would): fine up to 65,535, a collision in a vocabulary of
150,000. Only the hash-chain case of ids 65,536 apart catches it (1 and 257 differ in two bytes)."""
CHECK = "minipaged.checks.prefix_cache:check_hash_chain"
EXPECT = ["token ids 65,536 apart", "every token id must go in whole"]
HINT = "two bytes per id cannot tell 4464 from 70000"

import hashlib
import struct

from _base import GoodPrefixCache


class MyPrefixCache(GoodPrefixCache):
    def hash_block(self, parent, token_ids):
        return hashlib.sha256(parent + b"".join(struct.pack("<H", t % 65536) for t in token_ids)).digest()
