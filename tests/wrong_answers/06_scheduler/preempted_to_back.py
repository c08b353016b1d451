"""Puts a preempted sequence at the back of the waiting queue instead of the front."""
CHECK = "minipaged.checks.scheduler:check_preemption"
EXPECT = ["FRONT of the waiting queue"]

from _base import BaseScheduler


class MyScheduler(BaseScheduler):
    PREEMPT_TO_FRONT = False
