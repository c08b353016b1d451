"""Stops serving the running queue while one token of budget is left (`budget > 1`): a decode waits for nothing."""
CHECK = "minipaged.checks.scheduler:check_admission"
EXPECT = ["a token budget smaller than the running batch"]

from minipaged.scheduler import ScheduledSeq, SchedulerOutput
from minipaged.sequence import SequenceStatus

from _base import BaseScheduler


class MyScheduler(BaseScheduler):
    def schedule(self):
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 1:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while seq.block_table.blocks_needed(n) > self.allocator.num_free_blocks:
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break
            seq.block_table.append_tokens(n)
            out.scheduled.append(ScheduledSeq.of(seq, n))
            budget -= n
            i += 1
        while not out.preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            table = self.block_table_cls(self.allocator)
            if table.blocks_needed(n) > self.allocator.num_free_blocks:
                break
            table.append_tokens(n)
            self.waiting.popleft()
            seq.block_table = table
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq.of(seq, n))
            budget -= n
        out.num_batched_tokens = self.max_num_batched_tokens - budget
        return out
