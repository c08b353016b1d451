"""Frees a dropped block until nobody holds it, also when a forked table still shares it."""
CHECK = "minipaged.checks.spec_decode:check_truncate"
EXPECT = ["the pool differs", "lost a reference that another table still holds"]
HINT = "lost a reference that another table still holds"

from _base import GoodBlockTable


class MyBlockTable(GoodBlockTable):
    def give_back(self, dropped):
        for b in reversed(dropped):
            while self.allocator.ref_count(b) > 0:
                self.allocator.free(b)
