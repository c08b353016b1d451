"""Uses Python's hash() of a tuple: equal within one process, different in the next (bytes are salted)."""
CHECK = "minipaged.checks.prefix_cache:check_hash_chain"
EXPECT = ["called Python's hash()", "from one process to the next", "hashlib.sha256"]
HINT = None  # a refusal: the message says what to do, with no hint

from _base import GoodPrefixCache


class MyPrefixCache(GoodPrefixCache):
    def hash_block(self, parent, token_ids):
        return hash((parent, tuple(token_ids))).to_bytes(8, "little", signed=True)
