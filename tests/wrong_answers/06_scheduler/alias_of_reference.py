"""minipaged's own Scheduler under the learner's name: refused."""
CHECK = "minipaged.checks.scheduler:check_preemption"
EXPECT = ["is minipaged's own minipaged.scheduler.Scheduler"]

from minipaged import Scheduler as MyScheduler  # noqa: F401
