"""Faults that poison nothing: a NaN, an exception, a re-entered engine or interleaved streams
never corrupt another request, the prefix cache, or what a later request gets.

A learner's attention function (lesson and workbook 07) is the likely source of NaN and
exceptions, so the faults are planted through ``attention=``: ``torch_sdpa.paged_attention``
with chosen calls (a step's layer) turned to NaN, inf or an exception, for every row or for one
sequence's rows. Every request either ends with ``finish_reason="error"`` or gets exactly the
greedy tokens of a clean engine; no cached block holds a non-finite number; later requests,
sharing the cached prefix, are exact. All on the tiny random Llama (tests/conftest.py).
"""
from __future__ import annotations

import random
import time
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from minipaged import kv_quant
from minipaged.attention import torch_sdpa
from minipaged.engine import LLMEngine
from minipaged.llm import LLM
from minipaged.parts import check_scheduler
from minipaged.sampling import SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True)
PREFIX = [7, 41, 99, 250, 13, 8, 77, 301, 5, 66, 123, 404]  # a shared "system prompt" (3 blocks of 4)


class FaultyAttention:
    """``torch_sdpa.paged_attention``, with chosen calls made faulty.

    ``faults``: {call number (1-based; a step calls once per layer): (kind, which)}, kind "nan",
    "inf" or "raise"; ``which``: None for every row of the call, or k for the rows of the batch's
    k-th sequence (modulo the batch). ``fired`` lists the faults that happened.
    """

    dequantizes = True  # torch_sdpa reads 8-bit pages with their scales, so this wrapper does too

    def __init__(self, faults=None):
        self.faults = dict(faults or {})
        self.calls = 0
        self.fired: list = []

    def __call__(self, q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale, out=None):
        self.calls += 1
        r = torch_sdpa.paged_attention(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale, out)
        fault = self.faults.get(self.calls)
        if fault is None:
            return r
        kind, which = fault
        self.fired.append((self.calls, kind, which))
        if kind == "raise":
            raise RuntimeError(f"planted fault at attention call {self.calls}")
        value = float("nan") if kind == "nan" else float("inf")
        if which is None:
            return torch.full_like(r, value)
        qsl = query_start_loc.tolist()
        s = which % (len(qsl) - 1)
        r = r.clone()
        r[qsl[s]:qsl[s + 1]] = value
        return r


def _engine(tiny_model, attention="torch", **kw):
    model, tok = tiny_model
    kw = {"block_size": 4, "num_blocks": 64, "record_trace": False, "packed_gemm": False, **kw}
    return LLMEngine(model, tok, attention=attention, **kw)


_clean_cache: dict = {}


def _clean_tokens(tiny_model, prompt, max_tokens, kv_cache_dtype="auto") -> list[int]:
    """The greedy tokens of ``prompt`` alone in a clean engine without prefix caching (memoized)."""
    key = (tuple(prompt), max_tokens, kv_cache_dtype)
    if key not in _clean_cache:
        eng = _engine(tiny_model, enable_prefix_caching=False, kv_cache_dtype=kv_cache_dtype)
        rid = eng.add_request(list(prompt), SamplingParams(max_tokens=max_tokens, **GREEDY))
        _clean_cache[key] = eng.run()[rid].token_ids
    return _clean_cache[key]


def _cached_blocks_are_finite(eng) -> None:
    """No block registered in the prefix cache holds a NaN or inf, in any layer."""
    pc = eng.prefix_cache
    if pc is None:
        return
    cached = [b for b in range(eng.allocator.num_blocks) if pc.is_cached(b)]
    if not cached:
        return
    idx = torch.tensor(cached)
    for layer, (k, v) in enumerate(zip(eng.kv_cache.k, eng.kv_cache.v)):
        # 8-bit pages are read as the attention reads them: dequantized with their scales
        kk, vv = kv_quant.read_blocks(k, idx), kv_quant.read_blocks(v, idx)
        bad = [b for b, ok in zip(cached, (torch.isfinite(kk).flatten(1).all(1) & torch.isfinite(vv).flatten(1).all(1)).tolist()) if not ok]
        assert not bad, f"cached blocks {bad} hold non-finite K/V in layer {layer}: a failed step's block was registered"
        for cache in (k, v):
            scales = kv_quant.kv_scales(cache)
            if scales is not None:
                sc = scales.index_select(0, idx)
                assert torch.isfinite(sc).all() and (sc >= 0).all(), f"cached blocks' scales {sc} in layer {layer}"


def _sound(eng) -> None:
    check_scheduler(eng.scheduler)
    assert not eng.requests and not eng.scheduler.running and not eng.scheduler.waiting
    assert eng.allocator.num_free_blocks == eng.allocator.num_blocks, "a block leaked"
    if eng.prefix_cache is not None:
        from minipaged.prefix_cache import check_prefix_cache

        check_prefix_cache(eng.prefix_cache)
    _cached_blocks_are_finite(eng)


def _run(eng, jobs) -> dict:
    """Add ``jobs`` [(prompt, SamplingParams)] and run them; {request id: final output}, in order."""
    ids = [eng.add_request(list(p), sp) for p, sp in jobs]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        done = eng.run()
    assert set(done) >= set(ids), "a request never finished"
    return {i: done[i] for i in ids}


# -- the probe that failed: one NaN poisoned every later chat through the prefix cache ----------
def test_one_nan_fails_its_requests_and_poisons_no_later_request(tiny_model):
    nan_once = FaultyAttention({3: ("nan", None)})  # the second step's first layer
    eng = _engine(tiny_model, attention=nan_once)
    p = SamplingParams(max_tokens=8, **GREEDY)
    first = _run(eng, [(PREFIX + [20 + i, 30 + i], p) for i in range(3)])
    assert nan_once.fired, "the fault was not planted"
    for o in first.values():
        assert o.finish_reason == "error" and o.finished, o
        assert "step" in o.error and ("NaN" in o.error or "non-finite" in o.error), o.error
        assert o.token_ids != [0] * 8
    _sound(eng)
    later = [PREFIX + [20, 30], PREFIX + [200, 201, 202], PREFIX[:9] + [11]]  # same prefix, new prompts too
    again = _run(eng, [(q, p) for q in later])
    for q, o in zip(later, again.values()):
        assert o.finish_reason == "length" and o.token_ids == _clean_tokens(tiny_model, q, 8), (q, o)
    _sound(eng)


def test_nan_in_one_sequences_rows_fails_only_that_request(tiny_model):
    bad_rows = FaultyAttention({1: ("nan", 1)})  # the first step: the second prompt's rows only
    eng = _engine(tiny_model, attention=bad_rows)
    prompts = [PREFIX + [21], [3, 4, 5, 6, 7], PREFIX + [22, 23]]
    outs = list(_run(eng, [(q, SamplingParams(max_tokens=6, **GREEDY)) for q in prompts]).values())
    assert [o.finish_reason for o in outs] == ["length", "error", "length"], outs
    assert "step 1" in outs[1].error or "step 0" in outs[1].error, outs[1].error
    for q, o in zip(prompts, outs):
        if o.finish_reason == "length":
            assert o.token_ids == _clean_tokens(tiny_model, q, 6)
    _sound(eng)


# -- random faults over random workloads --------------------------------------------------------
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_random_faults_poison_nothing(tiny_model, data):
    _random_faults(tiny_model, data, "auto")


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "int8"])
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_random_faults_poison_no_8bit_page(tiny_model, data, kv_cache_dtype):
    """The same faults on 8-bit pages: a NaN or inf reaching a K/V write never leaves a cached
    block (or its scale) non-finite, and every request that did not fail gets a clean 8-bit
    engine's tokens. fp8's one scale per layer rounds each value alone, so chunked prefill and
    preemption keep the tokens; int8 re-rounds a block's rows when its scale grows, so a block
    written in two chunks may differ from one written at once: its runs get room for every prompt
    in one step and every block (no chunking, no preemption)."""
    _random_faults(tiny_model, data, kv_cache_dtype)


def _random_faults(tiny_model, data, kv_cache_dtype):
    rng = random.Random(data.draw(st.integers(0, 2**16), label="prompt seed"))
    n_req = data.draw(st.integers(1, 6), label="requests")
    jobs = []
    for _ in range(n_req):
        shared = data.draw(st.integers(0, len(PREFIX)), label="shared prefix length")
        tail = [rng.randrange(3, 500) for _ in range(data.draw(st.integers(1, 14), label="tail"))]
        jobs.append((PREFIX[:shared] + tail, SamplingParams(max_tokens=data.draw(st.integers(1, 8)), n=data.draw(st.sampled_from([1, 1, 2, 3])), **GREEDY)))
    faults = data.draw(st.dictionaries(st.integers(1, 40), st.tuples(st.sampled_from(["nan", "inf", "raise"]),
                                                                      st.one_of(st.none(), st.integers(0, 5))), max_size=4),
                       label="faults")
    attention = FaultyAttention(faults)
    whole = kv_cache_dtype == "int8"
    eng = _engine(tiny_model, attention=attention, kv_cache_dtype=kv_cache_dtype,
                  num_blocks=200 if whole else data.draw(st.integers(14, 40), label="num_blocks"),  # few: preemption
                  max_num_seqs=data.draw(st.integers(3, 6), label="max_num_seqs"),
                  max_num_batched_tokens=256 if whole else data.draw(st.integers(6, 32), label="max_num_batched_tokens"),  # chunked prefill
                  enable_prefix_caching=data.draw(st.sampled_from([True, True, None])))
    outs = _run(eng, jobs)
    errors = 0
    for (prompt, sp), o in zip(jobs, outs.values()):
        assert o.finished and o.finish_reason in ("length", "error", "rejected"), o
        if o.finish_reason == "error":
            errors += 1
            assert o.error and ("step" in o.error or "planted fault" in o.error), o.error
            continue
        if o.finish_reason == "rejected":
            continue
        want = _clean_tokens(tiny_model, prompt, sp.max_tokens, kv_cache_dtype)
        assert [c.token_ids for c in o.outputs] == [want] * sp.n, (prompt, sp, o, attention.fired)
    assert errors >= 1 or not attention.fired, f"faults {attention.fired} fired and no request failed"
    _sound(eng)
    # later requests, sharing whatever the failed ones cached: exactly a clean engine's tokens
    attention.faults.clear()
    later = [(PREFIX + [rng.randrange(3, 500)], SamplingParams(max_tokens=5, **GREEDY)), (jobs[0][0], SamplingParams(max_tokens=5, **GREEDY))]
    for (prompt, sp), o in zip(later, _run(eng, later).values()):
        assert o.finish_reason == "length" and o.token_ids == _clean_tokens(tiny_model, prompt, 5, kv_cache_dtype), (prompt, o)
    _sound(eng)


# -- re-entering the engine from inside a step ---------------------------------------------------
def test_reentering_the_engine_from_a_step_is_a_clear_error_and_the_engine_goes_on(tiny_model):
    box: dict = {}

    def sneaky(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale, out=None):
        box["calls"] = box.get("calls", 0) + 1
        if box["calls"] == 3:
            box["eng"].step()
        if box["calls"] == 5:
            box["eng"].add_request([1, 2, 3], SamplingParams(max_tokens=2))
        return torch_sdpa.paged_attention(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale, out)

    eng = box["eng"] = _engine(tiny_model, attention=sneaky)
    p = SamplingParams(max_tokens=4, **GREEDY)
    first = _run(eng, [([5, 6, 7], p)])
    (o,) = first.values()
    assert o.finish_reason == "error" and "RuntimeError" in o.error and "inside" in o.error, o.error
    second = _run(eng, [([8, 9, 10], p)])
    (o,) = second.values()
    assert o.finish_reason == "error" and "RuntimeError" in o.error, o.error
    third = _run(eng, [([5, 6, 7], p)])
    (o,) = third.values()
    assert o.finish_reason == "length" and o.token_ids == _clean_tokens(tiny_model, [5, 6, 7], 4)
    _sound(eng)


# -- every limit before any work -----------------------------------------------------------------
def test_n_is_checked_against_max_num_seqs_before_any_fork(tiny_model):
    eng = _engine(tiny_model, max_num_seqs=8)
    for n in (9, 2**17, 2**40):
        t = time.perf_counter()
        with pytest.raises(ValueError, match="max_num_seqs") as e:
            eng.add_request([1, 2, 3], SamplingParams(max_tokens=2, n=n))
        assert str(n) in str(e.value) and time.perf_counter() - t < 2.0
    assert not eng.requests and not eng.scheduler.waiting
    ok = _run(eng, [([1, 2, 3], SamplingParams(max_tokens=2, n=8, **GREEDY))])
    assert len(next(iter(ok.values())).outputs) == 8


def test_max_tokens_past_the_context_is_refused_naming_both_numbers(tiny_model):
    eng = _engine(tiny_model)  # the tiny model's context: 128
    with pytest.raises(ValueError) as e:
        eng.add_request([5] * 10, SamplingParams(max_tokens=119))
    for number in ("128", "10", "119", "118"):
        assert number in str(e.value), str(e.value)
    assert not eng.requests
    (o,) = _run(eng, [([5] * 10, SamplingParams(max_tokens=118, **GREEDY))]).values()
    assert len(o.token_ids) == 118 and o.finish_reason == "length"


def test_chat_without_max_tokens_ends_within_the_context(tiny_model):
    model, tok = tiny_model
    llm = LLM(model, tok, block_size=4, num_blocks=64, record_trace=False)
    words = "The quick brown fox jumps over the lazy dog. def add(a, b): return a + b".split()
    for cut in range(len(words) * 20):  # a conversation that leaves fewer than 16 tokens of room
        long_chat = [{"role": "user", "content": " ".join((words * 20)[:cut])}]
        n_prompt = len(llm.engine.encode_prompt(long_chat))
        if n_prompt > 116:
            break
    assert 116 < n_prompt < 128, n_prompt  # the default max_tokens (16) would not fit
    (o,) = llm.chat(long_chat, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=None))
    assert o.finish_reason == "length" and n_prompt + len(o.token_ids) == 128
    (o,) = llm.chat(long_chat)  # no sampling params at all
    assert o.finish_reason in ("length", "stop") and n_prompt + len(o.token_ids) <= 128


def test_a_lone_surrogate_is_a_clear_error_naming_the_position(tiny_model):
    model, tok = tiny_model
    llm = LLM(model, tok, block_size=4, num_blocks=64, record_trace=False)
    with pytest.raises(ValueError, match=r"position 1") as e:
        llm.engine.add_request("a\udcffb", SamplingParams(max_tokens=2))
    assert "surrogate" in str(e.value) and "TextInputSequence" not in str(e.value)
    with pytest.raises(ValueError, match="surrogate"):
        llm.engine.add_request([{"role": "user", "content": "hi \ud800"}], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="stop"):
        llm.engine.add_request("ab", SamplingParams(max_tokens=2, stop=["x\udcff"]))
    assert not llm.engine.requests


# -- streams and calls interleave -----------------------------------------------------------------
def _clean_text(tiny_model, prompt, max_tokens) -> str:
    key = ("text", tuple(prompt), max_tokens)
    if key not in _clean_cache:
        model, tok = tiny_model
        llm = LLM(model, tok, block_size=4, num_blocks=64, record_trace=False, enable_prefix_caching=False)
        _clean_cache[key] = llm.generate([list(prompt)], SamplingParams(max_tokens=max_tokens, **GREEDY))[0].text
    return _clean_cache[key]


def test_two_streams_read_in_turn_and_a_generate_during_a_stream(tiny_model):
    model, tok = tiny_model
    llm = LLM(model, tok, block_size=4, num_blocks=64, record_trace=False)
    pa, pb, pc = [5, 6, 7], [40, 41, 42, 43], [90, 91]
    a = llm.stream(pa, SamplingParams(max_tokens=12, **GREEDY))
    b = llm.stream(pb, SamplingParams(max_tokens=9, **GREEDY))
    got_a, got_b = [next(a)], [next(b)]
    got_a.append(next(a))
    (g,) = llm.generate([pc], SamplingParams(max_tokens=6, **GREEDY))  # runs while both streams are open
    assert g.text == _clean_text(tiny_model, pc, 6)
    got_b += list(b)
    got_a += list(a)
    assert "".join(got_a) == _clean_text(tiny_model, pa, 12)
    assert "".join(got_b) == _clean_text(tiny_model, pb, 9)
    _sound(llm.engine)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_random_interleavings_of_streams_and_generate(tiny_model, data):
    model, tok = tiny_model
    llm = LLM(model, tok, block_size=4, num_blocks=64, record_trace=False, max_num_seqs=data.draw(st.integers(1, 4)))
    rng = random.Random(data.draw(st.integers(0, 2**16)))
    k = data.draw(st.integers(1, 3), label="streams")
    jobs = [([rng.randrange(3, 500) for _ in range(rng.randint(1, 8))], data.draw(st.integers(1, 8))) for _ in range(k)]
    streams = [llm.stream(p, SamplingParams(max_tokens=m, **GREEDY)) for p, m in jobs]
    texts = [""] * k
    open_ = set(range(k))
    actions = data.draw(st.lists(st.one_of(st.integers(0, k - 1), st.just("generate")), max_size=20), label="actions")
    for act in actions:
        if act == "generate":
            prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(1, 6))] for _ in range(rng.randint(1, 2))]
            outs = llm.generate(prompts, SamplingParams(max_tokens=4, **GREEDY))
            assert [o.text for o in outs] == [_clean_text(tiny_model, p, 4) for p in prompts]
        elif act in open_:
            piece = next(streams[act], None)
            if piece is None:
                open_.discard(act)
            else:
                texts[act] += piece
    for i in sorted(open_):
        texts[i] += "".join(streams[i])
    assert texts == [_clean_text(tiny_model, p, m) for p, m in jobs]
    _sound(llm.engine)


# -- engines never share state through a model -----------------------------------------------------
def test_engines_sharing_a_model_keep_their_own_attention(tiny_model):
    model, tok = tiny_model
    a = LLM(model, tok, block_size=4, num_blocks=64, record_trace=False, attention="torch")
    b = LLM(model=a.engine.model, tokenizer=a.tokenizer, block_size=4, num_blocks=64, record_trace=False,
            attention=lambda *x: 1 / 0)
    (o,) = a.generate([[5, 6, 7]], SamplingParams(max_tokens=4, **GREEDY))
    assert o.finish_reason == "length" and o.token_ids == _clean_tokens(tiny_model, [5, 6, 7], 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (o,) = b.generate([[5, 6, 7]], SamplingParams(max_tokens=4, **GREEDY))
    assert o.finish_reason == "error" and "ZeroDivisionError" in o.error
    (o,) = a.generate([[5, 6, 7]], SamplingParams(max_tokens=4, **GREEDY))
    assert o.finish_reason == "length"
