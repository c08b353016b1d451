"""Subclasses minipaged's Scheduler and overrides nothing: refused before anything runs."""
CHECK = "minipaged.checks.scheduler:check_admission"
EXPECT = ["MyScheduler.add_request is minipaged's own", "inherited from minipaged's Scheduler"]

from minipaged import Scheduler


class MyScheduler(Scheduler):
    pass
