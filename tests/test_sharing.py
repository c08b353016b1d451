"""Sharing KV blocks in the engine: prefix caching (and copy-on-write) end to end.

- A hypothesis state machine drives the real Scheduler over a PrefixCache with a fake model
  whose "K/V" is (token, position) per slot: requests from a few shared prefixes arrive, run,
  are preempted, aborted and finish in a small pool. After every step the scheduler's
  invariants hold (ref counts above 1, cached-free blocks), and every sequence attends only to
  its own tokens at their own positions, so a wrong hit or a write into a shared block shows.
- On SmolLM2, chat prompts that share a system prompt give the same greedy tokens with the
  cache on and off, equal to transformers', at block sizes 1, 16 (with preemption and chunked
  prefill) and 64.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from minipaged import parts
from minipaged.block_allocator import BlockAllocator
from minipaged.block_table import BlockTable
from minipaged.engine import LLMEngine
from minipaged.prefix_cache import PrefixCache
from minipaged.sampling import SamplingParams
from minipaged.scheduler import Scheduler
from minipaged.sequence import Sequence, SequenceStatus


def _scheduler(pool, **kw) -> Scheduler:
    return Scheduler(pool, BlockTable, **kw)


class FakeModel:
    """K/V of a slot = (token id, position): enough to see whose context a sequence reads."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.bs = block_size
        self.kv = torch.full((num_blocks * block_size, 2), -1, dtype=torch.long)

    def step(self, out) -> dict:
        for src, dst in out.blocks_to_copy:
            bs = self.bs
            self.kv[dst * bs : (dst + 1) * bs] = self.kv[src * bs : (src + 1) * bs]
        sampled = {}
        for s in out.scheduled:
            seq, a, n = s.seq, s.start, s.num_new_tokens
            toks = seq.token_ids
            if a > 0:  # what this step attends to must be this sequence's own tokens
                ctx = self.kv[seq.block_table.slot_mapping(0, a)]
                want = torch.tensor([[toks[p], p] for p in range(a)])
                assert torch.equal(ctx, want), f"{seq}: positions 0..{a - 1} hold another sequence's K/V"
            slots = seq.block_table.slot_mapping(a, a + n)
            self.kv[slots] = torch.tensor([[toks[p], p] for p in range(a, a + n)])
            if s.samples:
                # every sample of a forked prompt draws another token: they diverge at once
                for i, q in enumerate([seq] + list(seq.forks)):
                    sampled[q.seq_id] = (sum(toks) * 31 + len(toks) + 2 * i) % 5
        return sampled


class EngineMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(3, 24), block_size=st.sampled_from([1, 2, 4]),
                budget=st.integers(2, 24), max_num_seqs=st.integers(1, 5))
    def setup(self, num_blocks, block_size, budget, max_num_seqs):
        self.cache = PrefixCache(BlockAllocator(num_blocks, block_size))
        self.sched = _scheduler(self.cache, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                enable_prefix_caching=True)
        self.model = FakeModel(num_blocks, block_size)
        self.prefixes = [[1, 2, 3, 4, 0, 1, 2, 3], [4, 4, 3, 3, 2, 2], [0]]
        self.n = 0
        self.steps = 0
        self.all: list[Sequence] = []

    @rule(p=st.integers(0, 2), tail=st.lists(st.integers(0, 4), max_size=6), max_tokens=st.integers(1, 6),
          n=st.sampled_from([1, 1, 2, 3]))
    def add(self, p, tail, max_tokens, n):
        toks = self.prefixes[p] + tail
        seq = Sequence(f"r{self.n}", toks, max_tokens=max_tokens)
        seq.forks = [Sequence(f"r{self.n}#{i}", toks, max_tokens=max_tokens) for i in range(1, n)]
        self.n += 1
        self.all.append(seq)
        self.sched.add_request(seq)

    @precondition(lambda self: self.sched.has_unfinished())
    @rule()
    def step(self):
        out = self.sched.schedule()
        assert not out.is_empty, "the scheduler made no progress"
        self.sched.update(out, self.model.step(out))
        self.steps += 1

    @precondition(lambda self: self.sched.running or self.sched.waiting)
    @rule(data=st.data())
    def abort(self, data):
        seqs = list(self.sched.running) + list(self.sched.waiting)
        seq = data.draw(st.sampled_from(seqs))
        assert self.sched.abort(seq.seq_id) is seq

    @invariant()
    def consistent(self):
        if hasattr(self, "sched"):
            parts.check_scheduler(self.sched, self.sched.max_num_seqs)

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        for _ in range(500):
            if not self.sched.has_unfinished():
                break
            self.step()
        assert not self.sched.has_unfinished()
        parts.check_scheduler(self.sched, self.sched.max_num_seqs)
        assert self.cache.num_free_blocks == self.cache.num_blocks, "a block leaked"
        assert all(q.is_finished and q.block_table is None for seq in self.all for q in [seq] + seq.forks)
        assert all(self.cache.ref_count(b) == 0 for b in range(self.cache.num_blocks))


EngineMachine.TestCase.settings = settings(
    max_examples=70, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_scheduler_with_prefix_cache_state_machine = EngineMachine.TestCase


def test_a_shared_prefix_is_computed_once():
    cache = PrefixCache(BlockAllocator(16, 4))
    sched = _scheduler(cache, max_num_batched_tokens=64, enable_prefix_caching=True)
    model = FakeModel(16, 4)
    first = Sequence("a", list(range(10)), max_tokens=2)
    sched.add_request(first)
    out = sched.schedule()
    sched.update(out, model.step(out))
    second = Sequence("b", list(range(8)) + [9, 9, 9], max_tokens=2)
    sched.add_request(second)
    out = sched.schedule()
    new = next(s for s in out.scheduled if s.seq is second)
    assert (new.start, new.num_new_tokens) == (8, 3), "the 8 cached tokens count as computed"
    assert second.block_table.blocks[:2] == first.block_table.blocks[:2]
    assert [cache.ref_count(b) for b in first.block_table.blocks[:2]] == [2, 2]
    sched.update(out, model.step(out))
    parts.check_scheduler(sched)
    assert sched.prefix_stats.hit_tokens == 8 and sched.prefix_stats.queried_tokens == 21


def test_a_prompt_of_whole_cached_blocks_recomputes_its_last_block():
    cache = PrefixCache(BlockAllocator(8, 4))
    sched = _scheduler(cache, enable_prefix_caching=True)
    model = FakeModel(8, 4)
    for rid in ("a", "b"):
        sched.add_request(Sequence(rid, list(range(8)), max_tokens=1))
        while sched.has_unfinished():
            out = sched.schedule()
            if rid == "b":
                s = out.scheduled[0]
                assert (s.start, s.num_new_tokens, s.samples) == (4, 4, True), "the last prompt token must run"
            sched.update(out, model.step(out))
    assert cache.num_free_blocks == 8 and cache.num_cached_blocks == 2


def test_prefix_caching_needs_a_cache_and_a_scheduler_that_supports_it():
    with pytest.raises(ValueError, match="needs a prefix cache"):
        _scheduler(BlockAllocator(4, 4), enable_prefix_caching=True)

    class LearnerScheduler(Scheduler):
        def schedule(self):
            return super().schedule()

    from minipaged.engine import resolve_prefix_caching

    assert resolve_prefix_caching(None, Scheduler) is True
    assert resolve_prefix_caching(None, LearnerScheduler) is False, "a scheduler that does not declare it runs without"
    assert resolve_prefix_caching(False, Scheduler) is False
    with pytest.raises(ValueError, match="supports = {'prefix_caching'}"):
        resolve_prefix_caching(True, LearnerScheduler)
    with pytest.raises(ValueError, match="True, False or None"):
        resolve_prefix_caching("yes", Scheduler)


# -- SmolLM2: greedy tokens with the cache on and off, and transformers' -----------------------
SYSTEM = (
    "You are a careful assistant for a course about serving language models. Answer in one short sentence, "
    "in plain words, and give numbers when they matter. If you do not know, say so. Be kind and precise, "
    "and never make up facts about the course. Keep every answer short enough to read aloud in a few seconds."
)
QUESTIONS = ["What is a KV cache?", "Name a colour.", "What is 2 plus 2?"]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def shared_ids(smollm2):
    _, tok = smollm2
    ids = [tok.encode(tok.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
                                              add_generation_prompt=True)) for q in QUESTIONS]
    common = next(i for i, col in enumerate(zip(*ids)) if len(set(col)) > 1)
    assert common > 65, f"the prompts share only {common} tokens: too few for a hit at block size 64"
    return ids


@pytest.fixture(scope="module")
def hf_shared(hf_smollm2, shared_ids):
    outs = []
    with torch.inference_mode():
        for ids in shared_ids:
            g = hf_smollm2.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=2,
                                    pad_token_id=2)
            outs.append(g[0, len(ids):].tolist())
    return outs


def _serve(model, tok, prompts, **kw):
    eng = LLMEngine(model, tok, **kw)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    # the first request alone, then the rest: they arrive while its blocks are cached
    first = eng.add_request({"prompt_token_ids": prompts[0]}, params)
    eng.step()
    ids = [first] + [eng.add_request({"prompt_token_ids": p}, params) for p in prompts[1:]]
    done = eng.run()
    parts.check_scheduler(eng.scheduler)
    assert eng.allocator.num_free_blocks == eng.allocator.num_blocks, "blocks leaked after every request finished"
    return [done[i].token_ids for i in ids], eng


def _trim(toks, eos=(2,)):
    for i, t in enumerate(toks):
        if t in eos:
            return toks[: i + 1]
    return toks


@pytest.mark.slow
@pytest.mark.parametrize("kw", [
    dict(block_size=1, num_blocks=1200),
    dict(block_size=16, num_blocks=8, max_num_batched_tokens=48),  # 3 prompts of ~100 + 8 tokens in 128 slots: preempts, chunks
    dict(block_size=64, num_blocks=12),
], ids=["block1", "block16-preempt-chunked", "block64"])
def test_greedy_same_with_cache_on_and_off_and_equals_transformers(smollm2, shared_ids, hf_shared, kw):
    model, tok = smollm2
    off, eng_off = _serve(model, tok, shared_ids, enable_prefix_caching=False, **kw)
    on, eng_on = _serve(model, tok, shared_ids, enable_prefix_caching=True, **kw)
    assert on == off, f"{kw}: prefix caching changed the greedy tokens"
    for i, (g, want) in enumerate(zip(on, hf_shared)):
        assert g == _trim(want), f"{kw}: prompt {i}: minipaged {g} vs transformers {want}"
    st_on = eng_on.stats()
    assert st_on["prefix_hit_tokens"] > 0, f"{kw}: no prompt found the shared system prompt in the cache"
    computed_on = sum(s.prefill_tokens for s in eng_on.trace.steps)
    computed_off = sum(s.prefill_tokens for s in eng_off.trace.steps)
    assert computed_on < computed_off
    if kw.get("num_blocks") == 8:
        assert (eng_on.scheduler.num_preemptions, eng_off.scheduler.num_preemptions) > (0, 0) and min(
            eng_on.scheduler.num_preemptions, eng_off.scheduler.num_preemptions) > 0, "meant to preempt, with the cache on and off"
        assert max(s.prefill_tokens + s.decode_tokens for s in eng_on.trace.steps) <= 48


# -- parallel sampling on a tiny random model ------------------------------------------------------
def _tiny_prompt(tok):
    return tok.encode("the cat sat on the mat and then the dog") or [5, 6, 7]


def _run(model, tok, reqs, **kw):
    eng = LLMEngine(model, tok, **kw)
    ids = [eng.add_request({"prompt_token_ids": p}, sp) for p, sp in reqs]
    done = eng.run()
    parts.check_scheduler(eng.scheduler)
    assert eng.allocator.num_free_blocks == eng.allocator.num_blocks, "blocks leaked"
    return [done[i] for i in ids], eng


def test_each_sample_equals_a_single_request_with_its_seed(tiny_model):
    model, tok = tiny_model
    p = _tiny_prompt(tok)
    params = SamplingParams(n=3, max_tokens=10, temperature=0.9, seed=7, ignore_eos=True)
    (out,), eng = _run(model, tok, [(p, params)], block_size=2, enable_prefix_caching=False)
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert out.token_ids == out.outputs[0].token_ids and out.text == out.outputs[0].text
    assert eng.stats()["generated_tokens"] == 30
    for i, o in enumerate(out.outputs):
        (alone,), _ = _run(model, tok, [(p, SamplingParams(max_tokens=10, temperature=0.9, seed=7 + i, ignore_eos=True))],
                           block_size=2)
        assert o.token_ids == alone.token_ids, f"sample {i} differs from a single request with seed {7 + i}"
    # and inside a busy batch, with preemption (a small pool) and the cache on
    busy = [(p, params)] + [(_tiny_prompt(tok)[: 3 + k], SamplingParams(max_tokens=6, temperature=1.0, seed=k, ignore_eos=True))
                            for k in range(4)]
    outs, eng = _run(model, tok, busy, block_size=2, num_blocks=24, max_num_batched_tokens=8)
    assert [o.token_ids for o in outs[0].outputs] == [o.token_ids for o in out.outputs]
    assert len(outs[0].outputs) == 3 and all(len(o.outputs) == 1 for o in outs[1:])


def test_samples_share_the_prompt_blocks(tiny_model):
    model, tok = tiny_model
    p = (_tiny_prompt(tok) * 4)[:40]
    kw = dict(block_size=4, enable_prefix_caching=False)
    (forked,), e1 = _run(model, tok, [(p, SamplingParams(n=4, max_tokens=6, temperature=1.0, seed=1, ignore_eos=True))], **kw)
    sep, e2 = _run(model, tok, [(p, SamplingParams(max_tokens=6, temperature=1.0, seed=1 + i, ignore_eos=True))
                                for i in range(4)], **kw)
    assert [o.token_ids for o in forked.outputs] == [o.token_ids for o in sep]
    # 4 x 12 blocks apart; forked: 10 full prompt blocks once + each sample's own last block(s)
    assert e1.trace.peak_blocks_used < e2.trace.peak_blocks_used / 2
    assert sum(s.prefill_tokens for s in e1.trace.steps) == len(p), "the prompt is computed once"


def test_greedy_samples_through_preemption_equal_one_greedy_request(tiny_model):
    model, tok = tiny_model
    p = _tiny_prompt(tok)
    (single,), _ = _run(model, tok, [(p, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))], block_size=2)
    one = parts.cdiv(len(p) + 11, 2)  # blocks one sample needs at its longest: 3 samples cannot all fit
    (out,), eng = _run(model, tok, [(p, SamplingParams(n=3, max_tokens=12, temperature=0, ignore_eos=True))],
                       block_size=2, num_blocks=one + 2, max_num_batched_tokens=6)
    assert eng.stats()["preemptions"] > 0, "the small pool was meant to preempt samples"
    assert all(o.token_ids == single.token_ids for o in out.outputs)


def test_abort_and_bad_n(tiny_model):
    model, tok = tiny_model
    p = _tiny_prompt(tok)
    eng = LLMEngine(model, tok, block_size=2, max_num_seqs=4)
    before = eng.add_request({"prompt_token_ids": p}, SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=0))
    after = eng.add_request({"prompt_token_ids": p[:4]}, SamplingParams(n=2, max_tokens=8, temperature=1.0, seed=0))
    assert eng.abort_request(before)  # before its prompt ran: the samples never fork
    eng.step()
    eng.step()
    assert eng.abort_request(after)  # after the fork: both samples end
    outs = {o.request_id: o for o in eng.step()}
    assert outs[after].finished and [o.finish_reason for o in outs[after].outputs] == ["abort", "abort"]
    assert not eng.has_unfinished_requests()
    parts.check_scheduler(eng.scheduler)
    assert eng.allocator.num_free_blocks == eng.allocator.num_blocks
    for bad in (0, True, 1.5):
        with pytest.raises(ValueError, match="n .samples"):
            SamplingParams(n=bad)
    with pytest.raises(ValueError, match="max_num_seqs=4"):  # checked before any sample is made
        eng.add_request({"prompt_token_ids": p}, SamplingParams(n=5))
    assert not eng.has_unfinished_requests()

    class LearnerScheduler(Scheduler):
        def schedule(self):
            return super().schedule()

    eng2 = LLMEngine(model, tok, scheduler_cls=LearnerScheduler)
    assert eng2.prefix_cache is None and eng2.config.enable_prefix_caching is False
    with pytest.raises(ValueError, match="parallel_sampling"):
        eng2.add_request({"prompt_token_ids": p}, SamplingParams(n=2))
    with pytest.raises(ValueError, match="prefix_caching"):
        LLMEngine(model, tok, scheduler_cls=LearnerScheduler, enable_prefix_caching=True)


def test_trace_records_hit_rate_cached_blocks_and_evictions(tiny_model):
    model, tok = tiny_model
    p = _tiny_prompt(tok) * 2
    eng = LLMEngine(model, tok, block_size=2, num_blocks=parts.cdiv(len(p) + 4, 2) + 1)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    for prompt in (p, p, [9] + p[1:]):  # the same prompt twice, then one that evicts
        eng.add_request({"prompt_token_ids": prompt}, params)
        eng.run()
    last = eng.trace.steps[-1]
    assert last.hit_tokens > 0 and last.queried_tokens == 3 * len(p) and 0 < last.hit_rate < 1
    assert last.cached_blocks == eng.prefix_cache.num_cached_blocks and last.evictions > 0
    assert eng.trace.summary()["prefix_hit_rate"] == last.hit_rate
    assert eng.trace.to_dict()["steps"][-1]["evictions"] == last.evictions
    off = LLMEngine(model, tok, block_size=2, enable_prefix_caching=False)
    off.add_request({"prompt_token_ids": p}, params)
    off.run()
    assert off.trace.steps[-1].hit_rate is None


def test_a_learners_prefix_cache_and_allocator_serve_the_engine(tiny_model):
    """Workbook 08's solved MyPrefixCache, over workbook 02's solved MyBlockAllocator, plugs in
    through Parts.prefix_cache_cls and gives the reference engine's greedy tokens, with hits."""
    from pathlib import Path

    from minipaged.checks._workbooks import run_workbook_cells

    root = Path(__file__).resolve().parent.parent / "solutions"
    cache_cls = run_workbook_cells(root / "08_prefix_caching.ipynb")["MyPrefixCache"]
    alloc_cls = run_workbook_cells(root / "02_block_allocator.ipynb")["MyBlockAllocator"]
    model, tok = tiny_model
    p = _tiny_prompt(tok) * 3
    reqs = [(p + [k], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)) for k in range(3, 7)]
    ref, _ = _run(model, tok, reqs, block_size=2, enable_prefix_caching=False)
    outs, eng = _run(model, tok, reqs, block_size=2, num_blocks=40, max_num_batched_tokens=16,
                     prefix_cache_cls=cache_cls, allocator_cls=alloc_cls)
    assert isinstance(eng.prefix_cache, cache_cls) and isinstance(eng.prefix_cache.pool, alloc_cls)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert eng.stats()["prefix_hit_tokens"] > 0
