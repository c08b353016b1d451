"""Admits waiting requests without looking at max_num_seqs."""
CHECK = "minipaged.checks.scheduler:check_admission"
EXPECT = ["max_num_seqs=2", "len(self.running) < self.max_num_seqs"]

from _base import BaseScheduler


class MyScheduler(BaseScheduler):
    CHECK_MAX_SEQS = False
