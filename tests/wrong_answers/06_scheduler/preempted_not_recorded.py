"""Preempts the right sequence but forgets out.preempted.append(victim): the hint must name out.preempted,
not tell the learner to preempt self.running[-1], which the code already does."""
CHECK = "minipaged.checks.scheduler:check_preemption"
EXPECT = ["out.preempted is empty", "you preempted the right sequence"]
UNEXPECTED = ["preempt self.running[-1]"]

from minipaged.scheduler import ScheduledSeq, SchedulerOutput
from minipaged.sequence import SequenceStatus

from _base import BaseScheduler


class MyScheduler(BaseScheduler):
    def schedule(self):
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while seq.block_table.blocks_needed(n) > self.allocator.num_free_blocks:
                victim = self.running[-1]
                self._preempt(victim)  # out.preempted.append(victim) forgotten
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
