"""A decode step's layers in one C call (the executor's whole-step decode, cpu.kernels.decode_layers),
and the next token straight from the LM head's blocks (greedy-from-head).

- the one call gives the layer-by-layer route's bits exactly (the same C kernels, the same GGUF
  blocks, whole_step_decode=False): hidden states and every page of the K/V cache, for the row
  layout (at most 8 sequences) and the lane layout (more), head_dim 64 and 16, with and without
  q/k/v biases, Q4_0/Q4_1/Q8_0 weights; and the plain route's (fast_paths=False) to fp32
  rounding, with the same greedy tokens through the engine;
- it stands in only on steps of decodes only; whole_step_decode=False or a hook runs layer by
  layer; a norm weight changed in place is read from its tensor by both routes;
- bad metadata is refused with nothing written (cache and residual stream unchanged), through
  the executor and through decode_layers itself;
- the portable build (no AVX-512, no OpenMP) gives the same answers;
- greedy steps take each row's argmax straight from the LM head's matmul: the logits' argmax,
  ties and NaN rows included; sampled rows, n > 1 and small batches take the logits
  (AVX-512 only: elsewhere greedy_from_head=True is refused, and the argmax kernel says None);
- an engine's executor keeps its cache alive only as long as the engine lives.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from minipaged.attention import AttentionMetadata
from minipaged.cpu import build, kernels
from minipaged.cpu.gguf_blocks import GGUFBlocks
from test_gguf_blocks import ALL_ON, gguf_model, small_rows

needs_kernels = pytest.mark.skipif(build.library() is None, reason=f"no CPU kernels here: {build.info()['why_not']}")
needs_fast = pytest.mark.skipif(not kernels.qmatmul_fast(), reason="greedy-from-head needs the fast GGUF matmul (AVX-512)")
needs_slow = pytest.mark.skipif(build.library() is None or kernels.qmatmul_fast(),
                                reason="for a build of the kernels without AVX-512")
BS = 4
NUM_BLOCKS = 96
LAYERS = ALL_ON | {"whole_step_decode": False}  # the same fast paths, layer by layer


def engine(model, **settings):
    from minipaged.engine import LLMEngine

    settings = {"num_blocks": NUM_BLOCKS, "block_size": BS, "max_num_seqs": 32, "record_trace": False, **settings}
    return LLMEngine(model, None, **settings)


def decode_step(eng, n, seed=0, lens=None):
    """A step of n decodes over random cached contexts, the engine's pages filled with random K/V
    (the same for every engine on the same model): (input_ids, positions, metadata)."""
    g = torch.Generator().manual_seed(seed)
    for t in eng.kv_cache.k + eng.kv_cache.v:
        t.normal_(0, 1, generator=g)
    lens = lens or [int(x) for x in torch.randint(1, 30, (n,), generator=g)]
    per = [-(-L // BS) for L in lens]
    num_blocks = eng.kv_cache.k[0].shape[0]
    assert sum(per) <= num_blocks
    ids = torch.randperm(num_blocks, generator=g)[: sum(per)].to(torch.int32)
    tables = torch.zeros(n, max(per), dtype=torch.int32)
    at = 0
    for s, p in enumerate(per):
        tables[s, :p] = ids[at:at + p]
        at += p
    slots = torch.tensor([int(tables[s, (L - 1) // BS]) * BS + (L - 1) % BS for s, L in enumerate(lens)])
    meta = AttentionMetadata(slots, tables, torch.tensor(lens, dtype=torch.int32), torch.arange(n + 1, dtype=torch.int32), n)
    input_ids = torch.randint(0, eng.model.config.vocab_size, (n,), generator=g)
    return input_ids, torch.tensor(lens) - 1, meta


def run(eng, n, seed=0, lens=None):
    """(hidden states, every K/V page after the step, the route it took)."""
    ids, pos, meta = decode_step(eng, n, seed, lens)
    h = eng.executor.forward(ids, pos, meta)
    return h, [t.clone() for t in eng.kv_cache.k + eng.kv_cache.v], eng.executor.last_route


def pages(eng):
    return [t.clone() for t in eng.kv_cache.k + eng.kv_cache.v]


@needs_kernels
@pytest.mark.parametrize("head_dim,bias", [(16, False), (64, False), (16, True), (64, True)])
@pytest.mark.parametrize("n", [1, 3, 8, 9, 20])
def test_the_one_call_gives_the_layer_by_layer_bits(head_dim, bias, n):
    model = gguf_model(head_dim, bias)
    whole, layers, plain = engine(model, **ALL_ON), engine(model, **LAYERS), engine(model, fast_paths=False)
    assert whole.plan.routes["whole_step_decode"] == "c (cpu.kernels.decode_layers)"
    assert layers.plan.routes["whole_step_decode"].startswith("off") and layers.plan.refused["whole_step_decode"] == \
        "whole_step_decode=False"
    h1, c1, r1 = run(whole, n, seed=n)
    h2, c2, r2 = run(layers, n, seed=n)
    h3, c3, r3 = run(plain, n, seed=n)
    assert (r1, r2, r3) == ("whole_step", "layers", "model")
    assert torch.equal(h1, h2), f"hidden states differ by {(h1 - h2).abs().max():.3g}"
    for i, (a, b) in enumerate(zip(c1, c2)):
        assert torch.equal(a, b), f"{'kv'[i // model.config.num_layers]} pages of layer {i % model.config.num_layers} differ"
    torch.testing.assert_close(h1, h3, rtol=1e-4, atol=1e-4)  # the plain route: another order of the sums
    for a, b in zip(c1, c3):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@needs_kernels
def test_a_step_past_one_chunk_of_rows_gives_the_layer_by_layer_bits():
    """A long step (a prefill's tokens as decode rows) multiplies QROWS (256) rows at a time: 300
    rows cross a chunk boundary and still get the layer-by-layer bits."""
    model = gguf_model(64, False)
    whole, layers = engine(model, **ALL_ON, num_blocks=320), engine(model, **LAYERS, num_blocks=320)
    lens = [1 + i % BS for i in range(300)]  # one block each
    h1, c1, r1 = run(whole, 300, seed=3, lens=lens)
    h2, c2, r2 = run(layers, 300, seed=3, lens=lens)
    assert (r1, r2) == ("whole_step", "layers")
    assert torch.equal(h1, h2), f"hidden states differ by {(h1 - h2).abs().max():.3g}"
    assert all(torch.equal(a, b) for a, b in zip(c1, c2)), "the K/V pages differ"


@needs_kernels
def test_the_engine_decodes_the_same_tokens_every_way():
    """Through the engine (prefills, chunked prefills, then decode steps): the whole-step decode on
    every step whose tokens may all attend as decode rows (cpu.attention.tokens_as_decodes: here
    every step, the contexts being short), model.forward on the table where prefill_as_decodes is off, and
    the same greedy tokens as layer by layer and as the plain route."""
    from minipaged.sampling import SamplingParams

    model = gguf_model(seed=3)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 200, (n,), generator=g).tolist() for n in (1, 5, 9, 17, 30, 3)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    got = {}
    for name, settings in (("whole", ALL_ON), ("whole-nopad", {**ALL_ON, "prefill_as_decodes": False}),
                           ("layers", LAYERS), ("plain", {"fast_paths": False})):
        eng = engine(model, record_trace=True, max_num_batched_tokens=24, **settings)
        ids = [eng.add_request(p, params) for p in prompts]
        done = eng.run()
        got[name] = [done[i].token_ids for i in ids]
        routes = [s.route.split("+")[0] for s in eng.trace.steps]
        want = {"whole": {"whole_step"}, "whole-nopad": {"whole_step", "layers"}, "layers": {"layers"},
                "plain": {"model"}}[name]
        assert set(routes) == want, (name, routes)
        if name == "whole-nopad":  # every step of decodes only, and only those, ran in one call
            decode_only = [s.prefill_tokens == 0 and s.decode_tokens > 0 for s in eng.trace.steps]
            assert routes[-1] == "whole_step" and routes[0] == "layers", routes
            assert [r == "whole_step" for r in routes] == decode_only, list(zip(routes, decode_only))
    assert got["whole"] == got["whole-nopad"] == got["layers"] == got["plain"]


@needs_kernels
def test_it_stands_in_only_where_it_is_exact():
    model = gguf_model()
    whole = engine(model, **ALL_ON)

    # a step not all decodes whose tokens may attend as decode rows: still the one call, the same
    # bits as the layer route
    ids, pos, meta = decode_step(whole, 5)
    mixed = AttentionMetadata(meta.slot_mapping, meta.block_tables, meta.context_lens, meta.query_start_loc, 4)
    h = whole.executor.forward(ids, pos, mixed)
    assert whole.executor.last_route == "whole_step"
    layers = engine(model, **LAYERS)
    ids2, pos2, meta2 = decode_step(layers, 5)
    assert torch.equal(h, layers.executor.forward(ids2, pos2, meta2))
    # where prefill tokens attend through SDPA (prefill_as_decodes off), such a step takes model.forward on the table
    nopad = engine(model, **ALL_ON, prefill_as_decodes=False)
    ids3, pos3, meta3 = decode_step(nopad, 5)
    mixed3 = AttentionMetadata(meta3.slot_mapping, meta3.block_tables, meta3.context_lens, meta3.query_start_loc, 4)
    h3 = nopad.executor.forward(ids3, pos3, mixed3)
    assert nopad.executor.last_route == "layers"
    torch.testing.assert_close(h, h3, rtol=1e-4, atol=1e-4)  # SDPA: another order of the sums

    # a hook on any part: the plan leaves the model's own forward to run, and the hook sees its call
    hooked = []
    handle = model.layers[1].mlp.down_proj.register_forward_hook(lambda *a: hooked.append(1))
    try:
        with pytest.raises(ValueError, match="cannot be honoured: the model's own forward runs"):
            engine(model, **ALL_ON)
        hooked_eng = engine(model, c_kernels=True)
        assert "forward hook" in hooked_eng.plan.refused["ops_table"]
        run(hooked_eng, 5)
        assert hooked_eng.executor.last_route == "model" and hooked == [1]
    finally:
        handle.remove()

    # a norm weight changed in place: read from its tensor by both routes, so still the same bits
    h_a, _, _ = run(whole, 5, seed=1)
    with torch.no_grad():
        model.layers[1].post_attention_layernorm.weight.mul_(0.5)
    h1, c1, r1 = run(whole, 5, seed=1)
    h2, c2, r2 = run(engine(model, **LAYERS), 5, seed=1)
    assert (r1, r2) == ("whole_step", "layers")
    assert torch.equal(h1, h2) and all(torch.equal(a, b) for a, b in zip(c1, c2)) and not torch.equal(h1, h_a)


def _bad_cases(meta, n, num_slots):
    return {
        "slot": (AttentionMetadata(meta.slot_mapping.clone().index_fill_(0, torch.tensor([n - 1]), num_slots),
                                   meta.block_tables, meta.context_lens, meta.query_start_loc, n), IndexError, "slot"),
        "block": (AttentionMetadata(meta.slot_mapping, meta.block_tables.clone().index_fill_(0, torch.tensor([n - 1]), -1),
                                    meta.context_lens, meta.query_start_loc, n), IndexError, "block"),
        "context": (AttentionMetadata(meta.slot_mapping, meta.block_tables,
                                      meta.context_lens.clone().index_fill_(0, torch.tensor([n - 1]), 10_000),
                                      meta.query_start_loc, n), ValueError, "longer than its block table"),
        "empty context": (AttentionMetadata(meta.slot_mapping, meta.block_tables,
                                            meta.context_lens.clone().index_fill_(0, torch.tensor([2]), 0),
                                            meta.query_start_loc, n), ValueError, "empty"),
        "not decodes": (AttentionMetadata(meta.slot_mapping, meta.block_tables, meta.context_lens,
                                          torch.tensor([0, 1, 2, 3, 4, 4, 6], dtype=torch.int32), n),
                        ValueError, "exactly one new token"),
        "too few slots": (AttentionMetadata(meta.slot_mapping[:-1], meta.block_tables, meta.context_lens,
                                            meta.query_start_loc, n), ValueError, f"{n} tokens need {n} slots"),
    }


def decode_layers_by_hand(model, eng) -> kernels.DecodeLayers:
    """What the executor hands decode_layers, made from the model's blocks and the engine's pages."""
    c, blocks = model.config, model.source.cache["gguf_blocks"]
    layers = []
    for i, (layer, k, v) in enumerate(zip(model.layers, eng.kv_cache.k, eng.kv_cache.v)):
        a, mlp = layer.self_attn, layer.mlp
        layers.append({"input_norm": layer.input_layernorm.weight, "post_norm": layer.post_attention_layernorm.weight,
                       **{n: (blocks[f"model.layers.{i}.{part}.weight"], m.bias) for n, part, m in (
                           ("q", "self_attn.q_proj", a.q_proj), ("k", "self_attn.k_proj", a.k_proj),
                           ("v", "self_attn.v_proj", a.v_proj), ("o", "self_attn.o_proj", a.o_proj),
                           ("gate", "mlp.gate_proj", mlp.gate_proj), ("up", "mlp.up_proj", mlp.up_proj),
                           ("down", "mlp.down_proj", mlp.down_proj))},
                       "k_cache": k, "v_cache": v})
    return kernels.DecodeLayers(layers, c.rms_norm_eps, {"C": c.hidden_size, "H": c.num_heads, "H_kv": c.num_kv_heads,
                                                         "D": c.head_dim, "I": c.intermediate_size})


@needs_kernels
def test_bad_metadata_is_refused_with_nothing_written():
    model = gguf_model()
    eng = engine(model, **ALL_ON)
    n = 6
    ids, pos, meta = decode_step(eng, n)
    plan = decode_layers_by_hand(model, eng)
    cos, sin = model.rope_cos[pos], model.rope_sin[pos]
    before = pages(eng)
    for name, (bad, error, says) in _bad_cases(meta, n, NUM_BLOCKS * BS).items():
        x = torch.randn(n, 64)
        x0 = x.clone()
        with pytest.raises(error, match=says):
            kernels.decode_layers(plan, x, cos, sin, bad, 0.25)
        assert torch.equal(x, x0), f"{name}: the residual stream was written"
        assert all(torch.equal(a, b) for a, b in zip(pages(eng), before)), f"{name}: the cache was written"
        with pytest.raises(error, match=says):
            eng.executor.forward(ids, pos, bad)
        assert eng.executor.last_route == "whole_step"
        assert all(torch.equal(a, b) for a, b in zip(pages(eng), before)), f"{name}: the executor wrote the cache"
    with pytest.raises(ValueError, match="x must be contiguous fp32"):
        kernels.decode_layers(plan, torch.randn(n, 65), cos, sin, meta, 0.25)
    # the hand-made table is the executor's: the good step gives its bits
    x = model.embed_tokens(ids).contiguous()
    x = kernels.decode_layers(plan, x, cos, sin, meta, model.layers[0].self_attn.scale)
    got = kernels.rmsnorm(x, model.norm.weight, model.norm.eps)
    c_hand = pages(eng)
    assert not all(torch.equal(a, b) for a, b in zip(c_hand, before)), "the good step wrote nothing"
    for t, b in zip(eng.kv_cache.k + eng.kv_cache.v, before):
        t.copy_(b)
    assert torch.equal(got, eng.executor.forward(ids, pos, meta))
    assert all(torch.equal(a, b) for a, b in zip(pages(eng), c_hand))


PORTABLE = """
import json, sys, torch
sys.path.insert(0, {tests!r})
from minipaged.cpu import build, kernels
import test_whole_step_decode as t
from test_gguf_blocks import gguf_model
info = build.info()
out = {{"openmp": info.get("openmp"), "avx512": info.get("avx512"), "why_not": info["why_not"], "cases": []}}
for n, hd, bias in ((3, 16, True), (12, 16, True), (9, 64, False)):  # the row layout's loop, and the lane layout's
    model = gguf_model(hd, bias)
    whole = t.engine(model, **t.ALL_ON)
    h1, c1, r1 = t.run(whole, n, seed=n)
    h2, c2, r2 = t.run(t.engine(model, **t.LAYERS), n, seed=n)
    h3, c3, r3 = t.run(t.engine(model, fast_paths=False), n, seed=n)
    out["cases"].append({{"routes": [r1, r2, r3], "bits": torch.equal(h1, h2) and all(torch.equal(a, b) for a, b in zip(c1, c2)),
                         "close": all(torch.allclose(a, b, rtol=1e-4, atol=1e-4) for a, b in zip([h1, *c1], [h3, *c3]))}})
print(json.dumps(out))
"""


@pytest.mark.slow  # compiles the kernels afresh
def test_the_portable_build_gives_the_same_answers(tmp_path_factory):
    """Built without AVX-512 or OpenMP (a laptop, a Mac), the one call runs the portable loops:
    still the layer-by-layer route's bits, and the plain route's answer to fp32 rounding."""
    import shutil

    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        pytest.skip("no C compiler")
    tmp = tmp_path_factory.mktemp("portable")
    wrapper = tmp / "cc-portable"
    wrapper.write_text("#!/bin/sh\nfor a do\n  shift\n  case \"$a\" in -fopenmp|-march=native) ;; *) set -- \"$@\" \"$a\" ;; esac\n"
                       f"done\nexec {cc} \"$@\"\n")
    wrapper.chmod(0o755)
    env = {**os.environ, "CC": str(wrapper), "MINIPAGED_CACHE_DIR": str(tmp / "cache")}
    p = subprocess.run([sys.executable, "-c", PORTABLE.format(tests=os.path.dirname(__file__))], env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["why_not"] is None and out["openmp"] is False and out["avx512"] is False, out
    for case in out["cases"]:
        assert case["routes"] == ["whole_step", "layers", "model"] and case["bits"] and case["close"], out


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
        want = kernels.qmatmul(x, blocks).argmax(-1).tolist()
        assert kernels.qmatmul_argmax(x, blocks) == want
    w = blocks.dequantize()
    x = torch.zeros(12, 64)
    x[:6] = w[37] * 5  # rows whose best output is 37 (and its twin 700)
    x[6:] = w[998] * 5
    got = kernels.qmatmul_argmax(x, blocks)
    assert got == kernels.qmatmul(x, blocks).argmax(-1).tolist()
    assert 700 not in got and 999 not in got, "a tie went to the later position"
    assert kernels.qmatmul_argmax(torch.zeros(10, 64), blocks) == [0] * 10  # every output ties
    bad = torch.randn(10, 64, generator=g)
    bad[4, 3] = float("nan")
    assert kernels.qmatmul_argmax(bad, blocks) is None
    assert kernels.qmatmul_argmax(torch.randn(8, 64, generator=g), blocks) is None


@needs_slow
def test_without_avx512_greedy_from_head_is_refused_and_the_argmax_kernel_says_none():
    """The head's argmax kernel exists only in the AVX-512 build: greedy_from_head=True is refused
    with the reason, None leaves the sampler on the logits, and the kernel itself answers None."""
    model = gguf_model()
    with pytest.raises(ValueError, match="greedy_from_head=True cannot be honoured: .*AVX-512"):
        engine(model, **(ALL_ON | {"greedy_from_head": True}))
    eng = engine(model, **ALL_ON)
    assert eng.plan.routes["next_token"] == "sampler over the logits" and "AVX-512" in eng.plan.refused["greedy_from_head"]
    assert eng.executor.greedy_tokens(torch.randn(12, 64)) is None
    assert kernels.qmatmul_argmax(torch.randn(12, 64), model.source.cache["gguf_blocks"]["lm_head.weight"]) is None


@needs_fast
def test_greedy_steps_take_the_heads_argmax_and_others_the_logits():
    from minipaged.sampling import SamplingParams

    model = gguf_model(seed=5)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 200, (n,), generator=g).tolist() for n in (3, 5, 7, 9, 11, 4) * 2]
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    def generate(eng, params):
        ids = [eng.add_request(p, q) for p, q in zip(prompts, params)]
        done = eng.run()
        return [done[i].token_ids for i in ids], [s.route for s in eng.trace.steps]

    head = engine(model, record_trace=True, **(ALL_ON | {"greedy_from_head": True}))
    assert head.plan.routes["next_token"].startswith("head-argmax")
    got, routes = generate(head, [greedy] * 12)
    assert routes[-1] == "whole_step+head_argmax", routes
    assert all(r.endswith("+head_argmax") or r.endswith("+sampler") for r in routes)
    off = engine(model, record_trace=True, **(ALL_ON | {"greedy_from_head": False}))
    assert off.plan.refused["greedy_from_head"] == "greedy_from_head=False"
    want, routes_off = generate(off, [greedy] * 12)
    assert got == want and not any(r.endswith("head_argmax") for r in routes_off)
    # a sampled request in the step: the logits and the Sampler for every step it shares
    head2 = engine(model, record_trace=True, **(ALL_ON | {"greedy_from_head": True}))
    _, routes = generate(head2, [greedy] * 11 + [SamplingParams(max_tokens=8, temperature=0.7, seed=1, ignore_eos=True)])
    assert not any(r.endswith("head_argmax") for r in routes), routes
    # n > 1: the prompt's one row of logits feeds all its samples, then each greedy sample decodes like any other
    head3 = engine(model, **(ALL_ON | {"greedy_from_head": True}))
    req = head3.add_request(prompts[0], SamplingParams(max_tokens=8, temperature=0.0, n=12, ignore_eos=True))
    many = head3.run()[req]
    assert [o.token_ids for o in many.outputs] == [got[0]] * 12
    # up to 8 rows and a NaN row: the logits
    assert head.executor.greedy_tokens(torch.randn(8, 64)) is None
    bad = torch.randn(12, 64)
    bad[3, 0] = float("nan")
    assert head.executor.greedy_tokens(bad) is None
    h = torch.randn(12, 64)
    assert head.executor.greedy_tokens(h) == head.executor.compute_logits(h).argmax(-1).tolist()


@needs_kernels
def test_a_finished_engine_frees_its_cache():
    """The whole-step table holds the pages' addresses and the pages themselves, for exactly as long
    as its engine lives: nothing at module level keeps a finished engine's cache."""
    import gc
    import weakref

    model = gguf_model()
    eng = engine(model, **ALL_ON)
    run(eng, 5)
    assert eng.executor.last_route == "whole_step"
    page = weakref.ref(eng.kv_cache.k[0])
    del eng
    gc.collect()
    assert page() is None, "something outside the engine keeps its cache's pages alive"
