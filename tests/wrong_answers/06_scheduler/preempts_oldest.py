"""Preempts the oldest running sequence instead of the most recently admitted one."""
CHECK = "minipaged.checks.scheduler:check_preemption"
EXPECT = ["differs", "self.running[-1]"]

from _base import BaseScheduler


class MyScheduler(BaseScheduler):
    VICTIM_NEWEST = False
