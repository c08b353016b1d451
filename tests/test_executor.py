"""One executor per engine, one plan made once (minipaged/plan.py, minipaged/executor.py).

- the plan names, for every stage, what runs, and for every fast path refused, why; it is
  immutable, printed as a table, in ``stats()``, and each trace step records its route;
- ``fast_paths=False`` is the plain route: the Python model and the chosen attention only;
- every route gives the plain route's greedy tokens (the C routes to fp32 rounding, the GGUF
  routes bit for bit against model.forward on the same table);
- two engines on one model hold different settings at once, interleaved, and neither changes
  the model; a learner's attention is called in every layer of every step;
- a fast path asked for with True where it cannot be is refused when the engine is built, with
  the reason; an environment variable only sets a default.
"""
from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from minipaged import SamplingParams
from minipaged.attention import reference
from minipaged.config import EngineConfig
from minipaged.cpu import build
from minipaged.plan import STAGES
from minipaged.cpu.gguf_blocks import GGUFBlocks
from minipaged.engine import LLMEngine
from minipaged.model import load_model
from minipaged.model.llama import ModelSource

needs_c = pytest.mark.skipif(build.library() is None, reason=f"no C kernels here: {build.info().get('why_not')}")
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 9, 14, 3, 8, 22, 41, 7, 13, 2, 19, 30, 11], [101, 7, 55], [64, 3, 200, 17, 9, 4, 88], [31, 32, 33, 34, 35]]


def q8_0_blocks(w: torch.Tensor) -> GGUFBlocks:
    """``w`` (N, K) quantized as a GGUF file stores Q8_0 rows: per 32 weights an fp16 scale and 32 int8s."""
    n, k = w.shape
    blocks = w.detach().double().numpy().reshape(n, k // 32, 32)
    d = (np.abs(blocks).max(-1, keepdims=True) / 127).astype(np.float16)
    q = np.clip(np.round(blocks / np.where(d == 0, 1, d.astype(np.float64))), -127, 127).astype(np.int8)
    raw = np.concatenate([d.view(np.uint8), q.view(np.uint8)], axis=-1).reshape(n, -1)
    return GGUFBlocks.from_file_rows("Q8_0", raw)


@pytest.fixture()
def fresh_tiny(tiny_hf_dir):
    """A tiny model of its own (tests here change weights)."""
    return load_model(tiny_hf_dir)


@pytest.fixture()
def gguf_tiny(tiny_hf_dir):
    """The tiny model with every linear layer's weight replaced by its Q8_0 blocks' values, the
    blocks handed in as a GGUF file's would be (model.source)."""
    model, tok = load_model(tiny_hf_dir)
    blocks = {}
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear):
            b = q8_0_blocks(m.weight)
            m.weight.data.copy_(b.dequantize())
            blocks["lm_head.weight" if m is model.lm_head else f"model.{name}.weight"] = b
    model.source = ModelSource("(memory)", "gguf", {"gguf_blocks": blocks})
    return model, tok


def run(engine: LLMEngine, prompts=PROMPTS, params=GREEDY) -> list[list[int]]:
    ids = [engine.add_request(p, params) for p in prompts]
    done = engine.run()
    for i in ids:
        assert done[i].finish_reason == "length", done[i].error
    return [done[i].token_ids for i in ids]


def small(**kw) -> dict:
    # a small pool and budget: chunked prefills, mixed steps, preemption
    return dict(block_size=4, num_blocks=14, max_num_batched_tokens=8, enable_prefix_caching=False, **kw)


def test_the_plain_route_is_the_model_and_the_chosen_backend(tiny_model):
    model, tok = tiny_model
    eng = LLMEngine(model, tok, fast_paths=False, **small())
    plan = eng.plan
    assert set(plan.routes) == set(STAGES)
    assert plan.routes["linear"] == "torch (F.linear)" and plan.routes["elementwise"] == "torch"
    assert plan.routes["whole_step_decode"].startswith("off") and plan.routes["next_token"] == "sampler over the logits"
    assert eng.backend.name == "torch" and plan.backend == "torch"
    assert "fast_paths" in plan.refused
    run(eng)
    assert set(eng.route_counts) == {"model+sampler", "model+none"}  # a chunk of a prompt samples nothing
    assert sum(eng.route_counts.values()) == eng.num_steps
    assert {r.route for r in eng.trace.steps} == set(eng.route_counts)
    assert eng.stats()["plan"] == plan.as_dict()


@needs_c
def test_the_default_plan_on_a_cpu_takes_the_c_kernels_and_says_why_not_the_rest(tiny_model):
    model, tok = tiny_model
    eng = LLMEngine(model, tok, **small())
    r = eng.plan.routes
    assert eng.backend.name == "cpu" and r["decode_attention"].startswith("c ") and r["kv_write"].startswith("c ")
    assert r["elementwise"].startswith("c ")
    # a model from a Hugging Face folder has no GGUF blocks: refused, with the reason
    assert "GGUF file" in eng.plan.refused["gguf_blocks"]
    assert "whole_step_decode" in eng.plan.refused and "greedy_from_head" in eng.plan.refused
    text = str(eng.plan)
    for stage in STAGES:
        assert stage in text
    assert "refused:" in text and "gguf_blocks" in text
    with pytest.raises(TypeError):
        eng.plan.routes["linear"] = "mine"  # immutable
    run(eng)
    assert {k.split("+")[0] for k in eng.route_counts} == {"layers"}


@needs_c
@pytest.mark.parametrize("settings", [
    dict(),  # C attention, C element-wise ops
    dict(attention="torch"),  # C element-wise ops, PyTorch's SDPA
    dict(prefill_as_decodes=False),
    dict(c_kernels=False),  # model.forward on a table of PyTorch ops
    dict(packed_gemm=True, max_num_seqs=4),
], ids=["c", "c-ops+sdpa", "no-prefill-as-decodes", "walk-torch", "packed"])
def test_every_route_gives_the_plain_routes_greedy_tokens(tiny_model, settings):
    model, tok = tiny_model
    want = run(LLMEngine(model, tok, fast_paths=False, **small()))
    eng = LLMEngine(model, tok, **small(**settings))
    assert run(eng) == want
    assert eng.scheduler.num_preemptions > 0 or eng.num_steps > len(PROMPTS)  # mixed, chunked steps happened


@needs_c
def test_the_gguf_routes_whole_step_and_head_argmax(gguf_tiny):
    from minipaged.cpu import kernels

    model, tok = gguf_tiny
    avx512 = kernels.qmatmul_fast()  # elsewhere gguf_blocks=True runs the portable loop, and the head's argmax is refused
    if not avx512:
        with pytest.raises(ValueError, match="greedy_from_head=True cannot be honoured: .*AVX-512"):
            LLMEngine(model, tok, **small(gguf_blocks=True, greedy_from_head=True))
    on = dict(gguf_blocks=True, whole_step_decode=True, greedy_from_head=True if avx512 else None)
    # room for 9+ decodes in one step (the head's argmax serves 9+ greedy rows; small()'s budget of 8 never has them)
    wide = dict(block_size=4, num_blocks=96, max_num_batched_tokens=32, enable_prefix_caching=False, max_num_seqs=16)
    eng = LLMEngine(model, tok, **on, **wide)
    r = eng.plan.routes
    assert r["linear"].startswith("gguf Q8_0") and r["whole_step_decode"].startswith("c ")
    assert r["next_token"].startswith("head-argmax") == avx512
    prompts = PROMPTS * 3  # more than 8 greedy rows at once: the head's argmax serves
    got = run(eng, prompts)
    assert any(k.startswith("whole_step+") for k in eng.route_counts)
    assert any(k.endswith("+head_argmax") for k in eng.route_counts) == avx512
    # short prompts' tokens attend as decode rows (cpu.attention.tokens_as_decodes): the one call serves them too
    assert not any(k.startswith("layers+") for k in eng.route_counts)
    # with prefill_as_decodes off, prefill chunks attend through SDPA, so they take model.forward on the table
    nopad = LLMEngine(model, tok, **on, **{**wide, "prefill_as_decodes": False})
    assert run(nopad, prompts) == got
    assert any(k.startswith("layers+") for k in nopad.route_counts)
    assert any(k.startswith("whole_step+") for k in nopad.route_counts)  # the decodes still take the one call
    # the same blocks layer by layer, and the logits' argmax: the same bits, so the same tokens
    walk = LLMEngine(model, tok, gguf_blocks=True, whole_step_decode=False, greedy_from_head=False, **wide)
    assert run(walk, prompts) == got
    assert not any(k.startswith("whole_step") or k.endswith("head_argmax") for k in walk.route_counts)
    # and the plain model on the blocks' fp32 values
    assert run(LLMEngine(model, tok, fast_paths=False, **wide), prompts) == got


@needs_c
def test_weights_changed_after_loading_are_never_served_from_the_files_blocks(gguf_tiny):
    model, tok = gguf_tiny
    with torch.no_grad():
        model.layers[1].mlp.down_proj.weight.mul_(2.0)
    from minipaged.cpu import kernels

    if kernels.qmatmul_fast():  # where the default would take the blocks, it refuses them now
        eng = LLMEngine(model, tok, **small())
        assert "changed after loading" in eng.plan.refused["gguf_blocks"]
        assert not eng.plan.routes["linear"].startswith("gguf")  # the fp32 weights (F.linear or MKL-packed)
    with pytest.raises(ValueError, match="gguf_blocks=True cannot be honoured: the weights were changed"):
        LLMEngine(model, tok, **small(gguf_blocks=True))


def test_true_is_refused_where_it_cannot_be_with_the_reason(tiny_model):
    model, tok = tiny_model
    with pytest.raises(ValueError, match="gguf_blocks=True cannot be honoured: .*GGUF file"):
        LLMEngine(model, tok, **small(gguf_blocks=True))
    with pytest.raises(ValueError, match="needs fast_paths=True"):
        LLMEngine(model, tok, **small(fast_paths=False, c_kernels=True))
    with pytest.raises(ValueError, match="whole_step_decode=True cannot be honoured: attention is .*yours"):
        LLMEngine(model, tok, **small(attention=reference.paged_attention, whole_step_decode=True))
    with pytest.raises(ValueError, match="must be True, False or None"):
        EngineConfig(gguf_blocks="yes")


def test_the_environment_only_sets_a_default(monkeypatch):
    monkeypatch.setenv("MINIPAGED_FAST_PATHS", "0")
    monkeypatch.setenv("MINIPAGED_CPU_KERNELS", "0")
    assert EngineConfig().fast_paths is False and EngineConfig().c_kernels is False
    assert EngineConfig(fast_paths=True, c_kernels=None).fast_paths is True
    monkeypatch.delenv("MINIPAGED_FAST_PATHS")
    monkeypatch.delenv("MINIPAGED_CPU_KERNELS")
    assert EngineConfig().fast_paths is True and EngineConfig().c_kernels is None


def _model_state(model: torch.nn.Module) -> list:
    """Everything an engine could change on a model: each module's attributes, hooks and tensors."""
    out = []
    for name, m in model.named_modules():
        out.append((name, type(m), sorted(vars(m)), dict(m._forward_hooks), dict(m._forward_pre_hooks)))
        for pname, p in m.named_parameters(recurse=False):
            out.append((name, pname, p.data_ptr(), p.clone()))
    return out


def _same_state(a: list, b: list) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if len(x) != len(y):
            return False
        for u, v in zip(x, y):
            if isinstance(u, torch.Tensor):
                if not torch.equal(u, v):
                    return False
            elif u != v:
                return False
    return True


def test_two_engines_on_one_model_hold_different_settings_interleaved(fresh_tiny):
    model, tok = fresh_tiny
    before = _model_state(model)
    a = LLMEngine(model, tok, **small())
    b = LLMEngine(model, tok, fast_paths=False, **small())
    calls = []

    def mine(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale, out=None):
        calls.append(1)
        return reference.paged_attention(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale, out)

    c = LLMEngine(model, tok, attention=mine, **small())
    assert _same_state(before, _model_state(model)), "building an engine changed the model"
    assert a.backend is not b.backend is not c.backend and c.backend.name == "mine"
    ids = {e: [e.add_request(p, GREEDY) for p in PROMPTS] for e in (a, b, c)}
    outs = {e: {} for e in ids}
    while any(e.has_unfinished_requests() for e in ids):  # one step of each, in turn
        for e in ids:
            for o in e.step():
                if o.finished:
                    outs[e][o.request_id] = o.token_ids
    tokens = [[outs[e][i] for i in ids[e]] for e in (a, b, c)]
    assert tokens[0] == tokens[1] == tokens[2]
    assert a.plan != b.plan and {k.split("+")[0] for k in b.route_counts} == {"model"}
    assert _same_state(before, _model_state(model)), "serving changed the model"
    assert calls  # c's attention ran; a's and b's never called it


def test_a_learners_attention_is_called_in_every_layer_of_every_step(tiny_model):
    model, tok = tiny_model
    seen = []

    def mine(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale, out=None):
        seen.append(k_cache.data_ptr())
        return reference.paged_attention(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale, out)

    eng = LLMEngine(model, tok, attention=mine, **small())
    assert "yours" in eng.plan.routes["decode_attention"]
    assert "every layer calls it" in eng.plan.refused.get("whole_step_decode", "every layer calls it")
    run(eng)
    layers = model.config.num_layers
    assert len(seen) == layers * eng.num_steps
    pages = [t.data_ptr() for t in eng.kv_cache.k]
    assert seen == pages * eng.num_steps  # layer 0, 1, ... of every step, in order


def test_an_error_in_one_engines_attention_fails_only_that_engines_requests(tiny_model):
    model, tok = tiny_model
    good = LLMEngine(model, tok, **small())
    bad = LLMEngine(model, tok, attention=lambda q, k, v, bt, cl, qsl, scale, out=None: 1 / 0, **small())
    rid = bad.add_request(PROMPTS[0], GREEDY)
    with pytest.warns(UserWarning):
        done = bad.run()
    assert done[rid].finish_reason == "error" and "ZeroDivisionError" in done[rid].error
    assert run(good) == run(LLMEngine(model, tok, fast_paths=False, **small()))


def test_serving_replaces_no_module_level_state(tiny_model):
    """Nothing of minipaged's modules is replaced or added by serving: per-step caches live on engines."""
    model, tok = tiny_model
    run(LLMEngine(model, tok, **small()))  # first use: the C build, if any, is loaded here

    def snapshot():
        return {name: {k: id(v) for k, v in vars(mod).items()} for name, mod in list(sys.modules.items())
                if name.startswith("minipaged") and mod is not None}

    before = snapshot()
    run(LLMEngine(model, tok, **small()))
    run(LLMEngine(model, tok, attention="torch", **small()))
    after = snapshot()
    changed = {(m, k) for m in before for k in before[m] if after.get(m, {}).get(k) != before[m][k]}
    added = {(m, k) for m in before for k in after.get(m, {}) if k not in before[m]}
    assert not changed and not added, (changed, added)


def test_a_finished_engine_is_freed_after_generate_and_stream(tiny_model):
    """Nothing module-level keeps an engine (its KV cache, its executor's copies) alive."""
    import gc
    import weakref

    from minipaged import LLM

    model, tok = tiny_model
    refs = []
    for _ in range(2):
        llm = LLM(model, tok, num_blocks=16)
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3))
        list(llm.stream([5, 6, 7], SamplingParams(max_tokens=3)))
        refs.append(weakref.ref(llm.engine))
        del llm
    gc.collect()
    assert [r() for r in refs] == [None, None]
