"""Admits a whole prompt even when it is longer than the token budget left this step."""
CHECK = "minipaged.checks.scheduler:check_admission"
EXPECT = ["more than max_num_batched_tokens=8", "admitting past the token budget", "min(remaining, budget)"]

from _base import BaseScheduler


class MyScheduler(BaseScheduler):
    CAP_BUDGET = False
