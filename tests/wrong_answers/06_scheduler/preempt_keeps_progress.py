"""Keeps num_computed_tokens of a preempted sequence, although its KV went with its blocks."""
CHECK = "minipaged.checks.scheduler:check_preemption"
EXPECT = ["num_computed_tokens goes back to 0"]

from _base import BaseScheduler


class MyScheduler(BaseScheduler):
    RESET_COMPUTED = False
