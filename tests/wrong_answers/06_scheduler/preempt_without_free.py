"""Preempts a sequence but drops its block table without giving the blocks back."""
CHECK = "minipaged.checks.scheduler:check_preemption"
EXPECT = ["preempting without freeing", "seq.block_table.free()"]

from _base import BaseScheduler


class MyScheduler(BaseScheduler):
    FREE_ON_PREEMPT = False
