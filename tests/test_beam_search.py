"""Beam search on shared blocks (issue 36): the rule against a plain beam search over
transformers' logits, the block tables under random pruning, the paper's sharing arithmetic,
and bad input.

- SmolLM2: ``LLM.beam_search`` at widths 2-4 on the parity prompts equals ``reference_beam_search``
  over transformers' logits from the same GGUF (a near-tie at a cut-off may swap hypotheses; then
  the scores still agree).
- A tiny random model (its logits make the pruning random): under hypothesis-chosen widths, prompts,
  block sizes and small pools (preemption included), the scheduler's invariants hold after every
  step, copy-on-write only ever copies a table's last block, dropped beams hold no block, every
  block is free at the end, and the result equals the reference over the same model's logits.
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from conftest import tiny_hf_model
from minipaged import BeamSearchParams
from minipaged.beam_search import (BeamSearchOutput, SharingCounter, beam_score, reference_beam_search, select_beams,
                                   sharing_saving, worst_case_blocks)
from minipaged.engine import LLMEngine
from minipaged.parts import check_scheduler
from minipaged.sampling import SamplingParams

CHAT = [  # the parity prompts of test_engine.py
    "What is the capital of France?",
    "Write a haiku about autumn.",
    "Explain recursion in one sentence.",
    "List three primary colours.",
]


# -- the arithmetic and the rule, by hand -------------------------------------------------
def test_sharing_saving_on_a_hand_built_case():
    # three beams of one prompt: blocks 0, 1 shared by all, 2 and 3 their own, beam c diverged early
    tables = [[0, 1, 2], [0, 1, 3], [0, 4]]
    logical, physical, saving = sharing_saving(tables)
    assert (logical, physical) == (8, 5)  # 3 + 3 + 2 without sharing; {0, 1, 2, 3, 4} with it
    assert saving == pytest.approx(3 / 8)  # blocks saved by sharing / blocks needed without it
    assert sharing_saving([[0, 1], [2, 3]])[2] == 0.0  # nothing shared, nothing saved
    assert sharing_saving([]) == (0, 0, 0.0)
    counter = SharingCounter()  # over a run: each step weighs the same
    counter.add(tables)  # 8 needed, 5 held
    counter.add([[0, 1], [2, 3]])  # 4 needed, 4 held
    assert (counter.logical, counter.physical) == (12, 9) and counter.saving == pytest.approx(3 / 12)


def test_beam_score_and_selection_by_hand():
    assert beam_score(10, -5.0, False, 1.0) == pytest.approx(-0.5)
    assert beam_score(10, -5.0, True, 1.0) == pytest.approx(-5.0 / 9)  # a final EOS is not counted
    assert beam_score(10, -5.0, False, 0.0) == pytest.approx(-5.0)
    beams = [("a", -1.0, [(5, -0.1), (2, -0.2), (7, -3.0)]), ("b", -0.5, [(6, -0.9), (8, -1.0)])]
    live, done = select_beams(beams, 2, eos=[2], ignore_eos=False)
    assert live == [("a", 5, pytest.approx(-1.1)), ("b", 6, pytest.approx(-1.4))]
    assert done == [("a", 2, pytest.approx(-1.2))]  # EOS is a finished hypothesis, not a live beam
    live, _ = select_beams(beams, 2, eos=[2], ignore_eos=True)
    assert [t for _, t, _ in live] == [5, 2]


def test_worst_case_blocks():
    assert worst_case_blocks(10, 7, 3, 4) == 3 * 4  # 16 tokens -> 4 blocks, a whole copy per beam
    assert worst_case_blocks(10, 7, 3, 4, max_model_len=12) == 3 * 3


@pytest.mark.parametrize("kw, what", [
    (dict(beam_width=0, max_tokens=4), "beam_width"),
    (dict(beam_width=2.0, max_tokens=4), "beam_width"),
    (dict(beam_width=2, max_tokens=0), "max_tokens"),
    (dict(beam_width=2, max_tokens=4, length_penalty=float("nan")), "length_penalty"),
    (dict(beam_width=2, max_tokens=4, length_penalty=float("inf")), "length_penalty"),
    (dict(beam_width=2, max_tokens=4, temperature=-1.0), "temperature"),
])
def test_bad_params_are_value_errors(kw, what):
    with pytest.raises(ValueError, match=what):
        BeamSearchParams(**kw)


def test_vllm_import_paths():
    from minipaged.sampling_params import BeamSearchParams as B2, SamplingParams as S2

    assert B2 is BeamSearchParams and S2 is SamplingParams


# -- a tiny random model: random pruning, every step checked ------------------------------
@pytest.fixture(scope="module")
def tiny():
    from test_model_parity import ours_from

    hf = tiny_hf_model("llama", vocab_size=64, seed=3)
    return hf, ours_from(hf)


def _hf_next(hf):
    memo = {}

    def next_logits(ids):
        key = tuple(ids)
        if key not in memo:
            with torch.no_grad():
                memo[key] = hf(torch.tensor([ids])).logits[0, -1].float()
        return memo[key]
    return next_logits


def _run_checked(eng, ids):
    """Step until done, checking the invariants and copy-on-write after every step."""
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
        check_scheduler(eng.scheduler, eng.config.max_num_seqs)
        rec = eng.trace.steps[-1] if eng.trace is not None and eng.trace.steps else None
        if rec is not None:
            lasts = {b[-1] for b, _ in rec.tables.values() if b}
            for src, dst in rec.copied:  # copy-on-write copies only the last, partly written block
                assert dst in lasts or all(dst not in b for b, _ in rec.tables.values()), (src, dst, rec.tables)
        for group in eng._beams.values():  # beams that fell out hold no block
            for q in group.req.samples:
                assert not q.is_finished
    assert eng.allocator.num_free_blocks == eng.allocator.num_blocks, "blocks leaked"
    return [done[i] for i in ids]


def _same(got, want, tol=1e-4):
    """Equal hypotheses, allowing a near-tie to swap them (their scores then agree)."""
    assert len(got) == len(want)
    for g, w in zip(got, want):
        if g.tokens != w.tokens:
            assert g.score == pytest.approx(w.score, abs=tol), (g, w)
        else:
            assert g.cum_logprob == pytest.approx(w.cum_logprob, abs=tol)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(width=st.integers(1, 4), block_size=st.sampled_from([1, 2, 4, 16]), seed=st.integers(0, 10_000),
       num_prompts=st.integers(1, 3), max_tokens=st.integers(1, 9), tight=st.booleans(),
       ignore_eos=st.booleans(), penalty=st.sampled_from([0.0, 1.0, 2.0]))
# found by hypothesis: an idle beam held blocks a preempted request needed (the scheduler unblocks it)
@example(width=2, block_size=1, seed=0, num_prompts=3, max_tokens=2, tight=True, ignore_eos=False, penalty=0.0)
def test_block_invariants_under_random_beam_pruning(tiny, width, block_size, seed, num_prompts, max_tokens, tight,
                                                    ignore_eos, penalty):
    hf, model = tiny
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 64, (int(torch.randint(2, 12, (1,), generator=g)),), generator=g).tolist()
               for _ in range(num_prompts)]
    params = BeamSearchParams(beam_width=width, max_tokens=max_tokens, ignore_eos=ignore_eos, length_penalty=penalty)
    need = max(worst_case_blocks(len(p), max_tokens, width, block_size) for p in prompts)
    num_blocks = max(need, worst_case_blocks(10, need, 1, block_size)) if tight else need * num_prompts * 2
    eng = LLMEngine(model, None, block_size=block_size, num_blocks=num_blocks, max_num_seqs=max(4, width),
                    record_trace=True, enable_prefix_caching=False, max_model_len=128)
    ids = [eng.add_beam_request(p, params) for p in prompts]
    if tight:  # long plain requests beside them fill the pool: beams are preempted and recomputed
        for k in range(2):
            eng.add_request(list(range(5, 15)), SamplingParams(max_tokens=need, temperature=0.0))
    outs = _run_checked(eng, ids)
    nxt = _hf_next(hf)
    for p, o in zip(prompts, outs):
        want = reference_beam_search(nxt, p, params, eos=(2,))
        assert o.finish_reason != "rejected", o.error
        _same(o.beam_sequences, want)
    if width > 1 and max_tokens > 1:
        assert eng.stats()["sharing"]["saving"] > 0  # the beams shared blocks


def test_fork_shares_and_copies_only_the_last_partial_block(tiny):
    _, model = tiny
    eng = LLMEngine(model, None, block_size=4, num_blocks=64, max_num_seqs=4, record_trace=True,
                    enable_prefix_caching=False)
    rid = eng.add_beam_request(list(range(3, 13)), BeamSearchParams(beam_width=3, max_tokens=6))  # 10 tokens: 2 full blocks + 2
    eng.step()  # the prompt, then the first forks: three beams on the prompt's three blocks
    rec = eng.trace.steps[-1]
    tables = [b for b, _ in rec.tables.values()]
    assert len(tables) == 3 and all(t == tables[0] for t in tables)
    assert all(eng.allocator.ref_count(b) == 3 for b in tables[0])  # shared: ref counts raised, no copy yet
    eng.step()  # each beam writes its token at position 10, in the shared partial block 2
    rec = eng.trace.steps[-1]
    assert len(rec.copied) >= 1 and all(src == tables[0][2] for src, _ in rec.copied)  # only the last block
    for b, _ in rec.tables.values():
        assert b[:2] == tables[0][:2]  # the full blocks stay shared
    outs = _run_checked(eng, [rid])
    assert outs[0].finished and len(outs[0].outputs) == 3


def test_a_beam_search_that_cannot_fit_is_rejected_and_others_go_on(tiny):
    _, model = tiny
    eng = LLMEngine(model, None, block_size=4, num_blocks=8, max_num_seqs=4, enable_prefix_caching=False)
    big = eng.add_beam_request(list(range(3, 15)), BeamSearchParams(beam_width=4, max_tokens=8))  # 4 x 5 blocks > 8
    small = eng.add_beam_request([5, 6, 7], BeamSearchParams(beam_width=2, max_tokens=3))
    plain = eng.add_request([5, 6, 7, 8], SamplingParams(max_tokens=4, temperature=0.0))
    done = eng.run()
    assert done[big].finish_reason == "rejected" and "beam_width=4" in done[big].error and "20" in done[big].error
    assert done[small].finished and len(done[small].outputs) == 2
    assert len(done[plain].token_ids) == 4


def test_engine_refuses_a_width_above_max_num_seqs(tiny):
    _, model = tiny
    eng = LLMEngine(model, None, block_size=4, num_blocks=64, max_num_seqs=2)
    with pytest.raises(ValueError, match="max_num_seqs=2"):
        eng.add_beam_request([5, 6], BeamSearchParams(beam_width=3, max_tokens=4))
    assert not eng.has_unfinished_requests()


def test_abort_frees_every_beam(tiny):
    _, model = tiny
    eng = LLMEngine(model, None, block_size=2, num_blocks=64, max_num_seqs=4, enable_prefix_caching=False)
    rid = eng.add_beam_request([5, 6, 7], BeamSearchParams(beam_width=4, max_tokens=20))
    for _ in range(4):
        eng.step()
    assert eng.allocator.num_free_blocks < eng.allocator.num_blocks
    assert eng.abort_request(rid)
    done = eng.run()
    assert done[rid].finish_reason == "abort"
    check_scheduler(eng.scheduler)
    assert eng.allocator.num_free_blocks == eng.allocator.num_blocks


# -- SmolLM2 against transformers -----------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("width", [2, 3, 4])
def test_beam_search_equals_transformers(smollm2, hf_smollm2, width):
    from minipaged import LLM

    model, tok = smollm2
    llm = LLM(model, tok, block_size=4, max_num_seqs=8, record_trace=True)
    prompts = [tok.apply_chat_template([{"role": "user", "content": c}]) for c in CHAT[: 4 if width == 2 else 2]]
    params = BeamSearchParams(beam_width=width, max_tokens=8)
    outs = llm.beam_search(prompts, params)
    nxt = _hf_next(hf_smollm2)
    for p, o in zip(prompts, outs):
        assert isinstance(o, BeamSearchOutput) and len(o.sequences) == width
        want = reference_beam_search(nxt, tok.encode(p), params, eos=tok.eos_token_ids)
        _same(o.sequences, want, tol=1e-3)
        best = o.sequences[0]
        assert best.text and best.text.endswith(best.output_text) and math.isfinite(best.cum_logprob)
        assert best.tokens[-len(best.output_token_ids):] == best.output_token_ids
    assert llm.engine.stats()["sharing"]["saving"] > 0
    assert any(r.copied for r in llm.engine.trace.steps)  # copy-on-write happened, and was traced


def test_llm_beam_search_reports_a_rejected_prompt_and_serves_the_others(tiny):
    from minipaged import LLM

    _, model = tiny
    llm = LLM(model, None, block_size=4, num_blocks=8, max_num_seqs=4, enable_prefix_caching=False)
    params = BeamSearchParams(beam_width=2, max_tokens=3)
    with pytest.warns(UserWarning, match="rejected"):
        big, small = llm.beam_search([{"prompt_token_ids": list(range(3, 33))}, {"prompt_token_ids": [5, 6, 7]}], params)
    assert big.sequences == [] and "16 KV blocks" in big.error and "pool has 8" in big.error
    assert small.error is None and len(small.sequences) == 2
    assert all(s.tokens[:3] == [5, 6, 7] and len(s.output_token_ids) <= 3 for s in small.sequences)
    with pytest.raises(ValueError, match="max_num_seqs=4"):
        llm.beam_search([[5, 6]], BeamSearchParams(beam_width=5, max_tokens=3))
