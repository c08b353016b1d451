"""Writes schedule() as a call of minipaged's own (super().schedule()): delegation, refused."""
CHECK = "minipaged.checks.scheduler:check_admission"
EXPECT = ["called minipaged.Scheduler.schedule", "minipaged's own implementation"]

from _base import BaseScheduler


class MyScheduler(BaseScheduler):
    def schedule(self):
        return super(BaseScheduler, self).schedule()
