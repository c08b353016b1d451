"""A decode step's layers in one C call (cpu_kernels.decode_layers, LlamaModel._decode_plan).

- the one call gives the layer-by-layer forward's bits exactly: hidden states and every page of
  the K/V cache, for the row layout (at most 8 sequences) and the lane layout (more), head_dim
  64 (the AVX-512 attention) and 16, with and without q/k/v biases, Q4_0/Q4_1/Q8_0 weights;
- it stands in only where it is exact: a step of decodes only, the "torch" backend, minipaged's
  own layer classes with no hooks, every weight served from fresh GGUF blocks. A backend of
  your own, a hook, a prefill, a changed weight or ``fused_decode = False`` runs layer by layer;
- bad metadata is refused with nothing written (cache and residual stream unchanged);
- the portable build (no AVX-512, no OpenMP) gives the same answers;
- greedy steps take each row's argmax straight from the LM head's matmul: the logits' argmax,
  ties and NaN rows included; sampled rows and hooks on the head take the logits.
"""
from __future__ import annotations

import pytest
import torch

from minipaged.attention import REFERENCE, TORCH, AttentionBackend, AttentionMetadata, cpu_kernels
from minipaged.model.config import LlamaConfig
from minipaged.model.gguf_blocks import GGUFBlocks
from minipaged.model.llama import Linear, LlamaModel
from test_gguf_blocks import portable_build, random_rows

needs_fast = pytest.mark.skipif(not cpu_kernels.qmatmul_fast(), reason="the fused decode needs the fast GGUF matmul (AVX-512)")
BS = 4


def small_rows(kind: str, n: int, k: int, seed: int) -> "np.ndarray":
    """random_rows with small fp16 scales, so that activations stay tame through the layers."""
    import numpy as np

    rows = random_rows(kind, n, k, seed=seed).reshape(n, k // 32, -1)
    rng = np.random.default_rng(seed + 1000)
    d = rng.choice(np.array([1e-3, -2e-3, 4e-3, -3e-3, 0.0], dtype=np.float16), size=(n, k // 32, 2))
    rows[..., 0:2] = d[..., 0:1].view(np.uint8)
    if kind == "Q4_1":
        rows[..., 2:4] = (d[..., 1:2] * np.float16(-4)).view(np.uint8)
    return rows.reshape(n, -1)


def gguf_model(head_dim=16, bias=False, kinds=("Q4_1", "Q8_0", "Q4_0"), seed=0) -> LlamaModel:
    """A small Llama whose every linear layer keeps GGUF blocks of its very weights."""
    heads = 4 if head_dim == 16 else 2
    cfg = LlamaConfig(vocab_size=200, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=heads,
                      num_kv_heads=heads // 2, head_dim=head_dim, max_position_embeddings=128, attention_bias=bias)
    torch.manual_seed(seed)
    model = LlamaModel(cfg)
    for p in model.parameters():
        p.data.normal_(0, 0.3)
    blocks = {}
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, Linear) and m is not model.lm_head]
    for i, (name, m) in enumerate(linears):
        kind = kinds[i % len(kinds)]
        b = GGUFBlocks.from_file_rows(kind, small_rows(kind, *m.weight.shape, seed=seed * 100 + i))
        m.weight.data.copy_(b.dequantize())
        blocks[f"model.{name}.weight"] = b
    assert model.keep_gguf_blocks(blocks) == len(linears)
    model.use_gguf_blocks()
    return model.eval()


def decode_step(model, n, seed=0, lens=None):
    """A step of n decodes over random cached contexts: (input_ids, positions, cache, metadata)."""
    g = torch.Generator().manual_seed(seed)
    lens = lens or [int(x) for x in torch.randint(1, 30, (n,), generator=g)]
    per = [-(-L // BS) for L in lens]
    cache = model.new_kv_cache(sum(per) + 3, BS)
    for t in cache.k + cache.v:
        t.normal_(0, 1, generator=g)
    ids = torch.randperm(sum(per) + 3, generator=g)[: sum(per)].to(torch.int32)
    tables = torch.zeros(n, max(per), dtype=torch.int32)
    at = 0
    for s, p in enumerate(per):
        tables[s, :p] = ids[at:at + p]
        at += p
    slots = torch.tensor([int(tables[s, (L - 1) // BS]) * BS + (L - 1) % BS for s, L in enumerate(lens)])
    meta = AttentionMetadata(slots, tables, torch.tensor(lens, dtype=torch.int32),
                             torch.arange(n + 1, dtype=torch.int32), n)
    input_ids = torch.randint(0, model.config.vocab_size, (n,), generator=g)
    return input_ids, torch.tensor(lens) - 1, cache, meta


def clone_cache(cache):
    new = type(cache).__new__(type(cache))
    new.__dict__.update(cache.__dict__)
    new.k, new.v = [t.clone() for t in cache.k], [t.clone() for t in cache.v]
    return new


def counting(monkeypatch):
    calls = []
    real = cpu_kernels.decode_layers
    monkeypatch.setattr(cpu_kernels, "decode_layers", lambda *a, **k: calls.append(a[1].shape[0]) or real(*a, **k))
    return calls


def run_both(model, step):
    """(fused hidden, fused cache, layer-by-layer hidden, its cache)."""
    ids, pos, cache, meta = step
    c1, c2 = clone_cache(cache), clone_cache(cache)
    model.fused_decode = True
    h1 = model(ids, pos, c1, meta, TORCH)
    model.fused_decode = False
    try:
        h2 = model(ids, pos, c2, meta, TORCH)
    finally:
        model.fused_decode = True
    return h1, c1, h2, c2


@needs_fast
@pytest.mark.parametrize("head_dim,bias", [(16, False), (64, False), (16, True), (64, True)])
@pytest.mark.parametrize("n", [1, 3, 8, 9, 20])
def test_the_one_call_gives_the_layer_by_layer_bits(head_dim, bias, n, monkeypatch):
    model = gguf_model(head_dim, bias)
    calls = counting(monkeypatch)
    h1, c1, h2, c2 = run_both(model, decode_step(model, n, seed=n))
    assert calls == [n], "the one-call decode did not run"
    assert torch.equal(h1, h2), f"hidden states differ by {(h1 - h2).abs().max():.3g}"
    for layer in range(model.config.num_layers):
        assert torch.equal(c1.k[layer], c2.k[layer]) and torch.equal(c1.v[layer], c2.v[layer]), f"layer {layer}'s pages differ"


@needs_fast
def test_the_default_model_decodes_the_same_tokens_either_way(smollm2):
    from minipaged import LLM, SamplingParams

    model, tok = smollm2
    prompts = ["The capital of France is", "List three prime numbers:", "Write a haiku about rain.",
               "What is 12 times 7?"] * 3
    params = SamplingParams(max_tokens=10, temperature=0.0)
    llm = LLM(model, tok, num_blocks=128)
    try:
        model.fused_decode = False
        want = [o.token_ids for o in llm.generate(prompts, params)]
    finally:
        model.fused_decode = True
    assert [o.token_ids for o in llm.generate(prompts, params)] == want


@needs_fast
def test_it_stands_in_only_where_it_is_exact(monkeypatch):
    model = gguf_model()
    calls = counting(monkeypatch)
    step = decode_step(model, 5)
    ids, pos, cache, meta = step

    # a backend of your own is always called
    seen = []

    def mine(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale, out=None):
        seen.append(q.shape[0])
        return REFERENCE.paged_attention(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale, out)

    model(ids, pos, clone_cache(cache), meta, AttentionBackend("mine", TORCH.write_kv, mine))
    assert calls == [] and seen == [5] * model.config.num_layers

    # a hook on any part sees its call
    hooked = []
    handle = model.layers[1].mlp.down_proj.register_forward_hook(lambda *a: hooked.append(1))
    model(ids, pos, clone_cache(cache), meta, TORCH)
    handle.remove()
    assert calls == [] and hooked == [1]

    # a step with a prefill in it, and fused_decode = False
    mixed = AttentionMetadata(meta.slot_mapping, meta.block_tables, meta.context_lens, meta.query_start_loc, 4)
    model(ids, pos, clone_cache(cache), mixed, TORCH)
    model.fused_decode = False
    model(ids, pos, clone_cache(cache), meta, TORCH)
    model.fused_decode = True
    assert calls == []

    # a batch above gguf_rows multiplies on the fp32 copies, layer by layer
    model.use_gguf_blocks(4)
    model(ids, pos, clone_cache(cache), meta, TORCH)
    assert calls == []
    model.use_gguf_blocks()

    # another cache (other pages, another size): the plan follows it
    other = decode_step(model, 5, seed=9, lens=[40, 3, 17, 1, 25])
    plan_a = model._decode_plan(torch.zeros(5, 64), meta, cache, TORCH)
    plan_b = model._decode_plan(torch.zeros(5, 64), other[3], other[2], TORCH)
    assert plan_a.cache_shape != plan_b.cache_shape
    h1, _, h2, _ = run_both(model, other)
    assert torch.equal(h1, h2)

    # a hook on the embedding (the one call updates the embedding's output in place)
    handle = model.embed_tokens.register_forward_hook(lambda *a: None)
    n_calls = len(calls)
    model(ids, pos, clone_cache(cache), meta, TORCH)
    handle.remove()
    assert len(calls) == n_calls
    calls.clear()

    # a weight changed in place after a fused step: never served from the old blocks or plan
    h_before = model(ids, pos, clone_cache(cache), meta, TORCH)
    assert calls == [5]
    with torch.no_grad():
        model.layers[0].self_attn.o_proj.weight.mul_(2.0)
    h1, _, h2, _ = run_both(model, step)
    assert calls == [5], "a changed weight's stale blocks were used"
    assert torch.equal(h1, h2) and not torch.equal(h1, h_before)

    # a norm weight changed in place: the plan is rebuilt (the norm is read from its tensor)
    model2 = gguf_model(seed=1)
    h_a = model2(ids, pos, clone_cache(cache), meta, TORCH)
    with torch.no_grad():
        model2.layers[1].post_attention_layernorm.weight.mul_(0.5)
    h1, _, h2, _ = run_both(model2, step)
    assert torch.equal(h1, h2) and not torch.equal(h1, h_a)


@needs_fast
def test_bad_metadata_is_refused_with_nothing_written():
    model = gguf_model()
    ids, pos, cache, meta = decode_step(model, 6)
    plan = model._decode_plan(torch.zeros(6, 64), meta, cache, TORCH)
    assert plan is not None
    cos, sin = model.rope_cos[pos], model.rope_sin[pos]
    k0 = [t.clone() for t in cache.k]
    num_slots = cache.num_blocks * BS
    cases = {
        "slot": (AttentionMetadata(meta.slot_mapping.clone().index_fill_(0, torch.tensor([5]), num_slots),
                                   meta.block_tables, meta.context_lens, meta.query_start_loc, 6), IndexError, "slot"),
        "block": (AttentionMetadata(meta.slot_mapping, meta.block_tables.clone().index_fill_(0, torch.tensor([5]), -1),
                                    meta.context_lens, meta.query_start_loc, 6), IndexError, "block"),
        "context": (AttentionMetadata(meta.slot_mapping, meta.block_tables,
                                      meta.context_lens.clone().index_fill_(0, torch.tensor([5]), 10_000),
                                      meta.query_start_loc, 6), ValueError, "longer than its block table"),
        "not decodes": (AttentionMetadata(meta.slot_mapping, meta.block_tables, meta.context_lens,
                                          torch.tensor([0, 1, 2, 3, 4, 4, 6], dtype=torch.int32), 6),
                        ValueError, "exactly one new token"),
    }
    for name, (bad, error, says) in cases.items():
        x = torch.randn(6, 64)
        x0 = x.clone()
        with pytest.raises(error, match=says):
            cpu_kernels.decode_layers(plan, x, cos, sin, bad, 0.25)
        assert torch.equal(x, x0), f"{name}: the residual stream was written"
        assert all(torch.equal(a, b) for a, b in zip(cache.k, k0)), f"{name}: the cache was written"


def test_the_portable_build_gives_the_same_answers(tmp_path, monkeypatch):
    """Built without AVX-512 or OpenMP (a laptop, a Mac), the one call runs the portable loops:
    the same layer maths, to fp32 rounding of its plain loops."""
    import ctypes

    if not cpu_kernels.available():
        pytest.skip(f"no CPU kernels here: {cpu_kernels.why_not()}")
    lib = portable_build(tmp_path)
    lib.minipaged_decode_layers_f32.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
    lib.minipaged_decode_layers_f32.restype = ctypes.c_int
    for n in (3, 12):  # the row layout's loop, and the lane layout's
        model = gguf_model(head_dim=16, bias=True)
        ids, pos, cache, meta = decode_step(model, n, seed=n)
        plan = model._decode_plan(torch.zeros(n, 64), meta, cache, TORCH) if cpu_kernels.qmatmul_fast() else None
        if plan is None:
            plan = _plan_by_hand(model, cache)
        x = model.embed_tokens(ids)
        cos, sin = model.rope_cos[pos], model.rope_sin[pos]
        want_cache = clone_cache(cache)
        model.fused_decode = False
        model.use_gguf_blocks(0)  # layer by layer on the fp32 copies: the oracle
        want = model(ids, pos, want_cache, meta, TORCH)
        monkeypatch.setattr(cpu_kernels, "_lib", lib)
        x = cpu_kernels.decode_layers(plan, x, cos, sin, meta, model.layers[0].self_attn.scale)
        monkeypatch.undo()
        got = model.norm(x)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        for a, b in zip(cache.k + cache.v, want_cache.k + want_cache.v):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def _plan_by_hand(model, cache):
    c = model.config
    layers = []
    for layer, k, v in zip(model.layers, cache.k, cache.v):
        a, mlp = layer.self_attn, layer.mlp
        layers.append({"input_norm": layer.input_layernorm.weight, "post_norm": layer.post_attention_layernorm.weight,
                       **{n: (m.blocks, m.bias) for n, m in (("q", a.q_proj), ("k", a.k_proj), ("v", a.v_proj),
                                                             ("o", a.o_proj), ("gate", mlp.gate_proj),
                                                             ("up", mlp.up_proj), ("down", mlp.down_proj))},
                       "k_cache": k, "v_cache": v})
    return cpu_kernels.DecodeLayers(layers, c.rms_norm_eps, {"C": c.hidden_size, "H": c.num_heads, "H_kv": c.num_kv_heads,
                                                             "D": c.head_dim, "I": c.intermediate_size})


@needs_fast
@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_the_heads_argmax_is_the_argmax_of_its_logits(kind):
    """qmatmul_argmax gives argmax(qmatmul(x, blocks)) row by row without making the product:
    ties across pairs and threads go to the first position, a NaN row refuses (None), and up to
    8 rows it is not for it (None: the row layout's logits are small)."""
    rows = small_rows(kind, 1000, 64, seed=3)
    rows[700] = rows[37]  # output 700 ties output 37 for every x: the first must win
    rows[999] = rows[998]
    blocks = GGUFBlocks.from_file_rows(kind, rows)
    g = torch.Generator().manual_seed(0)
    for m in (9, 16, 64, 100):
        x = torch.randn(m, 64, generator=g)
        want = cpu_kernels.qmatmul(x, blocks).argmax(-1).tolist()
        assert cpu_kernels.qmatmul_argmax(x, blocks) == want
    w = blocks.dequantize()
    x = torch.zeros(12, 64)
    x[:6] = w[37] * 5  # rows whose best output is 37 (and its twin 700)
    x[6:] = w[998] * 5
    got = cpu_kernels.qmatmul_argmax(x, blocks)
    assert got == cpu_kernels.qmatmul(x, blocks).argmax(-1).tolist()
    assert 700 not in got and 999 not in got, "a tie went to the later position"
    assert cpu_kernels.qmatmul_argmax(torch.zeros(10, 64), blocks) == [0] * 10  # every output ties
    bad = torch.randn(10, 64, generator=g)
    bad[4, 3] = float("nan")
    assert cpu_kernels.qmatmul_argmax(bad, blocks) is None
    assert cpu_kernels.qmatmul_argmax(torch.randn(8, 64, generator=g), blocks) is None


@needs_fast
def test_greedy_steps_take_the_heads_argmax_and_others_the_logits(smollm2, monkeypatch):
    from minipaged import LLM, SamplingParams

    model, tok = smollm2
    prompts = ["The capital of France is", "List three prime numbers:", "Write a haiku about rain.",
               "What is 12 times 7?", "Name a colour.", "Say hello."] * 2
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    llm = LLM(model, tok, num_blocks=128)
    used = []
    real = type(model).greedy_tokens
    monkeypatch.setattr(type(model), "greedy_tokens", lambda self, h: used.append(h.shape[0]) or real(self, h))
    got = [o.token_ids for o in llm.generate(prompts, greedy)]
    assert used and used[0] == 12 and all(8 < n <= 12 for n in used)
    monkeypatch.setattr(type(model), "greedy_tokens", lambda self, h: None)  # always the logits and the Sampler
    assert [o.token_ids for o in llm.generate(prompts, greedy)] == got
    # a sampled request in the step, or n > 1: the logits and the Sampler
    monkeypatch.setattr(type(model), "greedy_tokens", lambda self, h: pytest.fail("argmax used for sampled rows"))
    llm.generate(prompts[:11] + [prompts[11]], [greedy] * 11 + [SamplingParams(max_tokens=8, temperature=0.7, seed=1)])
    # n > 1: the prompt's one row of logits feeds all its samples (the Sampler), then each greedy
    # sample decodes like any other
    monkeypatch.setattr(type(model), "greedy_tokens", real)
    many = llm.generate(prompts[:1], SamplingParams(max_tokens=8, temperature=0.0, n=12))[0]
    assert [o.token_ids for o in many.outputs] == [got[0]] * 12
    # a hook on the head sees every call
    seen = []
    handle = model.lm_head.register_forward_hook(lambda *a: seen.append(1))
    try:
        assert [o.token_ids for o in llm.generate(prompts, greedy)] == got
    finally:
        handle.remove()
    assert len(seen) >= 8


@needs_fast
def test_the_plan_keeps_no_cache_alive():
    """The plan and its check hold addresses, never the pages: a finished engine's cache is freed."""
    import gc
    import weakref

    model = gguf_model()
    ids, pos, cache, meta = decode_step(model, 5)
    model(ids, pos, cache, meta, TORCH)
    assert model.__dict__.get("_decode_plan_cache") is not None, "the one-call decode did not run"
    page = weakref.ref(cache.k[0])
    del cache
    gc.collect()
    assert page() is None, "the decode plan keeps a cache's pages alive"
