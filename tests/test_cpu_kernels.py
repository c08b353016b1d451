"""The CPU fast paths give PyTorch's answers: the C kernels (minipaged/cpu/csrc) and MKL-packed weights.

- each fused op against the PyTorch maths it replaces, at decode and prefill sizes;
- the kernels' own exp against float64;
- model.forward on the plan's table with every fast path off is the plain table's forward, bit for bit;
- an engine with every fast path its plan allows against the plain route (``fast_paths=False``);
- packed weights equal F.linear, serve only the batch they were made for, and are remade by
  ``rebuild_executor``; ``packed_gemm`` is validated, refused with its reason, and engines do not
  touch the model;
- no compiler, no OpenMP, or ``MINIPAGED_CPU_KERNELS=0``: the PyTorch routes, with the reason
  given in the plan, announced once, and in ``minipaged info``.
(Decode attention through the kernel is tested against the oracle in test_attention_fast.py;
the GGUF matmul in test_gguf_blocks.py; the whole-step decode in test_whole_step_decode.py.)
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from minipaged.attention import AttentionMetadata
from minipaged.cpu import build, kernels
from minipaged.plan import mkl_packing_available
from minipaged.model.config import LlamaConfig
from minipaged.model.llama import LlamaModel, apply_rope, rope_tables

needs_kernels = pytest.mark.skipif(build.library() is None, reason=f"no CPU kernels here: {build.info()['why_not']}")
needs_mkl = pytest.mark.skipif(not mkl_packing_available(), reason="this PyTorch has no MKL packed GEMM")
TESTS = os.path.dirname(__file__)


def torch_rmsnorm(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@needs_kernels
def test_exp_is_accurate_over_the_float_range():
    x = torch.linspace(-87.0, 88.0, 1_000_001)
    ref = torch.exp(x.double())
    rel = ((kernels.exp(x).double() - ref) / ref).abs().max().item()
    assert rel < 3e-7, f"the kernels' exp is off by {rel:.2e} relative"


@needs_kernels
@pytest.mark.parametrize("n", [1, 7, 64, 2048])
def test_rmsnorm_with_and_without_the_residual(n):
    g = torch.Generator().manual_seed(n)
    x, r, w = torch.randn(n, 576, generator=g), torch.randn(n, 576, generator=g), torch.randn(576, generator=g)
    torch.testing.assert_close(kernels.rmsnorm(x, w, 1e-5), torch_rmsnorm(x, w, 1e-5), rtol=2e-6, atol=2e-6)
    r0 = r.clone()
    out = kernels.rmsnorm(x, w, 1e-5, residual=r)
    torch.testing.assert_close(r, r0 + x, rtol=0, atol=0)  # the residual stream now holds the sum
    torch.testing.assert_close(out, torch_rmsnorm(r0 + x, w, 1e-5), rtol=2e-6, atol=2e-6)


@needs_kernels
@pytest.mark.parametrize("n", [1, 64, 2048])
def test_silu_mul(n):
    g = torch.Generator().manual_seed(n)
    gate, up = torch.randn(n, 1536, generator=g) * 4, torch.randn(n, 1536, generator=g)
    want = F.silu(gate) * up
    torch.testing.assert_close(kernels.silu_mul(gate.clone(), up), want, rtol=2e-6, atol=2e-6)


@needs_kernels
@pytest.mark.parametrize("n, heads", [(1, 9), (64, 9), (300, 3)])
def test_rope_in_place_also_on_a_view_into_wider_rows(n, heads):
    cos_t, sin_t = rope_tables(64, 4096, 100000.0)
    pos = torch.randint(0, 4096, (n,), generator=torch.Generator().manual_seed(n))
    cos, sin = cos_t[pos], sin_t[pos]
    wide = torch.randn(n, heads * 64 + 128)  # like q inside a fused qkv row
    x = wide[:, 64 : 64 + heads * 64].view(n, heads, 64)
    want = apply_rope(x.clone(), cos, sin)
    before = wide.clone()
    kernels.rope_(x, cos, sin)
    torch.testing.assert_close(x, want, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(wide[:, :64], before[:, :64], rtol=0, atol=0)  # nothing outside the view moved
    torch.testing.assert_close(wide[:, 64 + heads * 64 :], before[:, 64 + heads * 64 :], rtol=0, atol=0)


@needs_kernels
def test_bad_shapes_are_refused_with_a_reason():
    with pytest.raises(ValueError, match="RMSNorm weight"):
        kernels.rmsnorm(torch.randn(4, 8), torch.randn(7), 1e-5)
    with pytest.raises(ValueError, match="the residual must be"):
        kernels.rmsnorm(torch.randn(4, 8), torch.randn(8), 1e-5, residual=torch.randn(3, 8))
    with pytest.raises(ValueError, match="cos and sin"):
        kernels.rope_(torch.randn(4, 2, 8), torch.randn(3, 8), torch.randn(3, 8))
    with pytest.raises(ValueError, match="even head_dim"):
        kernels.rope_(torch.randn(4, 2, 7), torch.randn(4, 7), torch.randn(4, 7))
    with pytest.raises(ValueError, match="same shape"):
        kernels.silu_mul(torch.randn(4, 8), torch.randn(4, 9))
    q, kc = torch.randn(2, 4, 32), torch.randn(4, 16, 2, 32)
    with pytest.raises(ValueError, match="longer than its block table"):
        kernels.paged_decode(q, kc, kc, torch.zeros(2, 1, dtype=torch.int32), torch.tensor([17, 3]), 0.1)
    # a wrong max_context_len cannot make the kernel read past a table row: it checks each length itself
    with pytest.raises(ValueError, match="longer than its block table"):
        kernels.paged_decode(q, kc, kc, torch.zeros(2, 1, dtype=torch.int32), torch.tensor([3, 40]), 0.1, max_context_len=3)
    with pytest.raises(ValueError, match="2 queries but 1 block-table rows"):
        kernels.paged_decode(q, kc, kc, torch.zeros(1, 2, dtype=torch.int32), torch.tensor([3, 4]), 0.1)
    with pytest.raises(ValueError, match=r"q is \(S, 4, 32\) but the cache is"):
        kernels.paged_decode(q, torch.randn(4, 16, 3, 32), kc, torch.zeros(2, 1, dtype=torch.int32), torch.tensor([3, 4]), 0.1)
    with pytest.raises(IndexError, match="outside the cache"):
        kernels.paged_decode(q, kc, kc, torch.tensor([[0], [4]], dtype=torch.int32), torch.tensor([3, 4]), 0.1)


def _tiny(tie=True, bias=False) -> LlamaModel:
    cfg = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=160, num_layers=3, num_heads=4,
                      num_kv_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=tie,
                      attention_bias=bias)
    torch.manual_seed(0)
    model = LlamaModel(cfg)
    for p in model.parameters():
        p.data.normal_(0, 0.2)
    return model.eval()


def _engine(model, **settings):
    from minipaged.engine import LLMEngine

    settings = {"num_blocks": 64, "block_size": 4, "max_num_seqs": 4, "record_trace": False, **settings}
    return LLMEngine(model, None, **settings)


def _tokens(eng, prompts, max_tokens=12):
    from minipaged.sampling import SamplingParams

    ids = [eng.add_request(p, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)) for p in prompts]
    done = eng.run()
    return [done[i].token_ids for i in ids]


PROMPTS = [[5, 9, 200, 17, 3], [1, 2], [250, 251, 252, 253, 254, 255, 256, 1, 2], [7] * 13]


def _prefill_then_decode(eng, n=20, seed=0):
    """Two steps through ``eng.executor`` by hand: a prefill of n tokens, then one decode.
    Returns (hidden of the prefill, hidden of the decode, the engine's KV pages)."""
    ids = torch.randint(0, eng.model.config.vocab_size, (n + 1,), generator=torch.Generator().manual_seed(seed))
    blocks = -(-(n + 1) // eng.block_size)
    table = torch.arange(blocks, dtype=torch.int32)[None]
    pre = AttentionMetadata(torch.arange(n), table, torch.tensor([n], dtype=torch.int32),
                            torch.tensor([0, n], dtype=torch.int32), 0)
    h1 = eng.executor.forward(ids[:n], torch.arange(n), pre)
    dec = AttentionMetadata(torch.tensor([n]), table, torch.tensor([n + 1], dtype=torch.int32),
                            torch.tensor([0, 1], dtype=torch.int32), 1)
    h2 = eng.executor.forward(ids[n:], torch.tensor([n]), dec)
    return h1, h2, [t.clone() for t in eng.kv_cache.k + eng.kv_cache.v]


@pytest.mark.parametrize("bias", [False, True])
def test_the_layer_walk_with_every_fast_path_off_is_the_model_bit_for_bit(bias):
    """fast_paths=True with the C kernels and packing off: model.forward on the plan's table
    (route "layers"), whose ops are PyTorch's: the same bits as the plain table."""
    model = _tiny(bias=bias)
    walk = _engine(model, c_kernels=False, packed_gemm=False)
    assert walk.plan.routes["linear"] == "torch (F.linear)" and walk.plan.routes["elementwise"] == "torch"
    plain = _engine(model, fast_paths=False)
    got, want = _prefill_then_decode(walk), _prefill_then_decode(plain)
    assert walk.executor.last_route == "layers" and plain.executor.last_route == "model"
    for a, b in zip(got[:2], want[:2]):
        assert torch.equal(a, b), f"hidden states differ by {(a - b).abs().max():.3g}"
    assert all(torch.equal(a, b) for a, b in zip(got[2], want[2])), "the K/V pages differ"
    h = got[0][-3:]
    assert torch.equal(walk.executor.compute_logits(h), plain.executor.compute_logits(h))


@needs_kernels
@pytest.mark.parametrize("bias", [False, True])
def test_an_engine_with_every_fast_path_matches_the_plain_route(bias):
    """Hidden states to fp32 rounding, and the same greedy tokens through the engine (the C
    kernels, C attention, packing at batch 4), against fast_paths=False."""
    model = _tiny(bias=bias)
    fast = _engine(model, c_kernels=True, packed_gemm=True if mkl_packing_available() else None)
    r = fast.plan.routes
    assert r["decode_attention"] == "c (cpu.kernels.paged_decode)" and r["kv_write"] == "c (cpu.kernels.write_kv)"
    assert r["elementwise"].startswith("c (") and fast.backend.name == "cpu"
    if mkl_packing_available():
        assert r["linear"] == "mkl-packed at 4 rows, torch otherwise"
    plain = _engine(model, fast_paths=False)
    assert plain.backend.name == "torch" and set(plain.plan.refused) == {"fast_paths"}
    got, want = _prefill_then_decode(fast), _prefill_then_decode(plain)
    assert fast.executor.last_route == "layers"
    for a, b in zip([got[0], got[1], *got[2]], [want[0], want[1], *want[2]]):  # hidden states, then K/V pages
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    fast2 = _engine(model, c_kernels=True, record_trace=True)
    assert _tokens(fast2, PROMPTS) == _tokens(_engine(model, fast_paths=False), PROMPTS)
    routes = {s.route for s in fast2.trace.steps}
    assert "layers+sampler" in routes and routes <= {"layers+sampler", "layers+none"}, routes


@needs_mkl
def test_packed_weights_equal_linear_serve_only_their_batch_and_are_remade_on_rebuild():
    model = _tiny()
    packed = _engine(model, c_kernels=False, packed_gemm=True, max_num_seqs=8)
    assert packed.plan.routes["linear"] == "mkl-packed at 8 rows, torch otherwise"
    plain = _engine(model, fast_paths=False, max_num_seqs=8)
    h = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(packed.executor.compute_logits(h), F.linear(h, model.lm_head.weight), rtol=1e-6, atol=1e-6)
    h5 = h[:5]  # not the packed batch size: F.linear itself, bit for bit
    assert torch.equal(packed.executor.compute_logits(h5), F.linear(h5, model.lm_head.weight))
    got, want = _prefill_then_decode(packed, n=8), _prefill_then_decode(plain, n=8)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)  # 8 rows: the packs
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)  # 1 row: F.linear, over the packs' K/V
    before = packed.executor.compute_logits(h)
    with torch.no_grad():
        model.lm_head.weight.mul_(-2.0)  # (tied: the embedding too)
    packed.rebuild_executor()  # changing weights is an explicit rebuild: the packs are remade
    after = packed.executor.compute_logits(h)
    torch.testing.assert_close(after, F.linear(h, model.lm_head.weight), rtol=1e-6, atol=1e-6)
    assert not torch.allclose(after, before)


@needs_mkl
def test_the_packed_gemm_setting_and_engines_leave_the_model_alone():
    model = _tiny()

    def attributes(m):
        return {name: sorted(vars(mod)) for name, mod in m.named_modules()}, {k: v.clone() for k, v in m.state_dict().items()}

    attrs, weights = attributes(model)
    auto = _engine(model, num_blocks=16, max_num_seqs=8)
    assert auto.plan.routes["linear"] == "mkl-packed at 8 rows, torch otherwise", auto.plan  # auto: on for CPU fp32
    off = _engine(model, num_blocks=16, max_num_seqs=8, packed_gemm=False)
    assert off.plan.routes["linear"] == "torch (F.linear)" and off.plan.refused["packed_gemm"] == "packed_gemm=False"
    small = _engine(model, num_blocks=16, max_num_seqs=2)
    assert "1-3 rows" in small.plan.refused["packed_gemm"]
    assert _engine(model, num_blocks=16, max_num_seqs=2, packed_gemm=True).plan.routes["linear"].startswith("mkl-packed at 2")
    after = attributes(model)
    assert after[0] == attrs, "an engine added or removed an attribute of the model"
    assert all(torch.equal(after[1][k], weights[k]) for k in weights)
    with pytest.raises(ValueError, match="packed_gemm must be True, False or None"):
        _engine(model, num_blocks=16, packed_gemm="yes")
    with pytest.raises(ValueError, match="packed_gemm=True needs fast_paths=True"):
        _engine(model, num_blocks=16, packed_gemm=True, fast_paths=False)
    half = _tiny().to(torch.bfloat16)
    with pytest.raises(ValueError, match="packed_gemm=True cannot be honoured: packing is for fp32 weights on a CPU"):
        _engine(half, num_blocks=16, packed_gemm=True)
    eng = _engine(half, num_blocks=16)  # auto: quietly off, saying why
    assert eng.plan.routes["linear"] == "torch (F.linear)" and "fp32" in eng.plan.refused["packed_gemm"]
    assert "c_kernels" in eng.plan.refused and eng.backend.name == "torch"


PROBE = """
import json, sys, torch
sys.path.insert(0, {tests!r})
from minipaged.cpu import build
build.show_notices()  # the build line on stderr, as the minipaged command shows it
from minipaged.engine import LLMEngine
from test_cpu_kernels import _tiny, _tokens, PROMPTS
torch.set_num_threads(2)
def engine(**kw):
    return LLMEngine(_tiny(), None, num_blocks=64, block_size=4, max_num_seqs=4, record_trace=False, **kw)
out = {{"why_not": build.info()["why_not"], "openmp": build.info().get("openmp"), "avx512": build.info().get("avx512")}}
e = engine()
out["default"] = {{"routes": dict(e.plan.routes), "refused": dict(e.plan.refused), "backend": e.backend.name}}
out["default_tokens"] = _tokens(e, PROMPTS, 6)
try:
    e = engine(c_kernels=True)
    out["required"] = {{"routes": dict(e.plan.routes), "refused": dict(e.plan.refused), "backend": e.backend.name}}
    out["required_tokens"] = _tokens(e, PROMPTS, 6)
except ValueError as err:
    out["required"] = "ValueError: " + str(err)
try:
    engine(attention="cpu")
    out["cpu_attention"] = "built"
except ValueError as err:
    out["cpu_attention"] = "ValueError: " + str(err)
out["plain_tokens"] = _tokens(engine(fast_paths=False), PROMPTS, 6)
print(json.dumps(out))
"""


def _probe(env_extra: dict, tmp_path) -> tuple[dict, str]:
    env = {**os.environ, "MINIPAGED_CACHE_DIR": str(tmp_path / "cache"), **env_extra}
    p = subprocess.run([sys.executable, "-c", PROBE.format(tests=TESTS)], env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1]), p.stderr


def test_switched_off_by_the_environment_the_pytorch_routes_run(tmp_path):
    """MINIPAGED_CPU_KERNELS=0 only sets the default: the plan says so, and c_kernels=True still
    asks for them. The tokens are the plain route's either way."""
    out, _ = _probe({"MINIPAGED_CPU_KERNELS": "0"}, tmp_path)
    assert out["default"]["refused"]["c_kernels"] == "c_kernels=False"
    assert out["default"]["backend"] == "torch" and out["default"]["routes"]["elementwise"] == "torch"
    assert out["default_tokens"] == out["plain_tokens"]
    if out["why_not"] is None and out["openmp"]:
        assert out["required"]["backend"] == "cpu" and out["required_tokens"] == out["plain_tokens"]
        assert out["cpu_attention"].startswith("ValueError: attention='cpu' needs the C kernels")


def test_without_a_compiler_the_pytorch_routes_run_and_the_plan_says_why(tmp_path):
    out, err = _probe({"CC": str(tmp_path / "no-such-compiler")}, tmp_path)
    assert out["why_not"].startswith("the C compiler failed"), out
    assert out["default"]["refused"]["c_kernels"].startswith("they could not be built: the C compiler failed")
    assert out["default"]["backend"] == "torch" and out["default_tokens"] == out["plain_tokens"]
    assert out["required"].startswith("ValueError: c_kernels=True cannot be honoured: they could not be built")
    assert out["cpu_attention"].startswith("ValueError: attention='cpu' needs the C kernels")
    announced = [line for line in err.splitlines() if line.startswith("minipaged: CPU kernels")]
    assert len(announced) == 1 and "not built" in announced[0] and "stays on PyTorch" in announced[0], err[-2000:]


@pytest.mark.slow  # compiles the kernels afresh
def test_a_build_without_openmp_does_not_replace_threaded_pytorch_unless_asked(tmp_path):
    """Built without OpenMP (Apple clang) the kernels run on one core: with PyTorch on 2 threads
    the plan refuses them by default, saying so; c_kernels=True runs them, with the plain
    route's tokens. The portable build (no -march=native: no AVX-512) serves the same answers."""
    import shutil

    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        pytest.skip("no C compiler")
    wrapper = tmp_path / "cc-no-openmp"
    wrapper.write_text("#!/bin/sh\nfor a do\n  shift\n  case \"$a\" in -fopenmp|-march=native) ;; *) set -- \"$@\" \"$a\" ;; esac\n"
                       f"done\nexec {cc} \"$@\"\n")
    wrapper.chmod(0o755)
    out, err = _probe({"CC": str(wrapper)}, tmp_path)
    assert out["why_not"] is None and out["openmp"] is False and out["avx512"] is False, out
    refused = out["default"]["refused"]["c_kernels"]
    assert "without OpenMP" in refused and "one core" in refused and "2 threads" in refused, refused
    assert out["default"]["backend"] == "torch" and out["default_tokens"] == out["plain_tokens"]
    assert out["required"]["backend"] == "cpu" and out["required"]["routes"]["elementwise"].startswith("c (")
    assert out["required_tokens"] == out["plain_tokens"]
    announced = [line for line in err.splitlines() if line.startswith("minipaged: CPU kernels")]
    assert len(announced) == 1 and "OpenMP OFF: one core" in announced[0], err[-2000:]


@needs_mkl
def test_auto_packing_stays_off_under_an_address_space_limit(tmp_path):
    """A grader's sandbox sets RLIMIT_AS; MKL's packs reserve about 4x the weights' bytes of it."""
    code = ("import resource, sys, torch\n"
            "resource.setrlimit(resource.RLIMIT_AS, (8 * 2**30, resource.getrlimit(resource.RLIMIT_AS)[1]))\n"
            f"sys.path.insert(0, {TESTS!r})\n"
            "from minipaged.engine import LLMEngine\n"
            "from test_cpu_kernels import _tiny\n"
            "m = _tiny()\n"
            "e = LLMEngine(m, None, num_blocks=16, max_num_seqs=8, record_trace=False)\n"
            "assert e.plan.routes['linear'] == 'torch (F.linear)', e.plan\n"
            "assert 'address-space limit' in e.plan.refused['packed_gemm'], e.plan\n"
            "e = LLMEngine(m, None, num_blocks=16, max_num_seqs=8, record_trace=False, packed_gemm=True)\n"
            "assert e.plan.routes['linear'].startswith('mkl-packed at 8'), e.plan\n"
            "print('OK')")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "OK", p.stderr[-2000:]


def test_minipaged_info_says_what_was_built_or_why_not(tmp_path):
    env = {**os.environ, "MINIPAGED_CACHE_DIR": str(tmp_path / "cache"), "CC": str(tmp_path / "no-such-compiler")}
    p = subprocess.run([sys.executable, "-m", "minipaged", "info"], capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0, p.stderr
    assert "CPU kernels (minipaged/cpu): not built, every route stays on PyTorch: the C compiler failed" in p.stdout
    if build.library() is None:
        return
    p = subprocess.run([sys.executable, "-m", "minipaged", "info"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    i = build.info()
    assert f"CPU kernels (minipaged/cpu): {i['compiler']} {i['flags']}; OpenMP {'on' if i['openmp'] else 'OFF'}" in p.stdout
    assert ("GGUF matmul AVX-512" if i["avx512"] else "GGUF matmul portable loop only") in p.stdout
    assert "print(LLM().engine.plan)" in p.stdout


@needs_kernels
def test_write_kv_in_c_equals_index_copy_and_writes_nothing_on_a_bad_slot():
    from minipaged.cpu.attention import CPUAttention

    g = torch.Generator().manual_seed(3)
    wide = torch.randn(6, 3 * 16 + 8, generator=g)  # k as a view into wider rows
    k = wide[:, 8:].view(6, 3, 16)
    v = torch.randn(6, 3, 16, generator=g)
    slots = torch.tensor([0, 5, 17, 18, 31, 2])
    want = [torch.zeros(4, 8, 3, 16), torch.zeros(4, 8, 3, 16)]
    want[0].view(32, 3, 16).index_copy_(0, slots, k)
    want[1].view(32, 3, 16).index_copy_(0, slots, v)
    for write in (kernels.write_kv, CPUAttention().backend().write_kv):
        got = [torch.zeros(4, 8, 3, 16), torch.zeros(4, 8, 3, 16)]
        write(*got, k, v, slots)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    before = [t.clone() for t in got]
    for bad in ([1, 2, 3, 4, 5, 32], [1, 2, -1, 4, 5, 6]):
        with pytest.raises(IndexError, match="outside the cache"):
            kernels.write_kv(*got, k, v, torch.tensor(bad))
        assert torch.equal(got[0], before[0]) and torch.equal(got[1], before[1])  # nothing written
    with pytest.raises(ValueError, match="one slot each"):
        kernels.write_kv(*got, k, v, slots[:5])
    # a K/V whose heads are not contiguous within a row: the backend takes PyTorch's index_copy_
    kt = torch.randn(6, 16, 3, generator=g).transpose(1, 2)
    got = [torch.zeros(4, 8, 3, 16), torch.zeros(4, 8, 3, 16)]
    CPUAttention.write_kv(*got, kt, v, slots)
    assert torch.equal(got[0].view(32, 3, 16)[slots], kt)
