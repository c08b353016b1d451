"""Continuous batching: which sequences run this step, and how many new tokens each.

Owns the waiting and running queues, admission, preemption and rejection. It moves
``num_computed_tokens`` and block tables; it never runs the model or samples.

The one rule (vLLM V1): each step every scheduled sequence catches up
``num_computed_tokens`` towards ``num_tokens``, within a token budget. A fresh prompt
catches up many tokens (prefill), a running one catches up the single token it sampled
last step (decode), a long prompt over several steps (chunked prefill), and a preempted
one from zero (recompute). There is no separate code path for any of them.
"""
from __future__ import annotations

from collections import deque
from typing import Any

from .config import EngineConfig
from .data import FinishReason, ScheduledSeq, SchedulerOutput, Sequence, SequenceStatus
from .detokenizer import StopChecker
from .parts import cdiv, check_scheduler, fork_table, free_table  # noqa: F401 (check_scheduler: kept importable from here)
from .prefix_cache import PrefixStats, cache_computed_blocks, copy_on_write, num_cow_blocks
from .spec_decode import rollback


class Scheduler:
    """FCFS continuous batching over a paged KV pool.

    - running sequences are served first, oldest first;
    - waiting ones are admitted in order while the token budget, ``max_num_seqs`` and free
      blocks allow (no skipping ahead: the head of the queue cannot starve);
    - when a running sequence needs a block and none is free, the most recently admitted
      running sequence is preempted: its blocks are freed, ``num_computed_tokens`` reset to
      0, and it goes back to the front of the waiting queue to be recomputed later;
    - a request that could not fit even in an empty pool is rejected at once;
    - with prefix caching (the allocator is a prefix cache), an admitted sequence shares the
      cached blocks of its longest cached prefix and starts computing past them; blocks that
      become full are cached after each step; a sequence about to write into a block another
      table shares gets its own copy first (copy-on-write, listed in ``blocks_to_copy``);
    - parallel sampling: a prompt's samples (``seq.forks``) are forked from it, sharing its
      blocks, when its prompt is computed; each needs a seat under ``max_num_seqs`` from admission.

    ``add_request`` and ``schedule`` are the policy (the workbook has you write them);
    ``update``, ``finish`` and ``abort`` are the bookkeeping every policy shares.
    """

    # Non-default settings this class's schedule() handles (see interfaces.py).
    supports = frozenset({"chunked_prefill_off", "prefix_caching", "parallel_sampling", "speculative_decoding",
                          "beam_search", "sharing_fns"})
    # How tables share blocks (the engine's parts fork_table, copy_on_write and free_table replace them
    # on the instance; "sharing_fns" above says this schedule() calls them).
    fork_table = staticmethod(fork_table)
    copy_on_write = staticmethod(copy_on_write)
    free_table = staticmethod(free_table)

    def __init__(
        self, allocator: Any, block_table_cls: type | None = None, config: EngineConfig | None = None, **settings: Any
    ) -> None:
        """``settings`` (e.g. ``max_num_seqs=4``) are EngineConfig fields changed from ``config``."""
        if block_table_cls is None:
            from .block_table import BlockTable

            block_table_cls = BlockTable
        self.allocator = allocator
        self.block_table_cls = block_table_cls
        self.config = (config or EngineConfig()).replace(**settings) if settings else (config or EngineConfig())
        # the settings, by the names the policy uses (the config is frozen: read once)
        self.max_num_seqs: int = self.config.max_num_seqs
        self.max_num_batched_tokens: int = self.config.max_num_batched_tokens
        self.max_model_len: int | None = self.config.max_model_len
        self.enable_chunked_prefill: bool = self.config.enable_chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the last is preempted first
        self.num_preemptions = 0
        pc = self.config.enable_prefix_caching
        has_cache = hasattr(allocator, "match_prefix")
        if pc and not has_cache:
            raise ValueError(
                f"enable_prefix_caching=True needs a prefix cache as the allocator ({type(allocator).__name__} has no "
                "match_prefix): wrap the pool, e.g. PrefixCache(BlockAllocator(...)), or turn prefix caching off"
            )
        self.prefix_caching = has_cache if pc is None else pc
        self.prefix_stats = PrefixStats()

    # -- requests --------------------------------------------------------------------------
    def add_request(self, seq: Sequence) -> bool:
        """Queue ``seq``; return False (and mark it REJECTED with a reason) if it can never run."""
        reason = self._why_never_fits(seq)
        if reason is not None:
            seq.status = SequenceStatus.REJECTED
            seq.finish_reason = FinishReason.REJECTED
            seq.reject_reason = reason
            for f in seq.forks:  # parallel sampling: its samples go with it
                f.status, f.finish_reason, f.reject_reason = seq.status, seq.finish_reason, reason
            return False
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)
        return True

    def _why_never_fits(self, seq: Sequence) -> str | None:
        bs, pool = self.allocator.block_size, self.allocator.num_blocks
        if seq.num_prompt_tokens == 0:
            return "the prompt is empty: give at least one token"
        if seq.max_tokens < 1:
            return f"max_tokens must be >= 1, got {seq.max_tokens}"
        if self.max_model_len is not None and seq.num_prompt_tokens >= self.max_model_len:
            return (
                f"the prompt has {seq.num_prompt_tokens} tokens but the model's context is {self.max_model_len}: "
                "shorten the prompt"
            )
        if 1 + len(seq.forks) > self.max_num_seqs:
            return (f"asks for {1 + len(seq.forks)} samples (n) but max_num_seqs={self.max_num_seqs} sequences run at "
                    "once: lower n or raise max_num_seqs")
        total = seq.max_total_tokens
        if self.max_model_len is not None:
            total = min(total, self.max_model_len)
        need = cdiv(total, bs)
        group = getattr(seq, "beam", None)
        if group is not None:  # beam search: every beam may end up holding a whole copy (after a preemption)
            need = group.worst_case_blocks(bs)
            if need > pool:
                return (f"beam search with beam_width={group.params.beam_width} may need {need} KV blocks (each beam a "
                        f"whole copy of prompt {seq.num_prompt_tokens} + max_tokens {seq.max_tokens}, block size {bs}) "
                        f"but the whole pool has {pool}: lower beam_width or max_tokens, or give the engine a larger KV budget")
        if need > pool:
            return (
                f"needs {need} KV blocks (prompt {seq.num_prompt_tokens} + max_tokens {seq.max_tokens}, "
                f"block size {bs}) but the whole pool has {pool}: lower max_tokens or give the engine a larger KV budget"
            )
        # Without chunking, a preempted request is recomputed (prompt and output so far) in one
        # step, so the largest it can grow to must fit the budget, or it would wait forever.
        if not self.enable_chunked_prefill and total > self.max_num_batched_tokens:
            return (
                f"with chunked prefill off, a preempted request is recomputed in one step: up to {total} tokens "
                f"(prompt {seq.num_prompt_tokens} + max_tokens {seq.max_tokens} - 1), more than "
                f"max_num_batched_tokens={self.max_num_batched_tokens}: turn chunked prefill on, raise the budget "
                "or lower max_tokens"
            )
        return None

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step --------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens

        # 1. Running sequences first, oldest first.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            # speculative decoding: the same rule, with the drafts counted after the sequence's tokens
            drafts = seq.spec_token_ids
            n = min(seq.num_tokens + len(drafts) - seq.num_computed_tokens, budget)
            if n <= 0:  # a beam whose candidates wait for its siblings': nothing to compute this step
                i += 1
                continue
            table = seq.block_table
            start = seq.num_computed_tokens
            while table.blocks_needed(n) + num_cow_blocks(table, start, start + n) > self.allocator.num_free_blocks:
                if drafts:  # memory is short: give up the drafts before preempting anyone
                    drafts.clear()
                    n = min(seq.num_tokens - seq.num_computed_tokens, budget)
                    continue
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break  # it preempted itself: everyone after it is gone too
            del drafts[max(0, start + n - seq.num_tokens):]  # the drafts the budget left room for
            out.blocks_to_copy.extend(self.copy_on_write(table, start, start + n))
            table.append_tokens(n)
            out.scheduled.append(ScheduledSeq.of(seq, n))
            budget -= n
            i += 1

        # 2. Admit waiting sequences in arrival order (not in a step that had to preempt:
        #    memory is short, and admitting now would only preempt again).
        # a running prompt's samples not forked yet (parallel sampling) will need seats too
        seats = len(self.running) + sum(len(s.forks) for s in self.running)
        while not out.preempted and self.waiting and budget > 0 and seats < self.max_num_seqs:
            seq = self.waiting[0]
            if seats + 1 + len(seq.forks) > self.max_num_seqs:
                break
            table = self.block_table_cls(self.allocator)
            hit = self.allocator.match_prefix(seq.token_ids) if self.prefix_caching else []
            num_cached = len(hit) * self.allocator.block_size
            remaining = seq.num_tokens - num_cached
            if not self.enable_chunked_prefill and remaining > budget:
                break
            n = min(remaining, budget)
            revived = sum(1 for b in hit if self.allocator.ref_count(b) == 0)  # cached, held by nobody: counted as free
            if cdiv(num_cached + n, self.allocator.block_size) - len(hit) + revived > self.allocator.num_free_blocks:
                break
            if hit:  # share the cached prefix: its tokens count as computed
                for b in hit:
                    self.allocator.incref(b)
                table.blocks = list(hit)
                table.num_tokens = num_cached
            seq.num_computed_tokens = num_cached
            if self.prefix_caching:
                self.prefix_stats.queried_tokens += seq.num_tokens
                self.prefix_stats.hit_tokens += num_cached
            table.append_tokens(n)
            self.waiting.popleft()
            seq.block_table = table
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            seats += 1 + len(seq.forks)
            out.scheduled.append(ScheduledSeq.of(seq, n))
            budget -= n

        out.num_batched_tokens = self.max_num_batched_tokens - budget
        if not out.scheduled and self.waiting and any(getattr(q, "beam", None) is not None for q in self.running):
            return self._unblock_beams(out)
        return out

    def _unblock_beams(self, out: SchedulerOutput) -> SchedulerOutput:
        """Nothing ran, and beams hold blocks: every running sequence is a beam waiting for a
        sibling that waits for blocks they hold. Send them all back (each beam search's sequences
        together, in arrival order) and schedule again: the first search then fits the pool alone."""
        idle = list(self.running)
        if not all(getattr(q, "beam", None) is not None for q in idle):
            return out
        for q in reversed(idle):
            self._preempt(q)
        first: dict = {}
        for k, q in enumerate(self.waiting):
            first.setdefault(id(q.beam) if q.beam is not None else id(q), k)
        self.waiting = deque(sorted(self.waiting, key=lambda q: first[id(q.beam) if q.beam is not None else id(q)]))
        again = self.schedule()
        again.preempted = out.preempted + idle + again.preempted
        return again

    def update(self, out: SchedulerOutput, sampled: dict) -> list[Sequence]:
        """Apply a step's results: move ``num_computed_tokens``, append sampled tokens, finish.

        ``sampled`` maps seq_id -> token id for every scheduled sequence whose ``samples`` is
        True. The sequence's stop checker decides whether it is done. Returns the sequences that
        finished in this step (their blocks are already free), also kept in ``out.finished``.

        Speculative decoding: for a sequence that verified drafts, ``sampled`` holds the accepted
        run (a list: the kept drafts, then the target's token). The K/V of the rejected drafts is
        rolled back (the block table truncates, blocks left empty go back to the pool,
        ``num_computed_tokens`` follows), only verified full blocks are cached, and the run's
        tokens go to the stop checker one by one (a stop inside the run ends the request there).
        """
        for s in out.scheduled:
            seq = s.seq
            if seq.status is not SequenceStatus.RUNNING:
                continue  # finished or aborted while the step ran
            seq.num_computed_tokens += s.num_new_tokens
            run = sampled.get(seq.seq_id) if s.samples else None
            run = list(run) if isinstance(run, (list, tuple)) else None
            if run is not None or seq.num_computed_tokens > seq.num_tokens:
                # K/V stays for the sequence's tokens and the kept drafts (all but the run's last token)
                rollback(seq, seq.num_tokens + (len(run) - 1 if run else 0))
            if self.prefix_caching:
                cache_computed_blocks(self.allocator, seq.token_ids + (run[:-1] if run else []), seq.block_table.blocks,
                                      s.start, seq.num_computed_tokens)
            seq.spec_token_ids = []
            if not s.samples or getattr(seq, "beam", None) is not None:
                continue  # (a beam's token is chosen by its group, after this update)
            if seq.seq_id not in sampled:
                raise KeyError(f"no sampled token for sequence {seq.seq_id!r}, which finished its prefill this step")
            self._give_stop_checker(seq)
            if seq.forks:
                self._fork(seq, sampled, out)
            for token in run if run is not None else [sampled[seq.seq_id]]:
                seq.append_token(token)
                if seq.finish_reason is not None:
                    break
            if seq.finish_reason is not None:
                self.finish(seq, seq.finish_reason)
                out.finished.append(seq)
        return out.finished

    def _fork(self, seq: Sequence, sampled: dict, out: SchedulerOutput) -> None:
        """Parallel sampling: ``seq``'s prompt is computed; each pending sample gets a table that
        shares all its blocks (a write into a shared block is copied first), and its own token."""
        forks, seq.forks = seq.forks, []
        for f in forks:
            if f.is_finished:
                continue  # aborted meanwhile
            if f.seq_id not in sampled:
                raise KeyError(f"no sampled token for sample {f.seq_id!r} of {seq.seq_id!r}")
            f.block_table = self.fork_table(seq.block_table)
            f.num_computed_tokens = seq.num_computed_tokens
            f.status = SequenceStatus.RUNNING
            self.running.append(f)
            self._give_stop_checker(f)
            f.append_token(sampled[f.seq_id])
            if f.finish_reason is not None:
                self.finish(f, f.finish_reason)
                out.finished.append(f)

    def _give_stop_checker(self, seq: Sequence) -> None:
        """A sequence made without the engine (a test, a simulation) gets the default stop rule,
        its settings read from the sequence, when its first token is sampled."""
        if seq.stop_checker is None:
            seq.stop_checker = StopChecker.for_sequence(seq, max_model_len=self.max_model_len)

    # -- state changes ---------------------------------------------------------------------
    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        seq.block_table.free()
        seq.block_table = None
        seq.num_computed_tokens = 0
        seq.spec_token_ids = []
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence, reason: FinishReason = FinishReason.STOP) -> None:
        """End ``seq`` now (stop string, abort, ...) and free its blocks at once."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if seq.block_table is not None:
            seq.block_table.free()
            seq.block_table = None
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        for f in seq.forks:  # samples not forked yet end with it
            f.status, f.finish_reason = SequenceStatus.FINISHED, reason
        seq.forks = []

    def abort(self, seq_id) -> Sequence | None:
        for seq in list(self.running) + list(self.waiting):
            if seq.seq_id == seq_id:
                self.finish(seq, FinishReason.ABORT)
                return seq
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(running={len(self.running)}, waiting={len(self.waiting)}, preemptions={self.num_preemptions})"


__all__ = ["Scheduler", "ScheduledSeq", "SchedulerOutput"]
