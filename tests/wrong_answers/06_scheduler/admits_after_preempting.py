"""Admits waiting requests in a step that had to preempt (memory is short: it would only preempt again)."""
CHECK = "minipaged.checks.scheduler:check_preemption"
EXPECT = ["differs", "in a step that had to preempt, admit nobody"]

from _base import BaseScheduler


class MyScheduler(BaseScheduler):
    ADMIT_AFTER_PREEMPT = True
