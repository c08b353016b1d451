"""An engine that one bad request cannot break.

Every bad input the issue lists gets a clear error at add time or build time and the engine
goes on serving; a step that raises fails only its own requests; streams, aborts, threads and
stop strings end requests cleanly. All on the tiny random Llama (fast), except where noted.
"""
from __future__ import annotations

import random
import threading
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from minipaged.attention import TORCH
from minipaged.detokenizer import IncrementalDetokenizer, StopChecker
from minipaged.engine import LLMEngine
from minipaged.llm import LLM
from minipaged.parts import check_scheduler
from minipaged.sampling import SamplingParams


@pytest.fixture()
def engine(tiny_model):
    model, tok = tiny_model
    return LLMEngine(model, tok, block_size=4, num_blocks=64, max_num_batched_tokens=32)


def _llm(tiny_model, **kw) -> LLM:
    model, tok = tiny_model
    return LLM(model, tok, **{"block_size": 4, "num_blocks": 64, **kw})


def _serves(eng: LLMEngine) -> None:
    """After whatever happened, the engine still serves a fresh request, and nothing leaked."""
    rid = eng.add_request([5, 6, 7], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    done = eng.run()
    assert done[rid].finish_reason == "length" and len(done[rid].token_ids) == 3
    check_scheduler(eng.scheduler)
    assert eng.allocator.num_free_blocks == eng.allocator.num_blocks
    assert not eng.requests, "finished requests are pruned"


# -- bad input at add time ----------------------------------------------------------------------
@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(temperature=1e-45), "temperature must be 0 .greedy. or a finite number >= 0.01"),
        (dict(temperature=float("nan")), "temperature must be"),
        (dict(temperature=float("inf")), "temperature must be"),
        (dict(temperature=True), "temperature must be"),
        (dict(top_k=True), "top_k must be an int"),
        (dict(top_p=0), "top_p must be a number in"),
        (dict(seed="abc"), "seed must be None or an int in 0..2\\*\\*63-1, got 'abc'"),
        (dict(seed=1.5), "seed must be None or an int"),
        (dict(seed=2**70), "seed must be None or an int"),
        (dict(seed=True), "seed must be None or an int"),
        (dict(max_tokens=True), "max_tokens must be an int >= 1"),
        (dict(stop_token_ids=[True]), "stop_token_ids must be a list of token ids"),
        (dict(stop=[""]), "stop must be a string or a list of non-empty strings"),
        (dict(ignore_eos="yes"), "ignore_eos must be True or False"),
    ],
)
def test_bad_sampling_params_are_refused_when_made(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw)


@pytest.mark.parametrize("field, value", [("temperature", 1e-45), ("top_p", 0), ("max_tokens", 0), ("stop", [""]),
                                          ("seed", -1), ("n", 0), ("logprobs", 21), ("ignore_eos", "yes"),
                                          ("best_of", 4)])
def test_params_changed_after_creation_are_refused_by_add_request_as_when_made(engine, field, value):
    with pytest.raises(ValueError) as made:
        SamplingParams(**{field: value})
    p = SamplingParams(max_tokens=2)
    setattr(p, field, value)  # taken: the value is checked when a request is added, not when it is set
    assert getattr(p, field) == value
    with pytest.raises(ValueError) as added:
        engine.add_request([1, 2], p)
    assert type(added.value) is type(made.value) and str(added.value) == str(made.value)
    assert not engine.requests and not engine.scheduler.waiting
    _serves(engine)


def test_params_are_checked_against_the_engine_at_add_time(engine):
    p = SamplingParams(stop_token_ids=[10**6])
    with pytest.raises(ValueError, match="stop_token_ids must be in 0..511"):
        engine.add_request([1, 2], p)
    assert not engine.requests and not engine.scheduler.waiting
    _serves(engine)


@pytest.mark.parametrize(
    "prompt, exc, match",
    [
        ({"prompt_token_ids": [-1]}, ValueError, r"token ids must be in 0..511; got \[-1\]"),
        ({"prompt_token_ids": [1, True]}, TypeError, "prompt_token_ids must be a list of ints"),
        ({"prompt_token_ids": "abc"}, TypeError, "prompt_token_ids must be a list of ints"),
        ({"prompt_token_ids": [1], "x": 2}, TypeError, "a prompt dict takes exactly one key"),
        ({"role": "user", "content": "hi"}, TypeError, "one chat message is not a prompt"),
        ([1, 10**6], ValueError, "token ids must be in 0..511"),
        (b"hello", TypeError, "decode bytes to a str first"),
        ((1, 2, 3), TypeError, "pass a list"),
        (torch.tensor([1, 2]), TypeError, r"pass tensor.tolist\(\)"),
        (3.5, TypeError, "a prompt must be a string"),
        ([{"role": "user", "content": 5}], ValueError, "a chat message is"),
    ],
)
def test_bad_prompts_raise_at_add_time_and_queue_nothing(engine, prompt, exc, match):
    with pytest.raises(exc, match=match):
        engine.add_request(prompt, SamplingParams(max_tokens=2))
    assert not engine.requests and not engine.scheduler.waiting and not engine.has_unfinished_requests()
    _serves(engine)


def test_dict_prompts_are_token_ids_not_text(tiny_model):
    llm = _llm(tiny_model)
    p = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    (a,) = llm.generate({"prompt_token_ids": [1, 2, 3]}, p)
    (b,) = llm.generate([1, 2, 3], p)
    assert a.prompt_token_ids == [1, 2, 3] and a.token_ids == b.token_ids
    outs = llm.generate([{"prompt_token_ids": [1, 2, 3]}, {"prompt_token_ids": [4, 5]}, [6, 7]], p)
    assert [o.prompt_token_ids for o in outs] == [[1, 2, 3], [4, 5], [6, 7]]
    (t,) = llm.generate({"prompt": "hello"}, p)
    assert t.prompt_token_ids == llm.tokenizer.encode("hello")


@pytest.mark.parametrize("prompts, match", [(b"abc", "decode it to a str"), ((1, 2), "pass a list"),
                                             (torch.tensor([[1, 2]]), r"tensor.tolist\(\)"), ([1, "a"], "mixes token ids")])
def test_generate_input_forms_are_unambiguous(tiny_model, prompts, match):
    with pytest.raises(TypeError, match=match):
        _llm(tiny_model).generate(prompts)


def test_rejections_carry_their_real_request_id(tiny_model):
    llm = _llm(tiny_model)
    p = SamplingParams(max_tokens=2, temperature=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        outs = llm.generate([[1, 2], {"prompt_token_ids": [-1]}, [3] * 300, [4, 5]], p)
    assert [o.finish_reason for o in outs] == ["length", "rejected", "rejected", "length"]
    ids = [o.request_id for o in outs]
    assert "-" not in ids and len(set(ids)) == 4
    assert "token ids must be in" in outs[1].error and "context" in outs[2].error


def test_bad_engine_settings_fail_at_build(tiny_model):
    model, tok = tiny_model
    with pytest.raises(ValueError, match=r"kv_cache_bytes=1000000000000000 .* is more than the memory available"):
        LLMEngine(model, tok, kv_cache_bytes=10**15)
    with pytest.raises(ValueError, match=r"max_model_len=100000 is past the model's 128 positions"):
        LLMEngine(model, tok, max_model_len=100000)
    for kw in (dict(block_size=0), dict(max_num_seqs=0), dict(block_size=-3)):
        with pytest.raises(ValueError, match="must be an int >= 1"):
            LLMEngine(model, tok, **kw)
    with pytest.raises(TypeError, match="Did you mean 'max_num_seqs'"):
        LLM(model, tok, max_num_seq=4)


# -- a step that raises -------------------------------------------------------------------------
class FlakyAttention:
    """The torch backend, raising at chosen calls (a learner's attention with a bug)."""

    name = "flaky"

    def __init__(self, fail_calls: set[int]) -> None:
        self.calls, self.fail_calls = 0, fail_calls

    def paged_attention(self, q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale, out=None):
        self.calls += 1
        if self.calls in self.fail_calls:
            raise RuntimeError(f"boom at call {self.calls}")
        return TORCH.paged_attention(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale, out)


def test_a_raising_step_fails_its_requests_and_the_engine_goes_on(tiny_model):
    model, tok = tiny_model
    flaky = FlakyAttention({3})
    eng = LLMEngine(model, tok, attention=flaky, block_size=4, num_blocks=64, max_num_seqs=2)
    p = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    ids = [eng.add_request([1 + i, 2, 3], p) for i in range(4)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        done = eng.run()
    reasons = {i: done[i].finish_reason for i in ids}
    assert sorted(reasons.values()) == ["error", "error", "length", "length"]  # max_num_seqs=2: one step held 2
    for i in ids:
        if reasons[i] == "error":
            assert "boom at call 3" in done[i].error and done[i].finished
    check_scheduler(eng.scheduler)
    assert eng.allocator.num_free_blocks == eng.allocator.num_blocks
    _serves(eng)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_random_failures_over_a_random_workload_lose_nothing(tiny_model, data):
    model, tok = tiny_model
    n = data.draw(st.integers(1, 8), label="requests")
    fails = set(data.draw(st.lists(st.integers(1, 60), max_size=6), label="failing attention calls"))
    eng = LLMEngine(model, tok, attention=FlakyAttention(fails), block_size=data.draw(st.sampled_from([1, 4, 16])),
                    num_blocks=data.draw(st.integers(12, 40)), max_num_seqs=data.draw(st.integers(1, 4)),
                    max_num_batched_tokens=data.draw(st.integers(8, 40)), record_trace=False)
    ids = []
    for _ in range(n):
        plen = data.draw(st.integers(1, 20))
        ids.append(eng.add_request([random.Random(plen).randrange(3, 500) for _ in range(plen)],
                                   SamplingParams(max_tokens=data.draw(st.integers(1, 6)), temperature=0.0, ignore_eos=True)))
    seen: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(500):
            if not eng.has_unfinished_requests():
                break
            for o in eng.step():
                assert o.request_id not in seen, "a request reported finished twice"
                if o.finished:
                    seen[o.request_id] = o
            check_scheduler(eng.scheduler)
    assert set(seen) == set(ids), "every request ends, none is lost"
    assert all(o.finish_reason in ("length", "error", "rejected") for o in seen.values())
    assert eng.allocator.num_free_blocks == eng.allocator.num_blocks and not eng.requests


# -- ending requests ----------------------------------------------------------------------------
def test_abort_is_reported_and_frees_blocks(engine):
    p = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    a, b = engine.add_request([1, 2, 3], p), engine.add_request([4, 5, 6], p)
    engine.step()
    assert engine.abort_request(a) and not engine.abort_request("no-such-id")
    outs = {o.request_id: o for o in engine.step()}
    assert outs[a].finish_reason == "abort" and outs[a].finished
    done = engine.run()
    assert done[b].finish_reason == "length" and a not in done
    assert engine.allocator.num_free_blocks == engine.allocator.num_blocks and not engine.requests


def test_closing_a_stream_aborts_its_request(tiny_model):
    llm = _llm(tiny_model)
    gen = llm.stream([1, 2, 3], SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
    next(gen)
    gen.close()
    eng = llm.engine
    assert not eng.requests and eng.allocator.num_free_blocks == eng.allocator.num_blocks
    assert [o.finish_reason for o in eng.step()] == ["abort"]


def test_a_second_thread_gets_a_clear_error_and_the_state_stays_sound(tiny_model):
    model, tok = tiny_model
    eng = LLMEngine(model, tok, block_size=4, num_blocks=64)
    p = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    for i in range(4):
        eng.add_request([i + 1, 2, 3], p)
    errors: list[Exception] = []
    inside, release = threading.Event(), threading.Event()
    real_step = eng.runner.prepare

    def slow_prepare(out):
        inside.set()
        release.wait(5)
        return real_step(out)

    eng.runner.prepare = slow_prepare
    t = threading.Thread(target=eng.step)
    t.start()
    inside.wait(5)
    for call in (eng.step, lambda: eng.add_request([1], p), lambda: eng.abort_request("0")):
        try:
            call()
        except RuntimeError as e:
            errors.append(e)
    release.set()
    t.join()
    eng.runner.prepare = real_step
    assert len(errors) == 3 and all("single-threaded" in str(e) for e in errors)
    eng.run()
    check_scheduler(eng.scheduler)
    assert eng.allocator.num_free_blocks == eng.allocator.num_blocks


def test_stop_string_never_leaks_into_streamed_text(tiny_model):
    llm = _llm(tiny_model)
    greedy = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    (full,) = llm.generate([1, 2, 3], greedy)
    text = full.text
    assert len(text) > 8, "the tiny model must say something for this test to mean anything"
    stop = text[5:8]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop=[stop])
    pieces = list(llm.stream([1, 2, 3], params))
    streamed = "".join(pieces)
    (o,) = llm.generate([1, 2, 3], params)
    assert streamed == o.text == text[: text.index(stop)]
    assert stop not in streamed and o.finish_reason == "stop"


# -- stop checker and detokenizer ---------------------------------------------------------------
def test_incremental_detokenizer_matches_a_full_decode_at_constant_cost(tiny_model):
    _, tok = tiny_model
    ids = [random.Random(i).randrange(3, 400) for i in range(1000)]
    d = IncrementalDetokenizer(tok)
    text = "".join(d.append(t) for t in ids) + d.flush()
    assert text == tok.decode(ids)
    assert d.num_decode_calls <= 2 * len(ids) + 2, "two short decodes per token, at any length"


def test_stop_checker_decodes_each_token_once_not_the_whole_output(tiny_model):
    _, tok = tiny_model
    calls = []

    class Counting:
        def decode(self, ids):
            calls.append(len(ids))
            return tok.decode(ids)

    checker = StopChecker(1000, 3, tokenizer=Counting(), stop=["zzzz"])
    for i in range(1000):
        checker.append(random.Random(i).randrange(3, 400))
    assert len(calls) <= 2 * 1000 + 2
    assert max(calls) <= 8, f"a decode call saw {max(calls)} tokens: detokenizing must not grow with the output"


def test_stop_checker_rules():
    from minipaged.sequence import FinishReason

    c = StopChecker(max_tokens=5, num_prompt_tokens=2, eos_token_ids=[2], stop_token_ids=[9])
    assert c.append(4)[0] is None and c.append(2)[0] is FinishReason.STOP
    c = StopChecker(max_tokens=5, num_prompt_tokens=2, eos_token_ids=[2], ignore_eos=True)
    assert [c.append(2)[0] for _ in range(5)] == [None] * 4 + [FinishReason.LENGTH]
    c = StopChecker(max_tokens=50, num_prompt_tokens=6, max_model_len=8)
    assert [c.append(1)[0] for _ in range(2)] == [None, FinishReason.LENGTH]
    c = StopChecker(max_tokens=50, num_prompt_tokens=2, stop_token_ids=[9])
    assert c.append(9)[0] is FinishReason.STOP
