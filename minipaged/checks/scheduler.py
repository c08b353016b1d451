"""Checks for workbook 06: a learner's scheduler against minipaged.Scheduler.

Both schedulers get their own pool and the same requests, arriving at the same steps; a
fake model samples the same tokens for both (EOS now and then, depending on the run's seed).
The fixed stories ignore EOS, so each of their requests generates exactly max_tokens and
what the story's label promises (who outgrows the pool, who is preempted) happens whatever
the seed. After every add_request, schedule() and update() the check compares what was
scheduled, who was preempted, both queues, every sequence's progress and blocks, and the
pool. The first difference stops it with a side-by-side picture of the two schedulers, a
hint, and a replay line (with the run's seed) that rebuilds both schedulers.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from ..block_allocator import BlockAllocator
from ..block_table import BlockTable
from ..scheduler import Scheduler, SchedulerOutput
from ..sequence import Sequence, SequenceStatus
from ._core import (
    length_situations,
    DEFAULT_TIMEOUT_S,
    SITUATIONS,
    CheckFailed,
    builds,
    failure,
    fmt_list,
    learner_call,
    passed,
    table,
)
from ._delegation import refuse_package_class, run_guarded

NAME = "06 scheduler"
MUST_WRITE = ("add_request", "schedule")  # update, finish, abort are inherited: the contract, not the policy
EOS = 2

# The situations of the scheduler's rules that _core's names do not cover (issue 40).
SITUATIONS.update({
    "whole pool": "a request that needs exactly every block of the pool: it fits, though it waits for all of them",
    "max_num_seqs reached": "as many sequences running as max_num_seqs allows, with more waiting",
    "head does not fit": "the head of the waiting queue does not fit the free blocks while a request behind it would",
    "budget runs out among the running": "a token budget no larger than the running sequences need, so serving "
                                         "self.running uses it up, to its last token",
    "room after a preemption": "a step that preempted yet left budget, a seat and free blocks for the head of the "
                               "waiting queue",
    "preempted before others waiting": "a sequence preempted while other requests wait, so the front and the back "
                                       "of the waiting queue differ",
})


def _token(seed: int, rid: int, n: int) -> int:
    """The fake model: a deterministic next token for request ``rid`` holding ``n`` tokens."""
    x = (seed * 1_000_003 + rid * 7_919 + n * 104_729) % 9_973
    return EOS if x % 11 == 0 else 3 + x % 97


@dataclass
class Config:
    num_blocks: int
    block_size: int
    max_num_seqs: int
    budget: int
    max_model_len: int | None = None

    def describe(self, cls_name: str) -> str:
        mml = f", max_model_len={self.max_model_len}" if self.max_model_len else ""
        return (f"{cls_name}(BlockAllocator(num_blocks={self.num_blocks}, block_size={self.block_size}), BlockTable, "
                f"max_num_seqs={self.max_num_seqs}, max_num_batched_tokens={self.budget}{mml})")


def make_scheduler(cls: type, cfg: Config, pool=None):
    """``cls`` built the way the engine builds its scheduler, on ``pool`` (a fresh one of ``cfg``'s size)."""
    import inspect

    pool = pool if pool is not None else BlockAllocator(cfg.num_blocks, cfg.block_size)
    if "config" in inspect.signature(cls.__init__).parameters:  # scheduler_cls(allocator, block_table_cls, config)
        from ..config import EngineConfig

        config = EngineConfig(block_size=cfg.block_size, num_blocks=cfg.num_blocks, max_num_seqs=cfg.max_num_seqs,
                              max_num_batched_tokens=cfg.budget, max_model_len=cfg.max_model_len)
        return cls(pool, BlockTable, config)
    return cls(pool, BlockTable, max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.budget,
               max_model_len=cfg.max_model_len)


def _sid(seq) -> str:
    return f"r{seq.seq_id}"



class _Sim:
    def __init__(self, cls: type, cfg: Config, label: str, seed: int, stats: dict, ignore_eos: bool = False) -> None:
        self.cls, self.cfg, self.label, self.seed, self.stats = cls, cfg, label, seed, stats
        self.ignore_eos = ignore_eos  # the fixed stories: every request generates exactly max_tokens
        self.ref = make_scheduler(Scheduler, cfg)
        self.stats["current"] = f"{cfg.describe(cls.__name__)}  ({label})"
        # The check keeps its own handle on your scheduler's pool: it reads only SchedulerProtocol's members of yours.
        self.my_pool = BlockAllocator(cfg.num_blocks, cfg.block_size)
        self.mine = learner_call(make_scheduler, cls, cfg, self.my_pool, what=cfg.describe(cls.__name__))
        self.ref_seqs: dict[int, Sequence] = {}
        self.my_seqs: dict[int, Sequence] = {}
        self.requests: list[str] = []
        self.history: list[str] = []
        self.step_no = 0
        self.checking = True  # replay() turns the comparisons off
        self.in_step = False

    # -- story -----------------------------------------------------------------------------
    def story(self, steps: int = 6) -> str:
        lines = [f"Run: {self.label}.", f"sched = {self.cfg.describe(self.cls.__name__)}", "Requests:"]
        lines += [f"    {r}" for r in self.requests]
        if self.history:
            shown = self.history[-steps:]
            if len(self.history) > steps:
                lines.append(f"... {len(self.history) - steps} earlier step(s) matched the reference ...")
            lines += shown
        if self.in_step:
            steps, when = self.step_no - 1, f"just before step {self.step_no}"
        else:
            steps, when = self.step_no, f"after the add_request calls before step {self.step_no + 1}"
        lines.append(f"To replay: from minipaged.checks import scheduler as sc\n"
                     f"    mine, ref = sc.replay({self.cls.__name__}, {self.label!r}, steps={steps}, seed={self.seed})"
                     f"  # both schedulers {when}")
        return "\n".join(lines)

    def call(self, fn, *args, what: str):
        self.stats["current"] = f"{what} at step {self.step_no}  ({self.label})"
        return learner_call(fn, *args, what=what, context=self.story)

    def fail(self, title: str, **kw) -> CheckFailed:
        return failure(f"{NAME}: {title}", done=self.story(), **kw)

    # -- pictures --------------------------------------------------------------------------
    @staticmethod
    def _sched_text(out) -> str:
        if out is None:
            return "-"
        items = [f"{_sid(s.seq)}+{s.num_new_tokens}@{s.start}" for s in out.scheduled]
        return " ".join(items) or "(nothing)"

    def picture(self, out_r=None, out_m=None) -> str:
        def ids(q):
            return fmt_list(_sid(s) for s in q)

        def seqs(side: dict):
            return " ".join(f"{_sid(s)}:{s.num_computed_tokens}/{s.num_tokens}" for s in side.values() if not s.is_finished) or "-"

        rows = [["", "reference (expected)", "yours"]]
        if out_r is not None or out_m is not None:
            rows.append(["scheduled", self._sched_text(out_r), self._sched_text(out_m)])
            rows.append(["preempted", fmt_list(_sid(s) for s in out_r.preempted) if out_r else "-",
                         fmt_list(_sid(s) for s in getattr(out_m, "preempted", [])) if out_m is not None else "-"])
        rows += [
            ["running", ids(self.ref.running), ids(self.mine.running)],
            ["waiting", ids(self.ref.waiting), ids(self.mine.waiting)],
            ["computed/tokens", seqs(self.ref_seqs), seqs(self.my_seqs)],
            ["free blocks", f"{self.ref.allocator.num_free_blocks} of {self.cfg.num_blocks}",
             f"{self.my_pool.num_free_blocks} of {self.cfg.num_blocks}"],
        ]
        w = [max(len(r[i]) for r in rows) for i in range(3)]
        body = "\n".join("    " + r[0].ljust(w[0]) + "   " + r[1].ljust(w[1]) + "   " + r[2] for r in rows)
        return body + ("\n    (rID+N@P: request rID computes N new tokens this step, positions P .. P+N-1; "
                       "computed/tokens: rID:num_computed_tokens/num_tokens)")

    # -- requests --------------------------------------------------------------------------
    def add(self, rid: int, prompt_len: int, max_tokens: int) -> None:
        prompt = [3 + (rid * 31 + i * 17) % 97 for i in range(prompt_len)]
        r = Sequence(rid, prompt, max_tokens=max_tokens, eos_token_ids=(EOS,), ignore_eos=self.ignore_eos)
        m = Sequence(rid, prompt, max_tokens=max_tokens, eos_token_ids=(EOS,), ignore_eos=self.ignore_eos)
        self.ref_seqs[rid], self.my_seqs[rid] = r, m
        self.builds_request(r)
        exactly = ", ignore_eos (generates exactly max_tokens)" if self.ignore_eos else ""
        self.requests.append(f"r{rid}: prompt of {prompt_len} tokens, max_tokens={max_tokens}{exactly}, "
                             f"arrives before step {self.step_no + 1}")
        exp = self.ref.add_request(r)
        what = f"sched.add_request(r{rid})"
        got = self.call(self.mine.add_request, m, what=what)
        self.stats["ops"] += 1
        if not self.checking:
            return
        bs = self.cfg.block_size
        if got is not exp:
            if not exp:
                raise self.fail(f"{what} accepted a request that can never run.",
                                expected=f"False, with status REJECTED: the reference's reason: {r.reject_reason}",
                                got=f"{got!r}",
                                hint="reject at once what could never fit, instead of letting it wait forever at the head of "
                                     "the queue (blocking everyone behind it): set seq.status = SequenceStatus.REJECTED, "
                                     "seq.finish_reason = FinishReason.REJECTED, seq.reject_reason = '<why, and what to "
                                     "change>', and return False. It needs ceil(min(seq.max_total_tokens, max_model_len) / "
                                     "block_size) blocks; compare that with the whole pool, not with the free blocks.")
            total = r.max_total_tokens if self.cfg.max_model_len is None else min(r.max_total_tokens, self.cfg.max_model_len)
            raise self.fail(f"{what} rejected a request that fits.",
                            expected=f"True: it needs at most ceil({total} / {bs}) = {-(-total // bs)} of the pool's "
                                     f"{self.cfg.num_blocks} blocks (prompt {prompt_len} + max_tokens {max_tokens} - 1 = "
                                     f"{r.max_total_tokens} tokens of KV: the last sampled token is never fed back)",
                            got=f"{got!r}" + (f" (your reason: {m.reject_reason})" if m.reject_reason else ""),
                            hint="use seq.max_total_tokens (prompt + max_tokens - 1) and round up to whole blocks; a request "
                                 "that needs exactly the whole pool still fits. The free blocks right now do not matter: "
                                 "it may wait.")
        if not exp:
            if m.status is not SequenceStatus.REJECTED or m.finish_reason is None or not m.reject_reason:
                raise self.fail(f"{what} returned False but did not mark the request.",
                                expected="status REJECTED, finish_reason FinishReason.REJECTED, reject_reason a sentence",
                                got=f"status {m.status}, finish_reason {m.finish_reason}, reject_reason {m.reject_reason!r}",
                                hint="the engine reports reject_reason to the user: say why and what to change.")
        self.compare_state(f"{what}")

    def builds_request(self, seq: Sequence) -> None:
        """The situations ``seq`` puts add_request in: a case of the rule, or an edge of the whole pool."""
        mml = self.cfg.max_model_len
        if seq.num_prompt_tokens == 0 or seq.max_tokens < 1:
            builds("empty")
            return
        if mml is not None and max(seq.num_prompt_tokens, seq.max_total_tokens) >= mml:
            builds("max_model_len")
            if seq.num_prompt_tokens >= mml:
                return  # rejected for the prompt: the pool is never asked
        total = seq.max_total_tokens if mml is None else min(seq.max_total_tokens, mml)
        edge = total - self.cfg.num_blocks * self.cfg.block_size  # tokens past what the whole pool holds
        if edge == 0:
            builds("whole pool", "block boundary")
        elif edge == -1:
            builds("just below a boundary")
        elif edge == 1:
            builds("just above a boundary")

    # -- one step --------------------------------------------------------------------------
    def builds_before(self) -> None:
        """The situations the reference's state puts this step's schedule() in."""
        running = self.ref.running
        if running and self.ref.allocator.num_free_blocks == 0:
            builds("full pool")
        if len(running) > 1 and sum(s.num_tokens - s.num_computed_tokens for s in running) >= self.cfg.budget:
            builds("budget runs out among the running")

    def builds_after(self, out: SchedulerOutput) -> None:
        """The situations of what the reference's schedule() just did (update() has not moved anything yet)."""
        cfg, ref = self.cfg, self.ref
        bs, free, left = cfg.block_size, ref.allocator.num_free_blocks, cfg.budget - out.num_batched_tokens
        if not out.scheduled:
            builds("empty")
        for s in out.scheduled:
            builds(*length_situations(s.start + s.num_new_tokens, bs))
            if s.start + s.num_new_tokens < s.seq.num_tokens:
                builds("budget remainder")  # a chunk: the budget left less than the sequence needs

        def fits(q: Sequence) -> bool:  # its first chunk's blocks, as admission counts them
            return -(-min(q.num_tokens - q.num_computed_tokens, left) // bs) <= free

        waiting = list(ref.waiting)
        seat = len(ref.running) < cfg.max_num_seqs
        if waiting and not seat:
            builds("max_num_seqs reached")
        if out.preempted:
            builds("preemption")
            if len(waiting) > len(out.preempted):
                builds("preempted before others waiting")
            if seat and left > 0 and fits(waiting[0]):
                builds("room after a preemption")
        elif seat and left > 0 and waiting and not fits(waiting[0]) and any(fits(q) for q in waiting[1:]):
            builds("head does not fit")

    def step(self) -> bool:
        self.step_no += 1
        self.in_step = True
        self.builds_before()
        out_r = self.ref.schedule()
        self.builds_after(out_r)
        out_m = self.call(self.mine.schedule, what="sched.schedule()")
        self.stats["ops"] += 1
        if self.checking:
            self.compare_out(out_r, out_m)
        sampled = {s.seq.seq_id: _token(self.seed, s.seq.seq_id, s.seq.num_tokens) for s in out_r.scheduled if s.samples}
        fin_r = self.ref.update(out_r, sampled)
        my_sampled = {k: v for k, v in sampled.items()}
        fin_m = self.call(self.mine.update, out_m, my_sampled, what="sched.update(out, sampled)")
        eos = "EOS (ignored)" if self.ignore_eos else "EOS"
        note = " ".join(f"{_sid(self.ref_seqs[k])}->{eos if v == EOS else v}" for k, v in sampled.items())
        fins = " ".join(f"{_sid(s)} finished ({s.finish_reason.value})" for s in fin_r)
        pre = " ".join(_sid(s) for s in out_r.preempted)
        self.history.append(f"step {self.step_no}: scheduled {self._sched_text(out_r)}"
                            + (f"; preempted {pre}" if pre else "") + (f"; sampled {note}" if note else "")
                            + (f"; {fins}" if fins else ""))
        if self.checking:
            self.compare_state(f"sched.update(...) after step {self.step_no}")
        self.in_step = False
        return self.ref.has_unfinished()

    # -- comparisons -----------------------------------------------------------------------
    def compare_out(self, out_r: SchedulerOutput, out_m) -> None:
        title = f"step {self.step_no}: sched.schedule()"
        if not isinstance(out_m, SchedulerOutput):
            raise self.fail(f"{title} returned {type(out_m).__name__}, not a SchedulerOutput.",
                            hint="build out = SchedulerOutput(), append ScheduledSeq.of(seq, num_new_tokens) to "
                                 "out.scheduled and preempted sequences to out.preempted, set out.num_batched_tokens, return out.")
        exp = [(s.seq.seq_id, s.num_new_tokens, s.start) for s in out_r.scheduled]
        try:
            got = [(s.seq.seq_id, s.num_new_tokens, s.start) for s in out_m.scheduled]
        except AttributeError as e:
            raise self.fail(f"{title}: out.scheduled must hold ScheduledSeq records (ScheduledSeq.of(seq, num_new_tokens)).",
                            got=str(e), hint="from minipaged.scheduler import ScheduledSeq") from None
        exp_pre = [s.seq_id for s in out_r.preempted]
        got_pre = [getattr(s, "seq_id", s) for s in out_m.preempted]
        if exp == got and exp_pre == got_pre:
            for r, m in zip(out_r.scheduled, out_m.scheduled):
                flags_r = (r.samples, r.is_prefill)
                flags_m = (getattr(m, "samples", None), getattr(m, "is_prefill", None))
                if flags_r != flags_m:
                    raise self.fail(f"{title}: the record of {_sid(r.seq)} says samples={flags_m[0]!r}, "
                                    f"is_prefill={flags_m[1]!r}.", expected=f"samples={flags_r[0]}, is_prefill={flags_r[1]}",
                                    got=f"samples={flags_m[0]!r}, is_prefill={flags_m[1]!r}", picture=self.picture(out_r, out_m),
                                    hint="the engine reads these fields and never recomputes them: build each record with "
                                         "ScheduledSeq.of(seq, n) before moving anything, so start is num_computed_tokens "
                                         "before the step; samples is start + n == seq.num_tokens.")
            if out_m.num_batched_tokens != out_r.num_batched_tokens:
                raise self.fail(f"{title}: out.num_batched_tokens is wrong.", expected=f"{out_r.num_batched_tokens}",
                                got=f"{out_m.num_batched_tokens!r}", picture=self.picture(out_r, out_m),
                                hint="it is the sum of num_new_tokens over out.scheduled.")
            return
        raise self.fail(f"{title} differs.", expected=f"scheduled {self._sched_text(out_r)}, preempted {fmt_list('r' + str(i) for i in exp_pre)}",
                        got=f"scheduled {self._sched_text(out_m)}, preempted {fmt_list('r' + str(i) for i in got_pre)}",
                        picture=self.picture(out_r, out_m), hint=self.diagnose(out_r, out_m, exp, got, exp_pre, got_pre))

    def leaked(self) -> int:
        """Blocks that are neither free nor held by one of your running sequences."""
        a = self.my_pool
        held = set()
        for s in self.mine.running:
            if getattr(s, "block_table", None) is not None:
                held.update(s.block_table.blocks)
        return a.num_blocks - a.num_free_blocks - len(held)

    def diagnose(self, out_r, out_m, exp, got, exp_pre, got_pre) -> str:
        cfg = self.cfg
        if got_pre and self.leaked() > 0:
            return (f"{self.leaked()} block(s) are neither free nor held by a running sequence: preempting without freeing. "
                    "_preempt(seq) must give the blocks back with seq.block_table.free() before dropping the table "
                    "(seq.block_table = None); otherwise the pool only shrinks and everyone gets preempted.")
        total = sum(n for _, n, _ in got)
        if total > cfg.budget:
            return (f"you scheduled {total} new tokens, more than max_num_batched_tokens={cfg.budget}: admitting past the token "
                    "budget. Keep `budget` = tokens left this step, give each sequence n = min(remaining, budget), subtract n, "
                    "and stop when it reaches 0. With chunked prefill a long prompt is admitted with the part that fits.")
        if any(n <= 0 for _, n, _ in got):
            return "never schedule a sequence for 0 tokens: stop when the budget is used up."
        if len(self.mine.running) > cfg.max_num_seqs:
            return (f"{len(self.mine.running)} sequences run, more than max_num_seqs={cfg.max_num_seqs}: admit only while "
                    "len(self.running) < self.max_num_seqs.")
        m_run = [getattr(x, "seq_id", x) for x in self.mine.running]
        if exp_pre and not got_pre and all(i not in m_run and i in self.my_seqs
                                           and self.my_seqs[i].status == self.ref_seqs[i].status for i in exp_pre):
            # the right sequences left self.running: the preemption happened, only its record is missing
            return (f"you preempted the right sequence(s) ({fmt_list('r' + str(i) for i in exp_pre)} left self.running, as in "
                    "the reference), but out.preempted is empty: append each preempted sequence to out.preempted "
                    "(the engine reads it, and no one is admitted in a step whose out.preempted is not empty).")
        if exp_pre and not got_pre:
            return ("a running sequence needed a new block and none was free, so the reference preempted. Before "
                    "table.append_tokens(n): while table.blocks_needed(n) > allocator.num_free_blocks, preempt self.running[-1] "
                    "(the most recently admitted; it may be the sequence itself, then stop scheduling running ones).")
        if exp_pre != got_pre and got_pre and sorted(exp_pre) == sorted(set(got_pre)):
            return (f"out.preempted should list {fmt_list('r' + str(i) for i in exp_pre)}: each preempted sequence once, in "
                    "the order they were preempted.")
        if exp_pre != got_pre and got_pre:
            return ("preempt the most recently admitted running sequence, self.running[-1] (vLLM's choice: it has the least "
                    "work done, and older requests keep their place), and only as many as it takes for the blocks to fit.")
        exp_ids = [i for i, _, _ in exp]
        got_ids = [i for i, _, _ in got]
        if exp_pre and len(got_ids) > len(exp_ids) and got_ids[: len(exp_ids)] == exp_ids:
            return ("in a step that had to preempt, admit nobody from the waiting queue: memory is short, and admitting now "
                    "would only preempt again next step.")
        if sorted(exp_ids) == sorted(got_ids) and exp_ids != got_ids:
            return ("the order matters: running sequences first, oldest first (the order of self.running), then waiting ones "
                    "in queue order; the engine lays out the batch in this order.")
        for (ei, en, es), (gi, gn, gs) in zip(exp, got):
            if ei == gi and (en, es) != (gn, gs):
                seq = self.ref_seqs[ei]
                if gs != es:
                    return (f"start is the sequence's num_computed_tokens before this step ({es} for r{ei}): the new tokens are "
                            "positions start .. start + n - 1.")
                return (f"r{ei} should compute {en} new token(s): n = min(seq.num_tokens - seq.num_computed_tokens, budget left). "
                        f"It holds {seq.num_tokens} tokens now." )
        extra = [i for i in got_ids if i not in exp_ids]
        if extra:
            head = self.ref.waiting[0] if self.ref.waiting else None
            if head is not None and head.seq_id != extra[0] and extra[0] in [s.seq_id for s in self.ref.waiting]:
                return (f"you admitted r{extra[0]} while r{head.seq_id}, ahead of it in the queue, did not fit. Admission is "
                        "first come, first served: when the head of the waiting queue does not fit, stop (else a long "
                        "request could starve behind a stream of short ones).")
            return ("you admitted a request the reference did not: admit only while the budget is > 0, "
                    "len(self.running) < max_num_seqs and the blocks for its first chunk fit in the free blocks.")
        missing = [i for i in exp_ids if i not in got_ids]
        if missing:
            return (f"the reference also scheduled r{missing[0]}. Running sequences are always served first; then admit "
                    "waiting ones while the budget is > 0, len(self.running) < max_num_seqs and the first chunk's blocks "
                    "fit. With chunked prefill a prompt longer than the budget left is admitted with the part that fits.")
        return "compare your schedule() with the rule in the workbook, one step at a time, using the replay line above."

    def compare_state(self, after: str) -> None:
        r_run = [s.seq_id for s in self.ref.running]
        m_run = [getattr(s, "seq_id", s) for s in self.mine.running]
        r_wait = [s.seq_id for s in self.ref.waiting]
        m_wait = [getattr(s, "seq_id", s) for s in self.mine.waiting]
        problems = []
        if r_run != m_run:
            problems.append(("running", fmt_list(f"r{i}" for i in r_run), fmt_list(f"r{i}" for i in m_run)))
        if r_wait != m_wait:
            problems.append(("waiting", fmt_list(f"r{i}" for i in r_wait), fmt_list(f"r{i}" for i in m_wait)))
        hint = ""
        for rid, r in self.ref_seqs.items():
            m = self.my_seqs[rid]
            rb = None if r.block_table is None else list(r.block_table.blocks)
            mb = None if m.block_table is None else list(getattr(m.block_table, "blocks", []))
            for what, a, b in (("status", r.status, m.status), ("num_computed_tokens", r.num_computed_tokens, m.num_computed_tokens),
                               ("blocks", rb, mb), ("num_preemptions", r.num_preemptions, getattr(m, "num_preemptions", None))):
                if a != b:
                    problems.append((f"r{rid}.{what}", str(a.value if hasattr(a, "value") else a),
                                     str(b.value if hasattr(b, "value") else b)))
                    if not hint and r.num_preemptions and what == "num_computed_tokens" and r.num_computed_tokens == 0:
                        hint = (f"r{rid} was preempted: its KV is gone with its blocks, so num_computed_tokens goes back to 0 "
                                "(it will be recomputed from the start), status to WAITING, and it goes to the FRONT of the "
                                "waiting queue (appendleft).")
                    if not hint and what == "num_preemptions":
                        hint = (f"_preempt(seq) adds 1 to seq.num_preemptions (r{rid} has been preempted {a} time(s)) and "
                                "1 to the scheduler's self.num_preemptions.")
                    if not hint and what == "blocks" and a is None and b is not None:
                        hint = (f"r{rid} holds blocks {b} but should hold none: set seq.block_table = None after freeing it.")
        rp, mp = self.ref.num_preemptions, getattr(self.mine, "num_preemptions", None)
        if rp != mp:
            problems.append(("scheduler.num_preemptions", str(rp), repr(mp)))
            if not hint:
                hint = ("_preempt(seq) adds 1 to the scheduler's self.num_preemptions (the engine reports it) as well as "
                        "to seq.num_preemptions.")
        rf, mf = self.ref.allocator.num_free_blocks, self.my_pool.num_free_blocks
        if rf != mf:
            problems.append(("free blocks", str(rf), str(mf)))
            if not hint and mf < rf and self.leaked() > 0:
                hint = ("blocks are missing from the pool: preempting without freeing. _preempt(seq) must give the blocks back "
                        "with seq.block_table.free() before dropping the table (seq.block_table = None).")
        if not problems:
            return
        if not hint:
            names = {p[0] for p in problems}
            if "waiting" in names and any(self.ref_seqs[i].num_preemptions for i in r_wait):
                hint = "a preempted sequence goes to the FRONT of the waiting queue (self.waiting.appendleft(seq)): it was admitted before the others waiting."
            elif "running" in names:
                hint = "an admitted sequence is appended to self.running (and removed from the waiting queue); a preempted one is removed from self.running."
            else:
                hint = "compare the two columns above: the first row that differs is where to look."
        pic = table([["", "expected", "yours"]] + [list(p) for p in problems[:8]])
        raise self.fail(f"the schedulers' states differ after {after}.", picture=pic + "\n\nBoth schedulers now:\n" + self.picture(),
                        hint=hint)


# -- workloads ---------------------------------------------------------------------------------
def _fixed(part: str) -> list[tuple[str, Config, list[tuple[int, int, int, int]]]]:
    """(label, config, [(arrival step, rid, prompt_len, max_tokens)])."""
    runs = []
    if part == "admission":
        runs += [
            ("one request, plenty of room", Config(16, 4, 4, 32), [(0, 0, 6, 3)]),
            ("the token budget: 3 prompts of 6 with max_num_batched_tokens=8", Config(32, 4, 4, 8),
             [(0, 0, 6, 4), (0, 1, 6, 4), (0, 2, 6, 4)]),
            ("max_num_seqs=2 with 3 requests", Config(32, 4, 2, 64), [(0, 0, 3, 5), (0, 1, 4, 5), (0, 2, 2, 5)]),
            ("arrivals while others decode", Config(32, 4, 3, 12), [(0, 0, 5, 6), (2, 1, 9, 3), (3, 2, 20, 2), (3, 3, 2, 4)]),
            # r1 (4 blocks) does not fit the 2 free blocks, r2 (1 block) would: first come, first served admits neither
            ("the head of the queue does not fit: nobody behind it skips ahead", Config(6, 4, 4, 64),
             [(0, 0, 12, 6), (1, 1, 16, 2), (1, 2, 3, 2)]),
            # 4 running sequences, a budget of 3 tokens a step: the budget runs out inside the running queue
            ("a token budget smaller than the running batch (max_num_batched_tokens=3, 4 requests)", Config(32, 4, 4, 3),
             [(0, 0, 2, 5), (0, 1, 2, 5), (0, 2, 2, 5), (0, 3, 2, 5)]),
        ]
    if part == "preemption":
        runs += [
            ("two requests outgrow a pool of 4 blocks", Config(4, 2, 4, 16), [(0, 0, 3, 6), (0, 1, 3, 6)]),
            ("three requests, the newest is preempted first", Config(6, 2, 4, 16), [(0, 0, 2, 7), (0, 1, 2, 7), (0, 2, 2, 7)]),
            # r1 is preempted with blocks to spare and a token budget left: admitting anyone in that step is the
            # mistake; r1 goes back to the front, recomputed from 0, ahead of r2, which arrived before it was preempted.
            ("a step that preempts admits nobody; the preempted go back to the front, from 0", Config(5, 2, 4, 3),
             [(0, 0, 2, 8), (0, 1, 3, 8), (1, 2, 2, 4)]),
        ]
    if part == "rejection":
        runs += [
            ("requests that can never run are rejected at once", Config(4, 4, 4, 16, max_model_len=12),
             [(0, 0, 0, 4), (0, 1, 3, 0), (0, 2, 12, 2), (0, 3, 10, 10), (0, 4, 8, 9), (0, 5, 5, 20), (0, 6, 6, 3)]),
            ("a request that needs exactly the whole pool fits", Config(3, 4, 4, 16), [(0, 0, 6, 7), (0, 1, 6, 8), (1, 2, 3, 2)]),
            # a context of 2,048 tokens (max_model_len=2048 here) in a pool of exactly 2,048 tokens: prompts at, past and one short of max_model_len, and
            # one whose max_tokens runs past the context (it needs the whole pool, capped at max_model_len, not more)
            ("a 2,048-token context: max_model_len=2048, block_size=16, a pool of 128 blocks (2,048 tokens)",
             Config(128, 16, 4, 2048, max_model_len=2048), [(0, 0, 2048, 1), (0, 1, 2049, 1), (0, 2, 2047, 1), (0, 3, 2040, 100)]),
        ]
    return runs


def _random(part: str, seed: int, k: int) -> tuple[str, Config, list]:
    rng = random.Random(seed * 1000 + k)
    bs = rng.choice([1, 2, 4])
    if part == "admission":
        cfg = Config(rng.randint(40, 80), bs, rng.randint(1, 4), rng.randint(2, 24))
    elif part == "preemption":
        cfg = Config(rng.randint(3, 8), bs, rng.randint(3, 6), rng.randint(8, 24))
    else:
        cfg = Config(rng.randint(2, 8), bs, rng.randint(1, 4), rng.randint(4, 24),
                     max_model_len=rng.choice([None, rng.randint(6, 30)]))
    reqs = []
    cap = cfg.num_blocks * bs
    for rid in range(rng.randint(2, 7)):
        arrive = 0 if rng.random() < 0.5 else rng.randint(1, 10)
        if part == "rejection":
            plen = 0 if rng.random() < 0.1 else rng.randint(1, cap + 4)
            mt = rng.randint(0 if rng.random() < 0.1 else 1, 16)
        else:
            # requests that fit the pool on their own, so the only trouble is each other
            plen = rng.randint(1, max(1, min(24, cap // 2)))
            mt = rng.randint(1, max(1, min(12, cap - plen + 1)))
        reqs.append((arrive, rid, plen, mt))
    reqs.sort(key=lambda r: (r[0], r[1]))
    return f"random {part} run {k + 1} (seed {seed})", cfg, reqs


def _play(cls: type, label: str, cfg: Config, reqs: list, seed: int, stats: dict, steps: int | None = None,
          ignore_eos: bool = False) -> _Sim:
    sim = _Sim(cls, cfg, label, seed, stats, ignore_eos=ignore_eos)
    sim.checking = steps is None
    pending = list(reqs)
    limit = 400
    while True:
        while pending and pending[0][0] <= sim.step_no:
            _, rid, plen, mt = pending.pop(0)
            sim.add(rid, plen, mt)
        if steps is not None and sim.step_no >= steps:
            return sim
        if not pending and not sim.ref.has_unfinished():
            break
        sim.step()
        if sim.step_no > limit:
            raise sim.fail(f"still unfinished after {limit} steps", hint="the reference finishes every request long before this.")
    if sim.mine.has_unfinished():
        raise sim.fail("the reference has finished every request, yours has not.", picture=sim.picture())
    stats["runs"] += 1
    return sim


def replay(cls: type, label: str, steps: int, seed: int | None = None):
    """Both schedulers of the check's run ``label`` after ``steps`` steps: ``(yours, reference)``.

    ``seed`` is the one the failure message prints (the check's seed): the fake model's tokens,
    and so when a random run's requests end, depend on it. Without it, a random run's seed is
    read from its label; the fixed stories ignore EOS, so they are the same for every seed.
    """
    stats = {"ops": 0, "runs": 0, "current": ""}
    for part in ("admission", "preemption", "rejection"):
        for lab, cfg, reqs in _fixed(part):
            if lab == label:
                sim = _play(cls, lab, cfg, reqs, 0 if seed is None else seed, stats, steps=steps, ignore_eos=True)
                return sim.mine, sim.ref
        for s in ([seed] if seed is not None else range(5)):
            for k in range(40):
                lab, cfg, reqs = _random(part, s, k)
                if lab == label:
                    sim = _play(cls, lab, cfg, reqs, s, stats, steps=steps)
                    return sim.mine, sim.ref
    raise KeyError(f"no run named {label!r}" + (f" with seed {seed}" if seed is not None else ""))


def _check(cls: type, part: str, seed: int, runs: int, timeout: float, title: str) -> None:
    builds("package code in place")  # refused here, and watched while every story runs
    refuse_package_class(cls, MUST_WRITE, NAME, "scheduler")
    stats = {"ops": 0, "runs": 0, "current": f"creating {cls.__name__}"}

    def _body():
        for label, cfg, reqs in _fixed(part):
            _play(cls, label, cfg, reqs, seed, stats, ignore_eos=True)
        for k in range(runs):
            label, cfg, reqs = _random(part, seed, k)
            _play(cls, label, cfg, reqs, seed, stats)

    # Your add_request and schedule may not call minipaged's (super().schedule(), Scheduler._preempt, ...).
    run_guarded("06", NAME, _body, timeout, stats)
    passed(f"{title}: {stats['runs']} runs, {stats['ops']} add_request/schedule calls; after every one your scheduler "
           "matched the reference (scheduled tokens, preemptions, queues, blocks).")


def check_admission(cls: type, seed: int = 0, runs: int = 20, timeout: float = DEFAULT_TIMEOUT_S) -> None:
    """Admission within the token budget and max_num_seqs, FCFS, decode and chunked prefill (no preemption)."""
    _check(cls, "admission", seed, runs, timeout, "admission")


def check_preemption(cls: type, seed: int = 1, runs: int = 25, timeout: float = DEFAULT_TIMEOUT_S) -> None:
    """Preemption by recompute when blocks run out: who, how many, blocks freed, back to the front."""
    _check(cls, "preemption", seed, runs, timeout, "preemption")


def check_rejection(cls: type, seed: int = 2, runs: int = 20, timeout: float = DEFAULT_TIMEOUT_S) -> None:
    """Requests that could never fit are rejected at once, the others are accepted."""
    _check(cls, "rejection", seed, runs, timeout, "rejection")


def check(cls: type, timeout: float = DEFAULT_TIMEOUT_S) -> None:
    check_admission(cls, timeout=timeout)
    check_preemption(cls, timeout=timeout)
    check_rejection(cls, timeout=timeout)


__all__ = ["check", "check_admission", "check_preemption", "check_rejection", "replay"]
