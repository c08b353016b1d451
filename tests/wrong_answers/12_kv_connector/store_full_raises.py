"""A full store raises instead of evicting: the request it was saving for fails."""
CHECK = "minipaged.checks.kv_connector:check_store"
EXPECT = ["raised instead of evicting", "never fails a request"]

from _base import GoodStore


class MyHostStore(GoodStore):
    def evict(self):
        raise MemoryError(f"the host store is full ({self.capacity} blocks)")
