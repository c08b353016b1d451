"""A learner-style scheduler with switches for the classic mistakes (not a wrong answer itself)."""
from minipaged.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from minipaged.sequence import FinishReason, SequenceStatus


class BaseScheduler(Scheduler):
    CAP_BUDGET = True
    FREE_ON_PREEMPT = True
    REJECT = True
    VICTIM_NEWEST = True
    CHECK_MAX_SEQS = True
    ADMIT_AFTER_PREEMPT = False
    PREEMPT_TO_FRONT = True
    RESET_COMPUTED = True
    PROMPT_LIMIT_INCLUSIVE = True  # a prompt of max_model_len tokens or more is rejected
    REJECT_ON_FREE_BLOCKS = False  # compares with the free blocks instead of the whole pool
    SET_BATCHED_TOKENS = True
    SKIP_HEAD = False  # admit later arrivals when the head of the queue does not fit

    def add_request(self, seq):
        bs, pool = self.allocator.block_size, self.allocator.num_blocks
        total = seq.max_total_tokens if self.max_model_len is None else min(seq.max_total_tokens, self.max_model_len)
        why = None
        if seq.num_prompt_tokens == 0:
            why = "empty prompt"
        elif seq.max_tokens < 1:
            why = "max_tokens < 1"
        elif self.max_model_len is not None and (
                seq.num_prompt_tokens >= self.max_model_len if self.PROMPT_LIMIT_INCLUSIVE
                else seq.num_prompt_tokens > self.max_model_len):
            why = "prompt too long"
        elif -(-total // bs) > (self.allocator.num_free_blocks if self.REJECT_ON_FREE_BLOCKS else pool):
            why = "needs more blocks than the pool"
        if why and self.REJECT:
            seq.status, seq.finish_reason, seq.reject_reason = SequenceStatus.REJECTED, FinishReason.REJECTED, why
            return False
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)
        return True

    def schedule(self):
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = seq.num_tokens - seq.num_computed_tokens
            if self.CAP_BUDGET:
                n = min(n, budget)
            while seq.block_table.blocks_needed(n) > self.allocator.num_free_blocks:
                victim = self.running[-1] if self.VICTIM_NEWEST else self.running[0]
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
        while (not out.preempted or self.ADMIT_AFTER_PREEMPT) and self.waiting and budget > 0 and (
                len(self.running) < self.max_num_seqs or not self.CHECK_MAX_SEQS):
            seq = self.waiting[0]
            n = seq.num_tokens - seq.num_computed_tokens
            if self.CAP_BUDGET:
                n = min(n, budget)
            table = self.block_table_cls(self.allocator)
            if table.blocks_needed(n) > self.allocator.num_free_blocks:
                if self.SKIP_HEAD and len(self.waiting) > 1 and not getattr(self, "_skipping", False):
                    head = self.waiting.popleft()
                    self._skipping = True
                    try:
                        rest = self.schedule_waiting(out, budget)
                    finally:
                        self._skipping = False
                    self.waiting.appendleft(head)
                    budget = rest
                break
            table.append_tokens(n)
            self.waiting.popleft()
            seq.block_table, seq.status = table, SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq.of(seq, n))
            budget -= n
        if self.SET_BATCHED_TOKENS:
            out.num_batched_tokens = self.max_num_batched_tokens - budget
        return out

    def schedule_waiting(self, out, budget):
        """Admit from the waiting queue as schedule() does; returns the budget left (for SKIP_HEAD)."""
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            table = self.block_table_cls(self.allocator)
            if table.blocks_needed(n) > self.allocator.num_free_blocks:
                break
            table.append_tokens(n)
            self.waiting.popleft()
            seq.block_table, seq.status = table, SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq.of(seq, n))
            budget -= n
        return budget

    def _preempt(self, seq):
        self.running.remove(seq)
        if self.FREE_ON_PREEMPT:
            seq.block_table.free()
        seq.block_table = None
        if self.RESET_COMPUTED:
            seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        if self.PREEMPT_TO_FRONT:
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)
        self.num_preemptions += 1
