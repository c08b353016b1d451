"""Never sets out.num_batched_tokens (it stays 0)."""
CHECK = "minipaged.checks.scheduler:check_admission"
EXPECT = ["out.num_batched_tokens is wrong", "the sum of num_new_tokens"]

from _base import BaseScheduler


class MyScheduler(BaseScheduler):
    SET_BATCHED_TOKENS = False
