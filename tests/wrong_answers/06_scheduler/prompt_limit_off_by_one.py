"""Rejects a prompt only when it is LONGER than max_model_len: a prompt of exactly max_model_len tokens leaves no room to generate."""
CHECK = "minipaged.checks.scheduler:check_rejection"
EXPECT = ["accepted a request that can never run", "the model's context is"]

from _base import BaseScheduler


class MyScheduler(BaseScheduler):
    PROMPT_LIMIT_INCLUSIVE = False
