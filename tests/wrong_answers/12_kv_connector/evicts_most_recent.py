"""A full store evicts the most recently used block instead of the least recently used one."""
CHECK = "minipaged.checks.kv_connector:check_store"
EXPECT = ["returned another slot", "least recently used"]

from _base import GoodStore


class MyHostStore(GoodStore):
    def evict(self):
        self.num_evictions += 1
        return self.slot_of.popitem(last=True)[1]
