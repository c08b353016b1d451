"""The engine end to end: greedy parity with transformers, invariance to batching, paging,
preemption and chunking, seeded sampling, stop conditions, streaming, bad input."""
from __future__ import annotations

import warnings

import pytest

from minipaged.parts import check_scheduler
import torch

from minipaged.block_allocator import BlockAllocator
from minipaged.block_table import BlockTable
from minipaged.engine import LLMEngine
from minipaged.llm import LLM
from minipaged.sampling import SamplingParams
from minipaged.scheduler import Scheduler

CHAT = [
    "What is the capital of France?",
    "Write a haiku about autumn.",
    "Explain recursion in one sentence.",
    "List three primary colours.",
    "How do I boil an egg?",
    "What is 7 times 8?",
    "Name a famous physicist and say why.",
    "Translate 'thank you' into French.",
]
GREEDY = SamplingParams(max_tokens=32, temperature=0.0)


def _generate(model, tok, prompts, params, **kw):
    eng = LLMEngine(model, tok, **kw)
    ids = [eng.add_request(p, params) for p in prompts]
    done = eng.run()
    check_scheduler(eng.scheduler)
    assert eng.allocator.num_free_blocks == eng.allocator.num_blocks, "blocks leaked after every request finished"
    return [done[i].token_ids for i in ids], eng


# -- SmolLM2 against transformers ----------------------------------------------------------
@pytest.fixture(scope="module")
def chat_ids(smollm2):
    _, tok = smollm2
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": c}])) for c in CHAT]


@pytest.fixture(scope="module")
def hf_greedy(hf_smollm2, chat_ids):
    """transformers.generate, greedy, one prompt at a time (no padding to blur the oracle)."""
    outs = []
    with torch.inference_mode():
        for ids in chat_ids:
            g = hf_smollm2.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False, eos_token_id=2, pad_token_id=2)
            outs.append(g[0, len(ids):].tolist())
    return outs


def _trim_at_eos(toks, eos=(2,)):
    for i, t in enumerate(toks):
        if t in eos:
            return toks[: i + 1]
    return toks


@pytest.mark.slow
def test_greedy_batch_equals_transformers(smollm2, chat_ids, hf_greedy):
    model, tok = smollm2
    got, eng = _generate(model, tok, chat_ids, GREEDY)
    assert len(got) == 8
    for i, (g, want) in enumerate(zip(got, hf_greedy)):
        assert g == _trim_at_eos(want), f"prompt {i} ({CHAT[i]!r}): minipaged {g} vs transformers {want}"
    assert max(len(r.running) for r in eng.trace.steps) == 8, "the 8 prompts never ran together"


@pytest.mark.slow
@pytest.mark.parametrize(
    "kw",
    [
        dict(block_size=1, num_blocks=4000),
        dict(block_size=64, num_blocks=64),
        dict(block_size=16, num_blocks=18),  # ~288 slots for 8 prompts of ~40 + 32 tokens: must preempt
        dict(block_size=16, max_num_batched_tokens=24),  # prompts of ~40 tokens: chunked prefill
    ],
    ids=["block1", "block64", "preempt", "chunked"],
)
def test_greedy_invariant_to_paging_and_scheduling(smollm2, chat_ids, hf_greedy, kw):
    model, tok = smollm2
    params = SamplingParams(max_tokens=16, temperature=0.0)
    got, eng = _generate(model, tok, chat_ids, params, **kw)
    for i, (g, want) in enumerate(zip(got, hf_greedy)):
        assert g == _trim_at_eos(want[:16]), f"{kw}: prompt {i} differs: {g} vs {want[:16]}"
    if "num_blocks" in kw and kw["num_blocks"] == 18:
        assert eng.scheduler.num_preemptions > 0, "the small pool was meant to force preemption"
    if "max_num_batched_tokens" in kw:
        # every prompt is longer than the budget, so each one was prefilled in several chunks
        assert min(len(p) for p in chat_ids) > 24
        assert max(s.prefill_tokens + s.decode_tokens for s in eng.trace.steps) <= 24


@pytest.mark.slow
def test_one_at_a_time_equals_all_at_once(smollm2, chat_ids):
    model, tok = smollm2
    params = SamplingParams(max_tokens=12, temperature=0.0)
    together, _ = _generate(model, tok, chat_ids[:4], params)
    alone = [_generate(model, tok, [p], params)[0][0] for p in chat_ids[:4]]
    assert together == alone


@pytest.mark.slow
def test_llm_facade_chat_and_stream(smollm2):
    model, tok = smollm2
    llm = LLM(model, tok)
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}], SamplingParams(max_tokens=12, temperature=0))
    assert "Paris" in out[0].text and out[0].finished
    pieces = list(llm.stream([{"role": "user", "content": "What is the capital of France?"}], SamplingParams(max_tokens=12, temperature=0)))
    assert len(pieces) > 1 and "".join(pieces) == out[0].text


# -- a tiny random model: fast checks of everything else ------------------------------------
def _tok_prompts(tok, n=6):
    texts = ["hello world", "the cat sat on the mat", "a", "one two three four five six seven", "zz", "paged attention"]
    return [tok.encode(t) or [5] for t in texts[:n]]


def test_invariance_tiny(tiny_model):
    model, tok = tiny_model
    prompts = _tok_prompts(tok)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    ref = [_generate(model, tok, [p], params)[0][0] for p in prompts]
    for kw in (dict(), dict(block_size=1), dict(block_size=64), dict(block_size=2, num_blocks=20), dict(max_num_batched_tokens=3), dict(max_num_seqs=2)):
        got, eng = _generate(model, tok, prompts, params, **kw)
        assert got == ref, f"{kw} changed the greedy tokens"
    got, eng = _generate(model, tok, prompts, params, block_size=2, num_blocks=20)
    assert eng.scheduler.num_preemptions > 0


def test_seeded_sampling_same_alone_and_in_a_busy_batch(tiny_model):
    model, tok = tiny_model
    prompts = _tok_prompts(tok)
    p = SamplingParams(max_tokens=12, temperature=0.9, top_k=50, top_p=0.9, seed=1234, ignore_eos=True)
    alone, _ = _generate(model, tok, [prompts[0]], p)
    others = [SamplingParams(max_tokens=7, temperature=1.0, seed=i, ignore_eos=True) for i in range(5)]
    eng = LLMEngine(model, tok, block_size=2, num_blocks=30)
    ids = [eng.add_request(q, o) for q, o in zip(prompts[1:], others)]
    rid = eng.add_request(prompts[0], p)
    done = eng.run()
    assert done[rid].token_ids == alone[0]
    unseeded = [_generate(model, tok, [prompts[0]], SamplingParams(max_tokens=12, temperature=0.9, ignore_eos=True))[0][0] for _ in range(3)]
    assert len({tuple(u) for u in unseeded}) > 1, "without a seed, sampled answers should differ"
    assert len(ids) == 5


def test_stop_token_and_string_and_eos(tiny_model):
    model, tok = tiny_model
    prompt = _tok_prompts(tok)[1]
    free, _ = _generate(model, tok, [prompt], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    first = free[0][3]
    got, _ = _generate(model, tok, [prompt], SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[first], ignore_eos=True))
    assert got[0] == free[0][: free[0].index(first) + 1]
    eng = LLMEngine(model, tok)
    text = tok.decode(free[0])
    stop = text.strip()[2:5] if len(text.strip()) > 6 else None
    if stop:
        rid = eng.add_request(prompt, SamplingParams(max_tokens=10, temperature=0, stop=[stop], ignore_eos=True))
        o = eng.run()[rid]
        assert o.finish_reason == "stop" and stop not in o.text and text.startswith(o.text)
    rid = eng.add_request(prompt, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    o = eng.run()[rid]
    assert o.finish_reason == "length" and len(o.token_ids) == 10


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(temperature=-0.1), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-3), "top_k"),
    ],
)
def test_bad_sampling_params(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw)


def test_bad_requests_are_rejected_and_others_served(tiny_model):
    model, tok = tiny_model
    eng = LLMEngine(model, tok, block_size=4, num_blocks=8, max_model_len=64)
    good = eng.add_request(_tok_prompts(tok)[1], SamplingParams(max_tokens=5, temperature=0))
    empty = eng.add_request([], SamplingParams(max_tokens=5))
    too_long = eng.add_request([7] * 80, SamplingParams(max_tokens=5))
    too_big = eng.add_request([7] * 20, SamplingParams(max_tokens=40))  # 59 slots > 8 blocks x 4
    with pytest.raises(ValueError, match="token ids must be in"):
        eng.add_request([10**9], SamplingParams())
    with pytest.raises(TypeError, match="prompt must be"):
        eng.add_request(3.5, SamplingParams())
    done = eng.run()
    assert done[good].finish_reason in ("length", "stop") and done[good].token_ids
    assert "empty" in done[empty].error
    assert "context" in done[too_long].error and "shorten" in done[too_long].error
    assert "KV blocks" in done[too_big].error and "larger KV budget" in done[too_big].error
    for r in (empty, too_long, too_big):
        assert done[r].finish_reason == "rejected" and done[r].token_ids == []


def test_generate_with_a_bad_prompt_serves_the_rest(tiny_model):
    model, tok = tiny_model
    llm = LLM(model, tok, block_size=4, num_blocks=16)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        outs = llm.generate(["hello world", "", "the cat"], SamplingParams(max_tokens=4, temperature=0))
    assert [o.finish_reason == "rejected" for o in outs] == [False, True, False]
    assert outs[0].token_ids and outs[2].token_ids
    assert any("empty" in str(x.message) for x in w)


def test_unknown_model_path_and_corrupt_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        LLM(str(tmp_path / "no-such-model"))
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 40)
    with pytest.raises(ValueError, match="broken.gguf"):
        LLM(str(bad))


def test_injected_parts_are_used(tiny_model):
    model, tok = tiny_model
    calls = {"alloc": 0, "table": 0, "sched": 0, "attn": 0}

    class MyAllocator(BlockAllocator):
        def allocate(self):
            calls["alloc"] += 1
            return super().allocate()

    class MyTable(BlockTable):
        def append_tokens(self, n=1):
            calls["table"] += 1
            return super().append_tokens(n)

    class MyScheduler(Scheduler):
        def schedule(self):
            calls["sched"] += 1
            return super().schedule()

    from minipaged.attention.reference import paged_attention

    def my_attention(*args, **kw):
        calls["attn"] += 1
        return paged_attention(*args, **kw)

    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    ref, _ = _generate(model, tok, _tok_prompts(tok, 3), params)
    got, eng = _generate(
        model, tok, _tok_prompts(tok, 3), params,
        allocator_cls=MyAllocator, block_table_cls=MyTable, scheduler_cls=MyScheduler, attention=my_attention,
    )
    assert got == ref and all(v > 0 for v in calls.values()), calls


def test_stats_and_trace(tiny_model):
    model, tok = tiny_model
    _, eng = _generate(model, tok, _tok_prompts(tok), SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), block_size=4)
    st = eng.stats()
    assert st["generated_tokens"] == 36 and st["requests"] == 6 and st["steps"] == len(eng.trace.steps)
    assert 0 <= st["kv_waste"] < 1 and 1 <= st["peak_concurrency"] <= 6 and st["peak_blocks_used"] >= 1
