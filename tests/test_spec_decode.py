"""Speculative decoding's pure pieces (minipaged/spec_decode.py): the n-gram proposer against a
brute-force oracle, the settings' checks, the acceptance rule (greedy exactly; sampled against
plain sampling on a small vocabulary), and the block-table rollback (state checked after every
operation, 0 leaked blocks)."""
from __future__ import annotations

import collections

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minipaged.block_allocator import BlockAllocator
from minipaged.block_table import BlockTable
from minipaged.data import Sequence
from minipaged.parts import cdiv, check_pool, check_table, fork_table
from minipaged.prefix_cache import PrefixCache
from minipaged.spec_decode import (
    SpecDecoder,
    SpeculativeConfig,
    SpecStats,
    accept_greedy,
    accept_point_mass,
    draft_room,
    propose_ngram,
    rollback,
    truncate_table,
    verify_run,
)


# -- the proposer ---------------------------------------------------------------------------------
def brute_force_ngram(toks, k, lo, hi):
    """The definition, spelled out: the largest n in hi..lo whose suffix occurs earlier; its latest
    earlier occurrence; up to k tokens after it."""
    L = len(toks)
    for n in range(hi, lo - 1, -1):
        if n > L - 1:
            continue
        suffix = toks[L - n :]
        for j in range(L - n - 1, -1, -1):  # start of an earlier occurrence (it ends at j + n - 1 <= L - 2)
            if toks[j : j + n] == suffix:
                return toks[j + n : j + n + k]
    return []


def test_propose_examples():
    #        0  1  2  3  4  5  6  7
    toks = [1, 2, 3, 4, 9, 2, 3]
    assert propose_ngram(toks, 3, 1, 3) == [4, 9, 2]  # "2 3" occurred at 1..2, followed by 4 9 2
    assert propose_ngram(toks, 1, 1, 3) == [4]
    assert propose_ngram(toks, 3, 3, 3) == []  # "9 2 3" never occurred before
    assert propose_ngram([5, 5, 5], 4, 1, 2) == [5]  # overlap: "5 5" at 0..1, then only one token follows
    assert propose_ngram([1, 2, 3], 2, 1, 4) == []
    # the longest n-gram wins over a more recent shorter one
    assert propose_ngram([7, 1, 2, 8, 3, 2, 9, 1, 2], 2, 1, 3) == [8, 3]
    # among equally long matches, the most recent
    assert propose_ngram([4, 2, 8, 4, 2, 9, 4, 2], 1, 2, 2) == [9]


@settings(max_examples=400, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=0, max_size=40), st.integers(1, 5), st.integers(1, 4), st.integers(0, 3))
def test_propose_matches_the_definition(toks, k, lo, extra):
    hi = lo + extra
    assert propose_ngram(toks, k, lo, hi) == brute_force_ngram(toks, k, lo, hi)


def test_draft_room_respects_max_tokens_and_context():
    seq = Sequence("a", [1, 2, 3], max_tokens=5)
    seq.output_token_ids = [4, 5]  # 2 of 5: at most 5 - 1 - 2 = 2 more slots may ever be written
    assert draft_room(seq) == 2
    assert draft_room(seq, max_model_len=6) == 1
    seq.output_token_ids = [4, 5, 6, 7]
    assert draft_room(seq) == 0


# -- the settings -----------------------------------------------------------------------------------
def test_config_defaults_as_vllm():
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)
    c = SpeculativeConfig.from_dict({"num_speculative_tokens": 2, "prompt_lookup_max": 4})
    assert (c.method, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", 4, 4)
    c = SpeculativeConfig.from_dict({"num_speculative_tokens": 2, "prompt_lookup_min": 2})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (2, 2)
    assert SpeculativeConfig.from_dict(None) is None
    assert SpeculativeConfig.from_dict(c) is c


@pytest.mark.parametrize("spec, match", [
    ({"num_speculative_tokens": 0}, "num_speculative_tokens must be an int >= 1"),
    ({"num_speculative_tokens": True}, "num_speculative_tokens must be an int >= 1"),
    ({}, "needs num_speculative_tokens"),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min=4 > prompt_lookup_max=2"),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min must be an int >= 1"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "method 'eagle' is not supported"),
    ({"num_speculative_token": 2}, "Did you mean 'num_speculative_tokens'"),
])
def test_config_errors(spec, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig.from_dict(spec)
    with pytest.raises(TypeError, match="must be a dict"):
        SpeculativeConfig.from_dict('{"num_speculative_tokens": 2}')


# -- accepting --------------------------------------------------------------------------------------
def test_accept_greedy_examples():
    assert accept_greedy([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]  # all kept, plus the bonus
    assert accept_greedy([5, 6, 7], [5, 9, 7, 8]) == [5, 9]  # the first mismatch ends the run, with the target's token
    assert accept_greedy([5, 6, 7], [1, 6, 7, 8]) == [1]
    assert accept_greedy([], [4]) == [4]
    with pytest.raises(ValueError):
        accept_greedy([1, 2], [1, 2])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 2), max_size=6), st.data())
def test_accept_greedy_is_what_one_token_a_step_gives(draft, data):
    target = data.draw(st.lists(st.integers(0, 2), min_size=len(draft) + 1, max_size=len(draft) + 1))
    run = accept_greedy(draft, target)
    # decoding one token a step with the same argmaxes: target[0], then (if it equalled the draft,
    # so the context is the same) target[1], ... until the context would differ from the draft's
    one_a_step = []
    for j, t in enumerate(target):
        one_a_step.append(t)
        if j == len(draft) or t != draft[j]:
            break
    assert run == one_a_step
    assert 1 <= len(run) <= len(draft) + 1
    assert run[:-1] == draft[: len(run) - 1]


def test_verify_run_draws_only_while_accepting():
    calls = []

    def target_at(j):
        calls.append(j)
        return [3, 4, 0, 0][j]

    assert verify_run([3, 5, 6], target_at) == [3, 4]
    assert calls == [0, 1]


# A tiny "model": the next token's distribution depends on the previous token (vocab 4).
P = torch.tensor([[0.5, 0.2, 0.2, 0.1], [0.1, 0.6, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25], [0.05, 0.05, 0.1, 0.8]],
                 dtype=torch.float64)


def _plain(prev, steps, g):
    out = []
    for _ in range(steps):
        prev = int(torch.multinomial(P[prev].float(), 1, generator=g))
        out.append(prev)
    return tuple(out)


def _speculative(prev, steps, g, draft_of, rule):
    """Generate ``steps`` tokens, verifying a draft of up to 2 tokens each step with ``rule``."""
    out = []
    while len(out) < steps:
        ctx = prev if not out else out[-1]
        draft = draft_of(ctx)[: steps - len(out)]
        run = []
        for j in range(len(draft) + 1):
            p = P[ctx]
            if j < len(draft):
                ok, t = rule(draft[j], p, g)
                run.append(t)
                if not ok:
                    break
                ctx = t
            else:
                run.append(int(torch.multinomial(p.float(), 1, generator=g)))
        out.extend(run)
    return tuple(out[:steps])


def _sample_then_compare(x, p, g):
    t = int(torch.multinomial(p.float(), 1, generator=g))
    return t == x, t


def _always_accept(x, p, g):  # a wrong rule: keeps every draft
    return True, x


def _tv(a: collections.Counter, b: collections.Counter, n: int) -> float:
    keys = set(a) | set(b)
    return 0.5 * sum(abs(a[k] - b[k]) for k in keys) / n


@pytest.mark.parametrize("rule", [accept_point_mass, _sample_then_compare])
def test_sampled_acceptance_keeps_the_target_distribution(rule):
    """Two tokens after token 0, the draft always guessing "1": the joint distribution of the 16
    outcomes (draft kept then the bonus, or rejected then a plain step) matches plain sampling
    (total variation under 0.05 at 8,000 samples, about 0.02 expected from noise; the rule that
    keeps every draft is off by more than 0.3, checked below)."""
    n = 8000
    g = torch.Generator().manual_seed(7)
    plain = collections.Counter(_plain(0, 2, g) for _ in range(n))
    g = torch.Generator().manual_seed(8)
    spec = collections.Counter(_speculative(0, 2, g, lambda c: [1], rule) for _ in range(n))
    assert _tv(plain, spec, n) < 0.05, f"total variation {_tv(plain, spec, n):.3f}"


def test_the_distribution_check_can_fail():
    n = 4000
    g = torch.Generator().manual_seed(7)
    plain = collections.Counter(_plain(0, 2, g) for _ in range(n))
    spec = collections.Counter(_speculative(0, 2, g, lambda c: [1], _always_accept) for _ in range(n))
    assert _tv(plain, spec, n) > 0.3


def test_accept_point_mass_probability():
    p = torch.tensor([0.7, 0.2, 0.1])
    g = torch.Generator().manual_seed(0)
    res = [accept_point_mass(1, p, g) for _ in range(10000)]
    rate = sum(ok for ok, _ in res) / len(res)
    assert abs(rate - 0.2) < 0.02
    rejected = collections.Counter(t for ok, t in res if not ok)
    assert 1 not in rejected  # the rejected draft is never the replacement
    assert abs(rejected[0] / sum(rejected.values()) - 0.7 / 0.8) < 0.03
    assert accept_point_mass(2, torch.tensor([0.0, 0.0, 1.0]), g) == (True, 2)


# -- rolling back -----------------------------------------------------------------------------------
def _check(pool, tables):
    check_pool(pool)
    for t in tables:
        check_table(t)


def test_truncate_frees_blocks_that_become_empty():
    pool = BlockAllocator(8, 4)
    t = BlockTable(pool)
    t.append_tokens(6)  # 2 blocks
    before = list(t.blocks)
    t.append_tokens(5)  # 11 tokens: 3 blocks (a verify step's drafts)
    new = t.blocks[2]
    assert truncate_table(t, 7) == [new]  # 7 slots need 2 blocks: the third goes back
    assert t.blocks == before and t.num_tokens == 7 and pool.ref_count(new) == 0
    _check(pool, [t])
    assert truncate_table(t, 7) == []
    assert truncate_table(t, 0) == list(before)
    assert t.blocks == [] and pool.num_free_blocks == 8
    with pytest.raises(ValueError, match="never grows"):
        truncate_table(t, 1)


def test_truncate_a_shared_table_drops_only_its_reference():
    pool = BlockAllocator(8, 2)
    a = BlockTable(pool)
    a.append_tokens(5)
    b = fork_table(a)
    truncate_table(b, 1)
    assert b.blocks == a.blocks[:1] and all(pool.ref_count(x) == 1 for x in a.blocks[1:])
    assert pool.ref_count(a.blocks[0]) == 2
    _check(pool, [a, b])


def test_truncate_uses_the_tables_own_member():
    calls = []

    class MyTable(BlockTable):
        def truncate(self, num_tokens):
            calls.append(num_tokens)
            keep = cdiv(num_tokens, self.block_size)
            for x in reversed(self.blocks[keep:]):
                self.allocator.free(x)
            self.blocks = self.blocks[:keep]
            self.num_tokens = num_tokens

    pool = BlockAllocator(4, 2)
    t = MyTable(pool)
    t.append_tokens(5)
    dropped = truncate_table(t, 2)
    assert calls == [2] and len(dropped) == 2 and t.num_tokens == 2
    _check(pool, [t])


def test_rollback_moves_num_computed_tokens():
    pool = BlockAllocator(8, 4)
    seq = Sequence("s", [1, 2, 3, 4, 5])
    seq.block_table = BlockTable(pool)
    seq.block_table.append_tokens(9)  # 5 real + 4 draft slots written by a verify step
    seq.num_computed_tokens = 9
    rollback(seq, 6)
    assert seq.num_computed_tokens == 6 and seq.block_table.num_tokens == 6 and len(seq.block_table.blocks) == 2
    _check(pool, [seq.block_table])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 5), st.booleans(), st.lists(st.tuples(st.integers(0, 3), st.integers(0, 6), st.integers(0, 6)), max_size=30))
def test_append_then_rollback_never_leaks(block_size, cached, ops):
    """Tables that grow by a verify step's slots and roll back part of them, over a plain pool or a
    prefix cache, some of them forks: after every operation the pool and tables agree; at the
    end, with every table freed, every block is free."""
    base = BlockAllocator(24, block_size)
    pool = PrefixCache(base) if cached else base
    tables = [BlockTable(pool)]
    for which, grow, back in ops:
        t = tables[which % len(tables)]
        if which == 3 and len(tables) < 4 and t.num_tokens:
            tables.append(fork_table(t))
            _check(pool, tables)
            continue
        if t.blocks_needed(grow) > pool.num_free_blocks:
            continue
        t.append_tokens(grow)
        keep = max(0, t.num_tokens - back)
        dropped = truncate_table(t, keep)
        assert t.num_tokens == keep and len(t.blocks) == cdiv(keep, block_size)
        assert all(x not in t.blocks for x in dropped)
        _check(pool, tables)
    for t in tables:
        t.free()
    check_pool(pool)
    assert pool.num_free_blocks == pool.num_blocks, "a rolled-back block leaked"


# -- the engine's state (without a model) ------------------------------------------------------------
def test_spec_decoder_proposes_only_for_decoding_sequences():
    from minipaged.sampling import SamplingParams

    dec = SpecDecoder(SpeculativeConfig.from_dict({"num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}))
    seq = Sequence("a", [1, 2, 3, 1, 2], max_tokens=10, sampling_params=SamplingParams(temperature=0))
    seq.output_token_ids = [3]
    seq.num_computed_tokens = seq.num_tokens - 1
    prefill = Sequence("b", [1, 2, 1, 2], max_tokens=10)
    penalised = Sequence("c", [1, 2, 3, 1, 2], max_tokens=10, sampling_params=SamplingParams(repetition_penalty=1.2))
    penalised.output_token_ids = [3]
    penalised.num_computed_tokens = penalised.num_tokens - 1
    dec.propose([seq, prefill, penalised])
    assert seq.spec_token_ids == [1, 2, 3]
    assert prefill.spec_token_ids == [] and penalised.spec_token_ids == []
    seq.output_token_ids = [3] + [0] * 7  # 8 of 10: room for one draft only
    seq.num_computed_tokens = seq.num_tokens - 1
    dec.propose([seq])
    assert len(seq.spec_token_ids) <= 1


def test_spec_stats():
    s = SpecStats()
    s.add(3, 2)
    s.add(2, 0)
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (2, 5, 2)
    assert s.acceptance_rate == pytest.approx(0.4) and s.mean_acceptance_length == pytest.approx(2.0)
    assert s.accepted_per_pos == [1, 1, 0]


# -- backing off when drafts keep failing ---------------------------------------------------------------
def test_backoff_pauses_after_misses_doubles_and_resets():
    from minipaged.spec_decode import BACKOFF_AFTER, PAUSE_FIRST, PAUSE_MAX, Backoff

    b = Backoff()
    for _ in range(BACKOFF_AFTER - 1):
        assert b.record(0) is False and b.wants_draft()
    assert b.record(0) is True, "the third miss in a row starts a pause"
    assert [b.wants_draft() for _ in range(PAUSE_FIRST)] == [False] * PAUSE_FIRST
    assert b.wants_draft(), "the pause lasts PAUSE_FIRST decode steps, no more"
    for _ in range(BACKOFF_AFTER):
        b.record(0)
    assert sum(not b.wants_draft() for _ in range(4 * PAUSE_FIRST)) == 2 * PAUSE_FIRST, "the next pause is twice as long"
    b.record(0)
    b.record(2)  # a kept token: the misses and the pause length start over
    assert (b.misses, b.skip, b.pause) == (0, 0, PAUSE_FIRST)
    for _ in range(50 * BACKOFF_AFTER):
        b.record(0)
        b.skip = 0
    assert b.pause == PAUSE_MAX, "the pause never grows past PAUSE_MAX"


def _fake_verify(dec, seq, target_token):
    """One verifying step for ``seq`` through SpecDecoder.verify, the target choosing ``target_token``
    at every position (so a draft is kept only where it equals it)."""
    from types import SimpleNamespace

    d = len(seq.spec_token_ids)
    inputs = SimpleNamespace(samplers=[SimpleNamespace(seq=seq)], num_drafts=[d], sample_rows=[0])
    hidden = torch.zeros(d + 1, 4)

    def compute_logits(h):
        logits = torch.zeros(h.shape[0], 64)
        logits[:, target_token] = 1.0
        return logits

    return dec.verify(inputs, hidden, {seq.seq_id: target_token}, compute_logits, sampler=None)[seq.seq_id]


@pytest.mark.parametrize("backoff", [True, False])
def test_spec_decoder_stops_proposing_for_a_sequence_whose_drafts_keep_failing(backoff):
    from minipaged.sampling import SamplingParams
    from minipaged.spec_decode import BACKOFF_AFTER, PAUSE_FIRST

    cfg = SpeculativeConfig.from_dict({"num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2})
    dec = SpecDecoder(cfg, backoff=backoff)
    seq = Sequence("a", [1, 2, 3, 1, 2], max_tokens=1000, sampling_params=SamplingParams(temperature=0))
    seq.output_token_ids = [3]
    drafted = []
    for step in range(BACKOFF_AFTER + PAUSE_FIRST + 1):
        seq.num_computed_tokens = seq.num_tokens - 1
        dec.propose([seq])
        drafted.append(bool(seq.spec_token_ids))
        if seq.spec_token_ids:  # the target never agrees: token 50, never in the text
            assert _fake_verify(dec, seq, 50) == [50]
        seq.spec_token_ids = []
    if not backoff:
        assert all(drafted) and dec.num_pauses == 0
        return
    assert drafted == [True] * BACKOFF_AFTER + [False] * PAUSE_FIRST + [True], drafted
    assert dec.as_dict()["num_pauses"] == 1 and dec.as_dict()["num_paused_steps"] == PAUSE_FIRST
    # a sequence whose drafts are kept never pauses
    other = Sequence("b", [1, 2, 3, 1, 2], max_tokens=1000, sampling_params=SamplingParams(temperature=0))
    other.output_token_ids = [3]
    for _ in range(3 * BACKOFF_AFTER):
        other.num_computed_tokens = other.num_tokens - 1
        dec.propose([other])
        assert other.spec_token_ids, "a sequence with kept drafts was paused"
        run = _fake_verify(dec, other, other.spec_token_ids[0])
        assert run[0] == other.spec_token_ids[0]
        other.spec_token_ids = []
    dec.forget("a")
    assert "a" not in dec._backoff and "a" not in dec.per_seq
