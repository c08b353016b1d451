"""Speculative decoding in the engine: greedy tokens equal decoding without it (over random
prompts, k, n-gram sizes, block sizes, preemption, chunked prefill and prefix caching, with the
invariants checked after every step and 0 leaked blocks), stops inside an accepted run, n > 1,
sampled requests, the settings' errors, the plan and the counts."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minipaged.engine import LLMEngine
from minipaged.llm import LLM
from minipaged.parts import check_scheduler
from minipaged.prefix_cache import check_prefix_cache
from minipaged.sampling import SamplingParams

PLAIN_SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
SPEC = {**PLAIN_SPEC, "disable_by_batch_size": 10_000}  # drafts at every batch size: the tests' many sequences speculate


def _run(model, tok, prompts, params, spec=None, backoff=True, **kw):
    """Every prompt's output (token ids, finish reason) and the engine; invariants after every step.
    ``backoff=False``: proposals never pause (SpecDecoder's back-off rule off)."""
    eng = LLMEngine(model, tok, speculative_config=spec, **kw)
    if eng.spec is not None:
        eng.spec.backoff = backoff
    ids = [eng.add_request(p, params) for p in prompts]
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
        check_scheduler(eng.scheduler)
        if eng.prefix_cache is not None:
            check_prefix_cache(eng.prefix_cache)
        for seq in eng.scheduler.running:
            assert seq.spec_token_ids == [], "a draft outlived its step"
            assert seq.num_computed_tokens <= seq.num_tokens - 1 or not seq.output_token_ids
    assert eng.allocator.num_free_blocks == eng.allocator.num_blocks, "blocks leaked after every request finished"
    return [(done[i].outputs[0].token_ids if len(done[i].outputs) == 1 else [o.token_ids for o in done[i].outputs],
             done[i].finish_reason) for i in ids], eng


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(
    prompts=st.lists(st.lists(st.sampled_from([5, 9, 17, 33, 60, 61]), min_size=1, max_size=20), min_size=1, max_size=3),
    k=st.integers(1, 5), lo=st.integers(1, 3), extra=st.integers(0, 2), block_size=st.sampled_from([1, 2, 4, 16]),
    small_pool=st.booleans(), caching=st.booleans(), budget=st.sampled_from([4, 512]),
)
def test_greedy_tokens_equal_without_speculation(tiny_model, prompts, k, lo, extra, block_size, small_pool, caching, budget):
    model, tok = tiny_model
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    kw = dict(block_size=block_size, enable_prefix_caching=caching, max_num_batched_tokens=budget)
    if small_pool:
        kw["num_blocks"] = -(-36 // block_size) + 1  # one request's worth and a block: others wait or are preempted
    spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": lo, "prompt_lookup_max": lo + extra}
    want, _ = _run(model, tok, prompts, params, **kw)
    got, eng = _run(model, tok, prompts, params, spec, **kw)
    assert got == want, f"speculation changed the greedy tokens ({kw}, {spec})"


def test_drafts_are_accepted_and_counted(tiny_model):
    model, tok = tiny_model
    prompts = [[5, 9, 17, 5, 9, 17, 5, 9], [60, 61, 60, 61, 60]]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    want, _ = _run(model, tok, prompts, params)
    got, eng = _run(model, tok, prompts, params, SPEC)
    assert got == want
    s = eng.stats()["spec_decode"]
    assert s["num_drafts"] > 0 and s["num_accepted_tokens"] > 0, s
    assert 0 < s["acceptance_rate"] <= 1 and s["mean_acceptance_length"] > 1
    assert s["num_accepted_tokens"] == sum(s["accepted_per_pos"])
    # fewer steps than tokens: some steps gave a sequence more than one token
    assert eng.num_steps < 1 + max(len(t) for t, _ in got), eng.num_steps
    assert "speculative" in eng.plan.routes and "layers" in eng.plan.routes["speculative"] or "model" in eng.plan.routes["speculative"]


def test_a_stop_inside_an_accepted_run_ends_the_request_there(tiny_model):
    model, tok = tiny_model
    prompts = [[5, 9, 17, 5, 9, 17, 5, 9], [60, 61, 60, 61, 60]]
    base = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    plain, _ = _run(model, tok, prompts, base)
    for (toks, _), p in zip(plain, prompts):
        for stop_at in (3, 7, 12):  # stop on the token at several places in the answer
            stop = toks[stop_at]
            params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop_token_ids=[stop])
            want, _ = _run(model, tok, [p], params)
            got, eng = _run(model, tok, [p], params, SPEC)
            assert got == want and got[0][1] == "stop" and got[0][0][-1] == stop
    # max_tokens inside a run: exactly max_tokens tokens
    for m in (1, 2, 5, 9):
        got, _ = _run(model, tok, prompts, SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True), SPEC)
        assert [len(t) for t, _ in got] == [m, m]


def test_a_stop_string_inside_an_accepted_run_and_the_rollback(tiny_model):
    """Scheduler.update given an accepted run: the K/V of the rejected drafts is rolled back, and
    the run's tokens reach the stop checker one by one, so a stop string inside it ends the
    request at that token (and no text of it is returned)."""
    from minipaged.block_allocator import BlockAllocator
    from minipaged.data import Sequence
    from minipaged.detokenizer import StopChecker
    from minipaged.scheduler import Scheduler

    _, tok = tiny_model
    words = tok.encode(" the cat sat on the mat")
    pool = BlockAllocator(32, 2)
    sched = Scheduler(pool)
    seq = Sequence("s", tok.encode("hello world"), max_tokens=40)
    seq.stop_checker = StopChecker.for_sequence(seq, stop=["sat"], tokenizer=tok)
    assert sched.add_request(seq)
    out = sched.schedule()
    sched.update(out, {"s": words[0]})  # the prefill's token
    wrong = next(t for t in range(3, 300) if t != words[3])
    drafts = [words[1], words[2], wrong, wrong, wrong]
    seq.spec_token_ids = list(drafts)
    out = sched.schedule()
    (s,) = out.scheduled
    assert s.num_new_tokens == 1 + len(drafts) and s.samples
    assert seq.block_table.num_tokens == seq.num_tokens + len(drafts)
    # the target kept two drafts and disagreed on the third: the run is the two, then its own token
    sched.update(out, {"s": list(words[1:4])})
    assert seq.output_token_ids == list(words[:4]) and seq.num_computed_tokens == seq.num_tokens - 1
    assert seq.block_table.num_tokens == seq.num_computed_tokens  # the three rejected drafts' slots are gone
    assert len(seq.block_table.blocks) == -(-seq.num_computed_tokens // 2)
    check_scheduler(sched)
    # every draft kept, and the run spells "sat": the request ends on the token that completes it
    seq.spec_token_ids = list(words[4:12])
    out = sched.schedule()
    sched.update(out, {"s": list(words[4:13])})
    assert seq.is_finished and seq.finish_reason.value == "stop"
    n = len(seq.output_token_ids)
    assert seq.output_token_ids == list(words[:n]) and n < 13
    assert tok.decode(words[:n]).endswith("sat") and "sat" not in seq.stop_checker.text
    assert pool.num_free_blocks == pool.num_blocks


def test_parallel_sampling_and_copy_on_write(tiny_model):
    model, tok = tiny_model
    prompts = [[5, 9, 17, 5, 9, 17, 5, 9, 17], [60, 61, 60, 61, 60]]
    greedy_n = SamplingParams(n=3, max_tokens=16, temperature=0.0, ignore_eos=True)
    want, _ = _run(model, tok, prompts, greedy_n, block_size=4)
    got, eng = _run(model, tok, prompts, greedy_n, SPEC, block_size=4)
    assert got == want and eng.stats()["spec_decode"]["num_drafts"] > 0
    sampled_n = SamplingParams(n=2, max_tokens=16, temperature=0.8, seed=3, ignore_eos=True)
    got, eng = _run(model, tok, prompts, sampled_n, SPEC, block_size=4)
    assert all(len(t) == 16 for outs, _ in got for t in outs)
    again, _ = _run(model, tok, prompts, sampled_n, SPEC, block_size=4)
    assert again == got, "seeded sampling with speculation is not reproducible"


def test_backing_off_changes_no_token(tiny_model):
    """Pausing a sequence's proposals (its drafts keep failing) is plain decoding: the same greedy
    tokens with the rule on, off, and without speculation; with it on, fewer drafts are verified."""
    model, tok = tiny_model
    prompts = [[5, 9, 17, 5, 9, 17, 5, 9], [60, 61, 60, 61, 60], [3, 7, 11, 13, 3, 7, 19, 23, 3, 7]]
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 2, "prompt_lookup_min": 1}
    want, _ = _run(model, tok, prompts, params, block_size=4)
    on, eng_on = _run(model, tok, prompts, params, spec, block_size=4)
    off, eng_off = _run(model, tok, prompts, params, spec, backoff=False, block_size=4)
    assert on == want and off == want
    s_on, s_off = eng_on.stats()["spec_decode"], eng_off.stats()["spec_decode"]
    assert s_off["num_pauses"] == 0 and s_off["num_paused_steps"] == 0
    if s_on["num_pauses"]:
        assert s_on["num_paused_steps"] > 0 and s_on["num_drafts"] < s_off["num_drafts"], (s_on, s_off)


def test_requests_that_cannot_speculate_decode_one_token_a_step(tiny_model):
    model, tok = tiny_model
    prompts = [[5, 9, 17, 5, 9, 17, 5, 9]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, repetition_penalty=1.3)
    want, _ = _run(model, tok, prompts, params)
    got, eng = _run(model, tok, prompts, params, SPEC)
    assert got == want and eng.stats()["spec_decode"]["num_drafts"] == 0


@pytest.mark.parametrize("spec, match", [
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an int >= 1"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_min=3"),
    ({"method": "medusa", "num_speculative_tokens": 2}, "method 'medusa' is not supported"),
    ("ngram", "must be a dict"),
])
def test_bad_speculative_config_is_refused_when_built(tiny_model, spec, match):
    model, tok = tiny_model
    with pytest.raises(ValueError, match=match):
        LLM(model, tok, speculative_config=spec)


def test_a_scheduler_that_does_not_declare_it_is_refused(tiny_model):
    from minipaged.scheduler import Scheduler

    class Mine(Scheduler):
        def schedule(self):
            return super().schedule()

    model, tok = tiny_model
    with pytest.raises(ValueError, match="speculative_decoding"):
        LLMEngine(model, tok, scheduler_cls=Mine, speculative_config=SPEC)


def test_a_block_table_whose_truncate_is_not_a_method_is_refused(tiny_model):
    from minipaged.block_table import BlockTable

    class Mine(BlockTable):
        truncate = 5

    model, tok = tiny_model
    LLMEngine(model, tok, block_table_cls=Mine)  # without speculation the member is never used
    with pytest.raises(TypeError, match="truncate is int, not a method"):
        LLMEngine(model, tok, block_table_cls=Mine, speculative_config=SPEC)


def test_no_drafts_in_a_step_of_more_sequences_than_disable_by_batch_size(tiny_model):
    """vLLM's disable_by_batch_size; on a CPU its default is CPU_DISABLE_BY_BATCH_SIZE (past the
    compute knee a draft row costs nearly a token's compute). The tokens never change."""
    from minipaged.spec_decode import CPU_DISABLE_BY_BATCH_SIZE

    model, tok = tiny_model
    prompts = [[5, 9, 17, 5, 9, 17, 5, 9 + i] for i in range(4)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    want, _ = _run(model, tok, prompts, params)
    got, eng = _run(model, tok, prompts, params, {**SPEC, "disable_by_batch_size": 2})
    st = eng.stats()["spec_decode"]
    assert got == want and st["disable_by_batch_size"] == 2 and st["num_batch_off_steps"] > 0
    got1, eng1 = _run(model, tok, prompts[:1], params, {**SPEC, "disable_by_batch_size": 2})
    assert got1 == want[:1] and eng1.stats()["spec_decode"]["num_batch_off_steps"] == 0
    assert eng1.stats()["spec_decode"]["num_drafts"] > 0
    default = LLMEngine(model, tok, speculative_config=PLAIN_SPEC)
    assert default.spec.disable_by_batch_size == CPU_DISABLE_BY_BATCH_SIZE
    assert f"more than {CPU_DISABLE_BY_BATCH_SIZE} running" in default.plan.routes["speculative"]
    with pytest.raises(ValueError, match="disable_by_batch_size must be an int >= 1"):
        LLMEngine(model, tok, speculative_config={**SPEC, "disable_by_batch_size": 0})


def test_request_metrics(tiny_model):
    model, tok = tiny_model
    out = LLM(model, tok, speculative_config=SPEC).generate(
        [[5, 9, 17, 5, 9, 17, 5, 9]], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))[0]
    m = out.metrics.spec_decode
    assert m["num_drafts"] > 0 and 0 <= m["acceptance_rate"] <= 1
    assert m["mean_acceptance_length"] == pytest.approx(1 + m["num_accepted_tokens"] / m["num_drafts"])
    assert out.metrics["spec_decode"] == m


@pytest.mark.slow
def test_smollm2_greedy_equal_with_drafts_accepted(smollm2):
    """SmolLM2 asked to quote text and code back: the same greedy tokens as without speculation,
    most drafts kept, and far fewer steps."""
    model, tok = smollm2
    text = ("Paged attention stores the keys and values of every sequence in fixed-size blocks. A block table "
            "maps each sequence's logical blocks to physical blocks in one shared pool.")
    code = "def add(a, b):\n    return a + b\n\ndef mul(a, b):\n    return a * b\n"
    msgs = [f"Repeat this text exactly, word for word:\n\n{text}", f"Copy this code back exactly:\n\n{code}"]
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": m}])) for m in msgs]
    params = SamplingParams(max_tokens=24, temperature=0.0)
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    want, plain = _run(model, tok, prompts, params)
    got, eng = _run(model, tok, prompts, params, spec)
    assert got == want
    s = eng.stats()["spec_decode"]
    assert s["acceptance_rate"] > 0.5, s
    assert eng.num_steps < plain.num_steps * 0.6, (eng.num_steps, plain.num_steps)
