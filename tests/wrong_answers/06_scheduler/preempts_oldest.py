"""Preempts the oldest running sequence instead of the most recently admitted one.

The message's replay line carries the check's seed (check_preemption plays seed 1), and the
picture's legend is neutral (it names no request that may not exist in the run shown).
"""
CHECK = "minipaged.checks.scheduler:check_preemption"
EXPECT = ["differs", "self.running[-1]", "seed=1)", "rID+N@P: request rID computes N new tokens"]
UNEXPECTED = ["r3+5@2"]

from _base import BaseScheduler


class MyScheduler(BaseScheduler):
    VICTIM_NEWEST = False
