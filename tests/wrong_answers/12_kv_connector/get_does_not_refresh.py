"""get() of a stored block does not make it the most recently used: a hit block is evicted as if unused."""
CHECK = "minipaged.checks.kv_connector:check_store"
EXPECT = ["most recently used"]

from _base import GoodStore


class MyHostStore(GoodStore):
    def get(self, h):
        return self.slot_of.get(h)
