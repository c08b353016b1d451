"""New blocks take the highest free slot first, not the lowest."""
CHECK = "minipaged.checks.kv_connector:check_store"
EXPECT = ["returned another slot", "lowest free slot"]

from _base import GoodStore


class MyHostStore(GoodStore):
    def free_slot(self):
        return self.free_slots.pop()
