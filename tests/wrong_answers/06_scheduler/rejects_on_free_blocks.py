"""Rejects a request that needs more blocks than are FREE now, instead of more than the whole pool."""
CHECK = "minipaged.checks.scheduler:check_rejection"
EXPECT = ["rejected a request that fits", "The free blocks right now do not matter"]

from _base import BaseScheduler


class MyScheduler(BaseScheduler):
    REJECT_ON_FREE_BLOCKS = True
