"""The parts' contracts: a learner-style part with only its Protocol's members serves a real model.

Each ``Lean*`` class below is written the way a workbook has a learner write it: its own
state, only the members of minipaged.interfaces, nothing pasted from the package. The engine
must serve SmolLM2 with it and give the reference engine's greedy tokens; a part missing a
member, or given a setting it does not declare, is refused when the engine is built.
"""
from __future__ import annotations

from collections import deque

import pytest
import torch

from minipaged import BlockAllocatorError, OutOfBlocksError
from minipaged.attention.reference import paged_attention as reference_attention
from minipaged.config import EngineConfig, split_kwargs
from minipaged.interfaces import BlockPool, BlockTableProtocol, SchedulerProtocol
from minipaged.parts import check_part, check_pool, check_scheduler, missing_members
from minipaged.sampling import SamplingParams
from minipaged.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from minipaged.sequence import SequenceStatus


class LeanAllocator:
    """Exactly BlockPool's members."""

    def __init__(self, num_blocks, block_size=16):
        self.num_blocks, self.block_size = num_blocks, block_size
        self._rc = [0] * num_blocks
        self._free = deque(range(num_blocks))

    @property
    def num_free_blocks(self):
        return len(self._free)

    def allocate(self):
        if not self._free:
            raise OutOfBlocksError("empty")
        b = self._free.popleft()
        self._rc[b] = 1
        return b

    def free(self, block_id):
        if self._rc[block_id] == 0:
            raise BlockAllocatorError("double free")
        self._rc[block_id] -= 1
        if self._rc[block_id] == 0:
            self._free.append(block_id)

    def incref(self, block_id):
        self._rc[block_id] += 1

    def ref_count(self, block_id):
        return self._rc[block_id]


class LeanTable:
    """Exactly BlockTableProtocol's members."""

    def __init__(self, allocator):
        self.allocator, self.block_size = allocator, allocator.block_size
        self.blocks, self.num_tokens = [], 0

    def blocks_needed(self, n):
        return max(0, -(-(self.num_tokens + n) // self.block_size) - len(self.blocks))

    def append_tokens(self, n=1):
        need = self.blocks_needed(n)
        if need > self.allocator.num_free_blocks:
            raise OutOfBlocksError("no room")
        new = [self.allocator.allocate() for _ in range(need)]
        self.blocks += new
        self.num_tokens += n
        return new

    def slot_mapping(self, start, end):
        return torch.tensor([self.blocks[p // self.block_size] * self.block_size + p % self.block_size for p in range(start, end)], dtype=torch.int64)

    def free(self):
        for b in reversed(self.blocks):
            self.allocator.free(b)
        self.blocks, self.num_tokens = [], 0


class LeanScheduler(Scheduler):
    """Writes only the policy (add_request, schedule); the bookkeeping is inherited."""

    def add_request(self, seq):
        if not seq.prompt_token_ids or -(-(seq.max_total_tokens) // self.allocator.block_size) > self.allocator.num_blocks:
            seq.status, seq.reject_reason = SequenceStatus.REJECTED, "never fits"
            from minipaged.sequence import FinishReason

            seq.finish_reason = FinishReason.REJECTED
            return False
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)
        return True

    def schedule(self):
        out, budget = SchedulerOutput(), self.max_num_batched_tokens
        for seq in list(self.running):
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
        while not out.preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
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
        out.num_batched_tokens = self.max_num_batched_tokens - budget
        return out


def lean_attention(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale, out=None):
    """A learner's function: the reference maths, written out per sequence."""
    res = torch.empty_like(q) if out is None else out
    bs, hk = k_cache.shape[1], k_cache.shape[2]
    g = q.shape[1] // hk
    for s in range(len(context_lens)):
        a, b, c = int(query_start_loc[s]), int(query_start_loc[s + 1]), int(context_lens[s])
        nb = -(-c // bs)
        k = k_cache[block_tables[s, :nb].long()].reshape(-1, hk, q.shape[2])[:c].repeat_interleave(g, 1)
        v = v_cache[block_tables[s, :nb].long()].reshape(-1, hk, q.shape[2])[:c].repeat_interleave(g, 1)
        scores = torch.einsum("qhd,khd->hqk", q[a:b].float(), k.float()) * scale
        qpos = torch.arange(c - (b - a), c)[:, None]
        scores = scores.masked_fill(torch.arange(c)[None, :] > qpos, float("-inf"))
        res[a:b] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.float()).to(q.dtype)
    return res


# ---------------------------------------------------------------------------------------------
def test_lean_parts_hold_exactly_the_protocol_members():
    for cls, proto in ((LeanAllocator, BlockPool), (LeanTable, BlockTableProtocol), (LeanScheduler, SchedulerProtocol)):
        assert missing_members(cls, proto) == []
    pool = LeanAllocator(4, 2)
    assert isinstance(pool, BlockPool) and isinstance(LeanTable(pool), BlockTableProtocol)


def test_reference_parts_have_nothing_public_beyond_their_protocol():
    from minipaged import BlockAllocator, BlockTable

    pool = BlockAllocator(4, 2)
    public = {n for n in dir(pool) if not n.startswith("_")}
    assert public == {"num_blocks", "block_size", "num_free_blocks", "allocate", "free", "incref", "ref_count"}
    table = BlockTable(pool)
    public = {n for n in dir(table) if not n.startswith("_")}
    assert public == {"allocator", "block_size", "blocks", "num_tokens", "blocks_needed", "append_tokens", "slot_mapping", "free"}


def _serve(model, tok, **parts):
    from minipaged.engine import LLMEngine

    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in ("Name a colour.", "What is 2+2?", "Say hi.")]
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    # a small pool and budget, so preemption and chunked prefill happen with the lean parts too
    eng = LLMEngine(model, tok, block_size=4, num_blocks=18, max_num_batched_tokens=16, enable_prefix_caching=False, **parts)
    ids = [eng.add_request(p, params) for p in prompts]
    done = eng.run()
    check_scheduler(eng.scheduler)
    assert eng.allocator.num_free_blocks == eng.allocator.num_blocks
    return [done[i].token_ids for i in ids], eng.scheduler.num_preemptions


@pytest.fixture(scope="module")
def reference_tokens(smollm2):
    tokens, preemptions = _serve(*smollm2)
    assert preemptions > 0, "the workload must make the engine preempt"
    return tokens


LEAN = dict(allocator=dict(allocator_cls=LeanAllocator), block_table=dict(block_table_cls=LeanTable),
            scheduler=dict(scheduler_cls=LeanScheduler), attention=dict(attention=lean_attention))


@pytest.mark.slow
@pytest.mark.parametrize("part", ["allocator", "block_table", "scheduler", "attention", "all"])
def test_a_lean_part_serves_smollm2_with_the_reference_tokens(smollm2, reference_tokens, part):
    kw = {k: v for d in LEAN.values() for k, v in d.items()} if part == "all" else LEAN[part]
    tokens, _ = _serve(*smollm2, **kw)
    assert tokens == reference_tokens


def test_a_missing_member_is_named_when_the_engine_is_built(tiny_model):
    from minipaged.engine import LLMEngine

    model, tok = tiny_model

    class Bare:
        def __init__(self, n, bs):
            self.num_blocks, self.block_size = n, bs

        def allocate(self):
            return 0

    with pytest.raises(TypeError, match=r"your allocator Bare has no `num_free_blocks`, `free`, `incref`, `ref_count`"):
        LLMEngine(model, tok, allocator_cls=Bare, num_blocks=8)

    class NoSlots:
        def __init__(self, allocator):
            self.allocator, self.block_size, self.blocks, self.num_tokens = allocator, allocator.block_size, [], 0

        blocks_needed = LeanTable.blocks_needed
        append_tokens = LeanTable.append_tokens
        free = LeanTable.free

    with pytest.raises(TypeError, match=r"your block table NoSlots has no `slot_mapping`"):
        LLMEngine(model, tok, block_table_cls=NoSlots, num_blocks=8)

    class NoNumTokens(LeanTable):
        def __init__(self, allocator):
            self.allocator, self.block_size, self.blocks = allocator, allocator.block_size, []

    with pytest.raises(TypeError, match=r"your block table NoNumTokens has no `num_tokens`"):
        LLMEngine(model, tok, block_table_cls=NoNumTokens, num_blocks=8)

    with pytest.raises(TypeError, match=r"cannot be called as paged_attention"):
        LLMEngine(model, tok, attention=lambda q, k: q, num_blocks=8)


def test_an_undeclared_setting_is_refused_not_ignored(tiny_model):
    from minipaged.engine import LLMEngine

    model, tok = tiny_model
    with pytest.raises(ValueError, match=r"enable_chunked_prefill=False needs a scheduler whose schedule\(\) handles it.*LeanScheduler"):
        LLMEngine(model, tok, scheduler_cls=LeanScheduler, enable_chunked_prefill=False, num_blocks=8)

    class Declares(LeanScheduler):
        supports = {"chunked_prefill_off"}  # but its schedule() is inherited from LeanScheduler

    with pytest.raises(ValueError, match="LeanScheduler.schedule does not declare it|Declares.schedule does not declare it"):
        LLMEngine(model, tok, scheduler_cls=Declares, enable_chunked_prefill=False, num_blocks=8)
    # the reference declares it, and a subclass that keeps the reference schedule() inherits that
    LLMEngine(model, tok, scheduler_cls=type("Sub", (Scheduler,), {}), enable_chunked_prefill=False, num_blocks=8)


def test_check_part_accepts_the_reference_and_lean_instances():
    from minipaged import BlockAllocator, BlockTable

    for pool in (BlockAllocator(6, 2), LeanAllocator(6, 2)):
        check_part(pool, BlockPool)
        check_pool(pool)
        check_part(BlockTable(pool), BlockTableProtocol)


def test_unknown_setting_names_the_nearest_valid_one():
    with pytest.raises(TypeError, match=r"unknown engine setting 'block_sise'\. Did you mean 'block_size'\?"):
        split_kwargs({"block_sise": 8})
    cfg, parts = split_kwargs({"block_size": 8, "scheduler_cls": LeanScheduler})
    assert cfg == EngineConfig(block_size=8) and parts.scheduler_cls is LeanScheduler


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(block_size=0), "block_size must be an int >= 1, got 0"),
        (dict(block_size=True), "block_size must be an int >= 1, got True"),
        (dict(max_num_seqs=-1), "max_num_seqs must be an int >= 1"),
        (dict(max_num_batched_tokens=0), "max_num_batched_tokens must be an int >= 1"),
        (dict(block_size=512), "block_size must be in 1..256"),
        (dict(enable_chunked_prefill="no"), "enable_chunked_prefill must be True or False"),
    ],
)
def test_bad_engine_settings_are_clear_value_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kw)


def test_scheduled_seq_is_a_frozen_record_filled_by_the_scheduler():
    from minipaged import BlockAllocator
    from minipaged.sequence import Sequence

    sched = Scheduler(BlockAllocator(8, 4), max_num_batched_tokens=4)
    sched.add_request(Sequence("a", list(range(6)), max_tokens=2))
    out = sched.schedule()
    (s,) = out.scheduled
    assert (s.start, s.num_new_tokens, s.samples, s.is_prefill) == (0, 4, False, True)
    with pytest.raises(Exception):
        s.num_new_tokens = 5  # frozen
    sched.update(out, {})
    out = sched.schedule()
    (s,) = out.scheduled
    assert (s.start, s.num_new_tokens, s.samples, s.is_prefill) == (4, 2, True, True)
    sched.update(out, {"a": 1})
    out = sched.schedule()
    (s,) = out.scheduled
    assert (s.start, s.num_new_tokens, s.samples, s.is_prefill) == (6, 1, True, False)
    finished = sched.update(out, {"a": 1})
    assert finished is out.finished and [q.seq_id for q in finished] == ["a"]


# -- the seam layer ---------------------------------------------------------------------------
def test_the_data_records_are_one_set_of_classes_under_every_old_name():
    import minipaged
    from minipaged import data, scheduler, sequence

    for name in ("Sequence", "SequenceStatus", "FinishReason"):
        assert getattr(sequence, name) is getattr(data, name) is getattr(minipaged, name)
    for name in ("ScheduledSeq", "SchedulerOutput"):
        assert getattr(scheduler, name) is getattr(data, name) is getattr(minipaged, name)


def test_there_is_one_parts_class_and_the_engine_fills_in_the_defaults():
    from minipaged import BlockAllocator, BlockTable
    from minipaged.config import Parts
    from minipaged.engine import resolve_parts
    from minipaged.prefix_cache import PrefixCache

    assert not hasattr(Parts, "resolved"), "the config names no implementation: the engine resolves the parts"
    got = resolve_parts(Parts(scheduler_cls=LeanScheduler, attention="reference"))
    assert (got.allocator_cls, got.block_table_cls, got.scheduler_cls, got.prefix_cache_cls, got.attention) == (
        BlockAllocator, BlockTable, LeanScheduler, PrefixCache, "reference")


def test_a_prefix_cache_missing_a_member_is_named_like_the_other_parts(tiny_model):
    from minipaged.engine import LLMEngine
    from minipaged.interfaces import PrefixCacheProtocol
    from minipaged.prefix_cache import PREFIX_CACHE_MEMBERS, PrefixCache

    assert missing_members(PrefixCache, PrefixCacheProtocol) == []
    assert set(PREFIX_CACHE_MEMBERS) >= {"match_prefix", "cache_blocks", "hash_block", "num_evictions"}

    # the reference, less one member
    NoMatch = type("NoMatch", (), {k: v for k, v in vars(PrefixCache).items()
                                   if k not in ("match_prefix", "__dict__", "__weakref__")})
    model, tok = tiny_model
    with pytest.raises(TypeError, match=r"your prefix cache NoMatch has no `match_prefix`.*PrefixCacheProtocol"):
        LLMEngine(model, tok, prefix_cache_cls=NoMatch, enable_prefix_caching=True, num_blocks=8)


def test_a_requests_stop_settings_live_on_its_sequence_and_the_checker_reads_them(tiny_model):
    from minipaged.detokenizer import StopChecker
    from minipaged.engine import LLMEngine
    from minipaged.sequence import Sequence

    model, tok = tiny_model
    eng = LLMEngine(model, tok, num_blocks=16)
    params = SamplingParams(max_tokens=3, stop_token_ids=[7], ignore_eos=True, n=2, temperature=0.0)
    rid = eng.add_request([1, 2, 3], params)
    req = eng.requests[rid]
    for q in req.samples:
        assert (q.max_tokens, q.stop_token_ids, q.ignore_eos) == (3, (7,), True)
        assert q.stop_checker.settings is q  # read from the sequence, not copied
    assert req.params is req.seq.sampling_params is params
    # a sequence made without the engine gets the same rule from the scheduler, read from it too
    seq = Sequence("s", [1, 2], max_tokens=2, stop_token_ids=(9,))
    checker = StopChecker.for_sequence(seq)
    seq.max_tokens = 1
    assert checker.append(5)[0] is not None  # max_tokens is read when the token comes
    with pytest.raises(RuntimeError, match="has no stop checker"):
        Sequence("t", [1], max_tokens=2).append_token(3)
