"""Preempts correctly but never counts it: seq.num_preemptions and the scheduler's num_preemptions stay 0."""
CHECK = "minipaged.checks.scheduler:check_preemption"
EXPECT = ["num_preemptions", "adds 1 to"]

from minipaged.sequence import SequenceStatus

from _base import BaseScheduler


class MyScheduler(BaseScheduler):
    def _preempt(self, seq):
        self.running.remove(seq)
        seq.block_table.free()
        seq.block_table = None
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
