"""Queues every request, also those that can never fit in the pool."""
CHECK = "minipaged.checks.scheduler:check_rejection"
EXPECT = ["accepted a request that can never run", "REJECTED", "return False"]

from _base import BaseScheduler


class MyScheduler(BaseScheduler):
    REJECT = False
