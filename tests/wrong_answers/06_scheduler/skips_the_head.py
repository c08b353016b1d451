"""When the head of the waiting queue does not fit, admits the requests behind it (the head could starve)."""
CHECK = "minipaged.checks.scheduler:check_admission"
EXPECT = ["differs", "first come, first served"]

from _base import BaseScheduler


class MyScheduler(BaseScheduler):
    SKIP_HEAD = True
