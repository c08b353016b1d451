"""kv_cache_dtype in the engine: the plan's choice and refusals, every route reading 8-bit pages,
the prefix cache, copy-on-write and speculative rollback carrying a block's scales, capacity in
engine.stats() and /metrics. (The quality against 'auto' is measured by `minipaged bench kvquant`,
not asserted here.)"""
from __future__ import annotations

import pytest
import torch

from minipaged import kv_quant as kq
from minipaged.engine import LLMEngine
from minipaged.llm import LLM
from minipaged.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 9, 17, 33, 60, 61, 5, 9, 17, 2, 3], [60, 61, 60, 61, 60, 7], [5, 9, 17, 33, 60, 61, 5, 9, 40, 41]]


def run(model, tok, prompts=PROMPTS, params=GREEDY, **kw):
    eng = LLMEngine(model, tok, block_size=kw.pop("block_size", 4), **kw)
    ids = [eng.add_request({"prompt_token_ids": p}, params) for p in prompts]
    done = eng.run()
    assert eng.allocator.num_free_blocks == eng.allocator.num_blocks, "blocks leaked"
    return [[o.token_ids for o in done[i].outputs] for i in ids], eng


# -- the plan -------------------------------------------------------------------------------------
def test_the_plan_names_the_pages_and_refuses_the_c_attention(tiny_model):
    model, tok = tiny_model
    eng = LLMEngine(model, tok, kv_cache_dtype="int8", num_blocks=16)
    assert "int8 pages, one scale per (block, KV head)" in eng.plan.routes["kv_cache"]
    assert eng.plan.routes["kv_write"] == "torch quantizing write (kv_quant.write)"
    assert eng.kv_cache.k[0].dtype == torch.int8 and eng.kv_cache.k[0].kv_scales.shape == (16, 2)
    if "c_kernels" not in eng.plan.refused and "fast_paths" not in eng.plan.refused:  # the C kernels serve here
        assert "reads fp32 pages only" in eng.plan.refused["c_attention"]
        assert eng.plan.routes["decode_attention"] == "torch"
    plain = LLMEngine(model, tok, num_blocks=16)
    assert plain.plan.routes["kv_cache"].startswith("the model's dtype") and "c_attention" not in plain.plan.refused


def test_explicit_routes_that_cannot_read_8_bit_pages_are_errors(tiny_model):
    model, tok = tiny_model
    with pytest.raises(ValueError, match="attention='cpu' cannot read kv_cache_dtype='fp8'"):
        LLMEngine(model, tok, kv_cache_dtype="fp8", attention="cpu", num_blocks=8)

    def mine(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale, out=None):
        from minipaged.attention.reference import paged_attention

        return paged_attention(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale, out)

    with pytest.raises(ValueError, match="your attention function reads the pages raw"):
        LLMEngine(model, tok, kv_cache_dtype="int8", attention=mine, num_blocks=8)
    mine.dequantizes = True  # it calls the reference, which reads the scales
    got, _ = run(model, tok, kv_cache_dtype="int8", attention=mine, num_blocks=32)
    want, _ = run(model, tok, kv_cache_dtype="int8", attention="reference", num_blocks=32)
    assert got == want


def test_unknown_name_is_refused_by_llm_before_loading(tiny_model):
    model, tok = tiny_model
    with pytest.raises(ValueError, match="use one of auto, fp8, fp8_e4m3, fp8_e5m2, int8"):
        LLM(model, tok, kv_cache_dtype="e4m3")


# -- every route reads 8-bit pages ----------------------------------------------------------------
@pytest.mark.parametrize("name", ["int8", "fp8", "fp8_e5m2"])
def test_greedy_tokens_equal_across_backends_and_routes(tiny_model, name):
    model, tok = tiny_model
    want, _ = run(model, tok, kv_cache_dtype=name, attention="reference", fast_paths=False, num_blocks=32)
    for kw in (dict(attention="torch"), dict(attention="auto"), dict(attention="torch", fast_paths=False)):
        got, eng = run(model, tok, kv_cache_dtype=name, num_blocks=32, **kw)
        assert got == want, kw
    assert "kv_cache_dtype" in eng.stats() and eng.stats()["kv_cache_dtype"] == name


# -- scales that move with their blocks -----------------------------------------------------------
@pytest.mark.parametrize("name", ["int8", "fp8"])
def test_prefix_cache_keeps_the_scales_a_block_was_written_with(tiny_model, name):
    model, tok = tiny_model
    shared = [5, 9, 17, 33, 60, 61, 5, 9, 17, 2, 3, 4, 8]  # 3 full blocks of 4 cached by the first request
    first, second = shared + [40], shared + [41, 42]
    want, _ = run(model, tok, [first, second], kv_cache_dtype=name, enable_prefix_caching=False, num_blocks=32)
    eng = LLMEngine(model, tok, block_size=4, kv_cache_dtype=name, enable_prefix_caching=True, num_blocks=32)
    a = eng.add_request({"prompt_token_ids": first}, GREEDY)
    done = eng.run()
    scales = [t.kv_scales.clone() for t in eng.kv_cache.k + eng.kv_cache.v]
    pages = [t.view(torch.uint8).clone() if t.dtype != torch.int8 else t.clone() for t in eng.kv_cache.k]
    b = eng.add_request({"prompt_token_ids": second}, GREEDY)
    done.update(eng.run())
    assert eng.stats()["prefix_hit_tokens"] >= 12
    assert [[o.token_ids for o in done[i].outputs] for i in (a, b)] == want
    hit = _blocks_of_prefix(eng, shared)
    for before, t in zip(scales, eng.kv_cache.k + eng.kv_cache.v):
        assert torch.equal(before[hit], t.kv_scales[hit]), "a cached block's scales changed when it was reused"
    for before, t in zip(pages, eng.kv_cache.k):
        now = t.view(torch.uint8) if t.dtype != torch.int8 else t
        assert torch.equal(before[hit], now[hit])


def _blocks_of_prefix(eng, tokens):
    """The physical blocks the prefix cache holds for the full blocks of ``tokens``."""
    ids = eng.prefix_cache.match_prefix(tokens)
    assert len(ids) == 3
    return torch.tensor(ids, dtype=torch.long)


@pytest.mark.parametrize("name", ["int8", "fp8_e5m2"])
def test_copy_on_write_samples_equal_one_request(tiny_model, name):
    """n greedy samples share the prompt's last, partly filled block until each writes to it: the
    copy takes the block's scales, so every sample reads what one request alone reads."""
    model, tok = tiny_model
    p = [5, 9, 17, 33, 60, 61, 5, 9, 17, 2]  # 2 full blocks of 4 and a partial one
    (single,), _ = run(model, tok, [p], kv_cache_dtype=name, num_blocks=32)
    (samples,), eng = run(model, tok, [p], SamplingParams(n=3, max_tokens=12, temperature=0.0, ignore_eos=True),
                          kv_cache_dtype=name, num_blocks=32)
    assert all(s == single[0] for s in samples)


def test_the_copy_carries_scales_in_the_engine(tiny_model):
    model, tok = tiny_model
    eng = LLMEngine(model, tok, block_size=4, kv_cache_dtype="int8", num_blocks=16)
    eng.add_request({"prompt_token_ids": [5, 9, 17, 33, 60, 61]}, SamplingParams(max_tokens=1))
    eng.step()
    src = int(torch.nonzero(eng.kv_cache.k[0].kv_scales.amax(-1))[-1])  # the partly filled block
    eng.executor.copy_blocks([(src, 15)])
    for t in eng.kv_cache.k + eng.kv_cache.v:
        assert torch.equal(t.kv_scales[15], t.kv_scales[src]) and torch.equal(t[15], t[src])


@pytest.mark.parametrize("name", ["fp8", "fp8_e5m2"])
def test_speculation_changes_no_token_on_fp8_pages(tiny_model, name):
    """fp8 quantizes each value alone (a layer's scale), so the rejected drafts' rows, rolled back
    and written again, leave the pages as decoding one token a step leaves them."""
    model, tok = tiny_model
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
            "disable_by_batch_size": 10_000}
    want, _ = run(model, tok, kv_cache_dtype=name, num_blocks=48)
    got, eng = run(model, tok, kv_cache_dtype=name, num_blocks=48, speculative_config=spec)
    assert got == want and eng.stats()["spec_decode"]["num_drafts"] > 0


def test_speculation_on_int8_pages_rolls_back_cleanly(tiny_model):
    """int8: a rejected draft may have raised its block's scale (it only grows, so the accepted rows
    stay within one step of their values): every request finishes, no block leaks, every scale is
    finite, and the tokens are those of one token a step except where a near tie flips."""
    model, tok = tiny_model
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
            "disable_by_batch_size": 10_000}
    want, _ = run(model, tok, kv_cache_dtype="int8", num_blocks=48)
    got, eng = run(model, tok, kv_cache_dtype="int8", num_blocks=48, speculative_config=spec)
    assert eng.stats()["spec_decode"]["num_drafts"] > 0
    assert all(torch.isfinite(t.kv_scales).all() for t in eng.kv_cache.k + eng.kv_cache.v)
    assert all(len(g[0]) == len(w[0]) == 12 for g, w in zip(got, want))
    print("int8 with speculation, greedy tokens equal to one a step:",
          sum(a == b for g, w in zip(got, want) for a, b in zip(g[0], w[0])), "of", 12 * len(PROMPTS))


# -- capacity ---------------------------------------------------------------------------------------
def test_stats_and_metrics_count_four_times_the_blocks(tiny_model):
    model, tok = tiny_model
    budget = 2 * 2**20
    c = model.config
    plain = LLMEngine(model, tok, kv_cache_bytes=budget, max_num_seqs=1024, block_size=16)
    q8 = LLMEngine(model, tok, kv_cache_bytes=budget, max_num_seqs=1024, block_size=16, kv_cache_dtype="int8")
    f8 = LLMEngine(model, tok, kv_cache_bytes=budget, max_num_seqs=1024, block_size=16, kv_cache_dtype="fp8")
    per_block = {"auto": 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4 * 16,
                 "fp8": 2 * c.num_layers * c.num_kv_heads * c.head_dim * 16}
    per_block["int8"] = per_block["fp8"] + 2 * c.num_layers * c.num_kv_heads * 4
    for eng, name in ((plain, "auto"), (q8, "int8"), (f8, "fp8")):
        st = eng.stats()
        assert st["num_blocks"] == budget // per_block[name] == eng.allocator.num_blocks, name
        assert st["kv_bytes_per_token"] == eng.kv_bytes_per_token
        assert eng.kv_cache.nbytes <= budget
    assert f8.stats()["num_blocks"] == 4 * plain.stats()["num_blocks"]
    pytest.importorskip("prometheus_client")
    from types import SimpleNamespace

    from minipaged.server.metrics import ServerMetrics

    m = ServerMetrics("tiny")
    m.on_step(SimpleNamespace(num_running=0, num_waiting=0, num_blocks=q8.allocator.num_blocks, num_used_blocks=0,
                              num_preemptions=0, extra={}))
    line = next(x for x in m.render()[0].decode().splitlines() if x.startswith("vllm:num_kv_blocks_total"))
    assert float(line.split()[-1]) == budget // per_block["int8"]


def test_scales_are_finite_after_real_steps(tiny_model):
    model, tok = tiny_model
    _, eng = run(model, tok, kv_cache_dtype="int8", num_blocks=32)
    for t in eng.kv_cache.k + eng.kv_cache.v:
        assert torch.isfinite(t.kv_scales).all() and (t.kv_scales >= 0).all()
    assert kq.kv_format(eng.kv_cache.k[0]).name == "int8"


# -- tensor parallelism: each rank's pages carry their own heads' scales ----------------------------
@pytest.mark.slow
def test_tensor_parallel_int8_pages_equal_one_device(tiny_model):
    model, tok = tiny_model
    want, _ = run(model, tok, kv_cache_dtype="int8", num_blocks=32)
    eng = None
    try:
        got, eng = run(model, tok, kv_cache_dtype="int8", num_blocks=32, tensor_parallel_size=2)
    finally:
        if eng is not None:
            eng.shutdown()
    assert got == want
    assert eng.kv_cache.k[0].dtype == torch.int8 and eng.kv_cache.num_kv_heads == 1  # the driver's shard


def test_prompt_logprobs_read_the_engines_page_format(tiny_model):
    """The scratch pass of prompt_logprobs stores the prompt in the engine's 8-bit format too."""
    model, tok = tiny_model
    p = [5, 9, 17, 33, 60, 61, 5, 9]
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)

    def logprobs(name):
        eng = LLMEngine(model, tok, kv_cache_dtype=name, num_blocks=16, block_size=4)
        rid = eng.add_request({"prompt_token_ids": p}, params)
        out = eng.run()[rid]
        return [next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]]

    plain, q8 = logprobs("auto"), logprobs("int8")
    assert plain != q8 and max(abs(a - b) for a, b in zip(plain, q8)) < 0.5


def test_an_unavailable_dtype_is_an_error_when_the_engine_is_built(tiny_model, monkeypatch):
    model, tok = tiny_model
    monkeypatch.delitem(kq.FORMATS, "fp8_e5m2")
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8_e5m2' cannot run: this torch"):
        LLMEngine(model, tok, kv_cache_dtype="fp8_e5m2", num_blocks=8)
