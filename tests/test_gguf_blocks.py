"""Linear layers multiply straight from a GGUF file's blocks (cpu/gguf_blocks.py, cpu.kernels.qmatmul).

- the kernel rebuilds every weight bit for bit as gguf.quants dequantizes it, for Q4_0, Q4_1
  and Q8_0 (fp16 scales of every sign and size, subnormal ones too), and its products are an
  fp32 matmul's, at every row count the kernel splits differently (1..20) and on strided rows;
- the default model's file blocks are its fp32 weights exactly, Q and K rows un-permuted too;
- the executor serves a linear layer from its blocks only while they hold its very weights:
  blocks of another shape, or weights changed after loading, are refused with the reason
  (``rebuild_executor`` after a change refuses too), and the bias is added;
- ``EngineConfig.gguf_blocks``: validated, off when asked, refused with a reason where it cannot
  be on (no GGUF file; no AVX-512 unless True); greedy output is the same with and without;
- the portable build (no AVX-512, no OpenMP) gives the same products.

Helpers used by test_whole_step_decode.py: ``random_rows``, ``small_rows``, ``gguf_model``,
``portable_build``, ``assert_fp32_close``.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from minipaged.cpu import build, kernels
from minipaged.cpu.gguf_blocks import KINDS, GGUFBlocks, read_blocks
from minipaged.model.config import LlamaConfig
from minipaged.model.llama import LlamaModel, ModelSource

needs_kernels = pytest.mark.skipif(build.library() is None, reason=f"no CPU kernels here: {build.info()['why_not']}")
needs_fast = pytest.mark.skipif(not kernels.qmatmul_fast(), reason="the fast GGUF matmul needs AVX-512")
needs_slow = pytest.mark.skipif(build.library() is None or kernels.qmatmul_fast(),
                                reason="for a build of the kernels without AVX-512 (the portable loop only)")
BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}


def random_rows(kind: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """n rows of k weights in the file's own byte layout, with fp16 scales of all kinds."""
    rng = np.random.default_rng(seed)
    nb = k // 32
    rows = rng.integers(0, 256, size=(n, nb, BYTES[kind]), dtype=np.uint8)
    scales = rng.choice(np.array([1e-3, -2e-2, 0.5, -7.0, 6e-6, -3e-7, 0.0], dtype=np.float16), size=(n, nb, 2))
    scales = scales * rng.uniform(0.5, 1.5, size=scales.shape).astype(np.float16)  # subnormals (6e-6, 3e-7) kept
    rows[..., 0:2] = scales[..., 0:1].view(np.uint8)
    if kind == "Q4_1":
        rows[..., 2:4] = scales[..., 1:2].view(np.uint8)
    return rows.reshape(n, nb * BYTES[kind])


def small_rows(kind: str, n: int, k: int, seed: int) -> np.ndarray:
    """random_rows with small fp16 scales, so that activations stay tame through the layers."""
    rows = random_rows(kind, n, k, seed=seed).reshape(n, k // 32, -1)
    rng = np.random.default_rng(seed + 1000)
    d = rng.choice(np.array([1e-3, -2e-3, 4e-3, -3e-3, 0.0], dtype=np.float16), size=(n, k // 32, 2))
    rows[..., 0:2] = d[..., 0:1].view(np.uint8)
    if kind == "Q4_1":
        rows[..., 2:4] = (d[..., 1:2] * np.float16(-4)).view(np.uint8)
    return rows.reshape(n, -1)


def hf_names(model: LlamaModel) -> dict[str, nn.Linear]:
    """Hugging Face name -> linear layer, as the executor looks the file's blocks up."""
    names = {"lm_head.weight": model.lm_head}
    names.update({f"model.{n}.weight": m for n, m in model.named_modules() if isinstance(m, nn.Linear) and m is not model.lm_head})
    return names


def gguf_model(head_dim: int = 16, bias: bool = False, kinds=("Q4_1", "Q8_0", "Q4_0"), seed: int = 0,
               head: bool = True, vocab: int = 200, layers: int = 2) -> LlamaModel:
    """A small Llama "loaded from a GGUF file" held in memory: every linear layer (the LM head too,
    unless ``head=False``) has blocks in ``model.source``, and its fp32 weight is their dequantized
    value, as load_model makes it."""
    heads = 4 if head_dim == 16 else 2
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_layers=layers, num_heads=heads,
                      num_kv_heads=heads // 2, head_dim=head_dim, max_position_embeddings=128, attention_bias=bias,
                      tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaModel(cfg)
    for p in model.parameters():
        p.data.normal_(0, 0.3)
    blocks = {}
    for i, (name, m) in enumerate(hf_names(model).items()):
        if name == "lm_head.weight" and not head:
            continue
        kind = kinds[i % len(kinds)]
        b = GGUFBlocks.from_file_rows(kind, small_rows(kind, *m.weight.shape, seed=seed * 100 + i))
        m.weight.data.copy_(b.dequantize())
        blocks[name] = b
    model.source = ModelSource(path="(memory)", format="gguf", cache={"gguf_blocks": blocks})
    return model.eval()


# every fast path on, as required (refused with a ValueError where it cannot be): the portable
# GGUF loop serves where there is no AVX-512
ALL_ON = dict(c_kernels=True, gguf_blocks=True, whole_step_decode=True,
              greedy_from_head=True if kernels.qmatmul_fast() else None)  # its argmax kernel is AVX-512 only


def assert_fp32_close(got, x, w, bias=None):
    """got = x @ w.T (+ bias) to fp32 rounding: within K roundings of sum |x| |w| (cancellation-proof)."""
    want = x.double() @ w.double().T + (0 if bias is None else bias.double())
    bound = x.shape[1] * 2**-24 * (x.abs().double() @ w.abs().double().T + (0 if bias is None else bias.abs().double()))
    assert ((got.double() - want).abs() <= bound + 1e-30).all(), f"off by {(got.double() - want).abs().max():.3g}"


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_dequantize_is_gguf_quants_bit_for_bit(kind):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    raw = random_rows(kind, 40, 96, seed=1)
    want = torch.from_numpy(np.asarray(dequantize(raw, GGMLQuantizationType[kind]), dtype=np.float32))
    blocks = GGUFBlocks.from_file_rows(kind, raw)
    got = blocks.dequantize()
    assert got.shape == (40, 96) and torch.equal(got, want)
    assert torch.equal(blocks.dequantize_rows(), want), "the row layout does not hold the same weights"


@needs_kernels
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_the_kernel_rebuilds_each_weight_exactly(kind):
    blocks = GGUFBlocks.from_file_rows(kind, random_rows(kind, 37, 128, seed=2))
    w = blocks.dequantize()
    for rows in (1, 5, 6, 7, 16, 128):  # one-hot rows pick the weights out one by one, exactly
        eye = torch.eye(128)[:rows].contiguous()
        got = kernels.qmatmul(eye, blocks)
        assert torch.equal(got, w[:, :rows].T.contiguous()), f"{kind}: rebuilt weights differ at {rows} rows"


@needs_kernels
@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("m", [1, 2, 3, 4, 6, 7, 8, 13, 20, 64])
def test_the_kernel_is_an_fp32_matmul(kind, m):
    k = 320  # more than one 256-long stretch of the kernel's panel, and not a multiple of it
    blocks = GGUFBlocks.from_file_rows(kind, random_rows(kind, 70, k, seed=m))  # 70 outputs: a part-filled last group
    w = blocks.dequantize()
    g = torch.Generator().manual_seed(m)
    wide = torch.randn(m, k + 40, generator=g)
    x = wide[:, 17:17 + k]  # strided rows: a view into wider ones
    assert_fp32_close(kernels.qmatmul(x, blocks), x, w)


@needs_kernels
def test_no_rows_give_no_rows():
    blocks = GGUFBlocks.from_file_rows("Q8_0", random_rows("Q8_0", 5, 64))
    assert kernels.qmatmul(torch.zeros(0, 64), blocks).shape == (0, 5)


@needs_kernels
@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_a_long_batch_goes_in_row_chunks_and_each_row_gets_the_same_bits(kind):
    """A prefill's batch runs 256 rows at a time (QROWS in csrc/gguf_matmul.c): rows on either
    side of a chunk boundary, and the part-filled last chunk, get exactly the bits they get in a
    small batch of their own, and every row is an fp32 matmul's."""
    k = 320
    blocks = GGUFBlocks.from_file_rows(kind, random_rows(kind, 40, k, seed=5))
    g = torch.Generator().manual_seed(5)
    wide = torch.randn(2 * 1024 + 21, k + 8, generator=g)
    x = wide[:, 3:3 + k]  # strided rows
    got = kernels.qmatmul(x, blocks)
    assert_fp32_close(got, x, blocks.dequantize())
    for start in (0, 248, 252, 256, 1016, 1020, 1024, 2040, 2048, 2048 + 21 - 13):
        part = kernels.qmatmul(x[start:start + 13], blocks)
        assert torch.equal(got[start:start + 13], part), f"rows {start}..{start + 12} differ from a batch of their own"


@needs_kernels
def test_bad_blocks_and_inputs_are_refused_with_a_reason():
    from minipaged.engine import LLMEngine

    raw = random_rows("Q4_1", 4, 64)
    with pytest.raises(ValueError, match="Q2_K blocks are not supported"):
        GGUFBlocks.from_file_rows("Q2_K", raw)
    with pytest.raises(ValueError, match=r"Q4_1 rows must be uint8 \(N, K/32 \* 20\)"):
        GGUFBlocks.from_file_rows("Q4_1", raw[:, :30])
    blocks = GGUFBlocks.from_file_rows("Q4_1", raw)
    with pytest.raises(ValueError, match=r"x must be fp32 \(M, 64\) on the CPU"):
        kernels.qmatmul(torch.randn(2, 65), blocks)
    with pytest.raises(ValueError, match=r"x must be fp32"):
        kernels.qmatmul(torch.randn(2, 64, dtype=torch.float64), blocks)
    with pytest.raises(ValueError, match=r"Q4_1 qt must be a contiguous"):
        GGUFBlocks("Q4_1", blocks.qt[:, :-1], blocks.dt, blocks.mt, 4, 64, blocks.rq, blocks.rd, blocks.rm)
    with pytest.raises(ValueError, match="Q8_0 has no mt"):
        q8 = GGUFBlocks.from_file_rows("Q8_0", random_rows("Q8_0", 4, 64))
        GGUFBlocks("Q8_0", q8.qt, q8.dt, blocks.mt, 4, 64, q8.rq, q8.rd, None)
    # blocks of another shape than the layer they are named for: the plan refuses them
    model = gguf_model()
    wrong = model.source.cache["gguf_blocks"]
    wrong["model.layers.1.mlp.up_proj.weight"] = GGUFBlocks.from_file_rows("Q8_0", random_rows("Q8_0", 5, 64))
    with pytest.raises(ValueError, match="gguf_blocks=True cannot be honoured: a linear layer's shape differs"):
        LLMEngine(model, None, num_blocks=16, block_size=4, gguf_blocks=True)


def _engine(model, **settings):
    from minipaged.engine import LLMEngine

    return LLMEngine(model, None, num_blocks=48, block_size=4, max_num_seqs=8, record_trace=False, **settings)


@needs_kernels
def test_the_executor_serves_each_linear_from_its_blocks_and_adds_the_bias():
    """With gguf_blocks=True every linear layer multiplies from its blocks: the head's logits are an
    fp32 matmul of the very weights, the hidden states the plain route's to fp32 rounding, and
    q/k/v biases are added (a model with biases gives the plain route's answer too)."""
    from minipaged.attention import AttentionMetadata

    for bias in (False, True):
        model = gguf_model(bias=bias)
        if bias:
            for m in (model.layers[0].self_attn.q_proj, model.layers[1].self_attn.v_proj):
                m.bias.data.uniform_(-1, 1)
        eng = _engine(model, **ALL_ON)
        assert eng.plan.routes["linear"] == "gguf Q4_0/Q4_1/Q8_0 blocks (c)", eng.plan
        plain = _engine(model, fast_paths=False)
        assert plain.plan.routes["linear"] == "torch (F.linear)"
        h = torch.randn(11, 64, generator=torch.Generator().manual_seed(1))
        assert_fp32_close(eng.executor.compute_logits(h), h, model.lm_head.weight)
        # a prefill of 20 tokens over 5 blocks, through both engines' executors
        ids, pos = torch.randint(0, 200, (20,), generator=torch.Generator().manual_seed(2)), torch.arange(20)
        meta = AttentionMetadata(torch.arange(20), torch.arange(5, dtype=torch.int32)[None],
                                 torch.tensor([20], dtype=torch.int32), torch.tensor([0, 20], dtype=torch.int32), 0)
        got, want = eng.executor.forward(ids, pos, meta), plain.executor.forward(ids, pos, meta)
        # a short prefill's tokens attend as decode rows (cpu.attention.tokens_as_decodes): the one call
        assert eng.executor.last_route == "whole_step" and plain.executor.last_route == "model"
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)  # the plain route adds the biases
        walk = _engine(model, **{**ALL_ON, "prefill_as_decodes": False})  # the same prefill, layer by layer
        got_walk = walk.executor.forward(ids, pos, meta)
        assert walk.executor.last_route == "layers"
        torch.testing.assert_close(got_walk, want, rtol=1e-4, atol=1e-4)


@needs_kernels
def test_weights_changed_after_loading_are_never_served_from_the_blocks():
    """The executor spot-checks every layer's weight against its blocks when the plan is made: a
    weight that is not the blocks' (changed after loading, or never theirs) refuses the GGUF matmul,
    required or not, and ``rebuild_executor`` after a change does the same."""
    model = gguf_model()
    eng = _engine(model, **ALL_ON)
    assert eng.plan.routes["linear"].startswith("gguf")
    with torch.no_grad():
        model.layers[0].self_attn.o_proj.weight[3] += 0.5  # one output's weights, changed in place
    with pytest.raises(ValueError, match="gguf_blocks=True cannot be honoured: the weights were changed after loading"):
        _engine(model, c_kernels=True, gguf_blocks=True)
    with pytest.raises(ValueError, match="the weights were changed after loading"):
        eng.rebuild_executor()
    auto = _engine(model, c_kernels=True)  # None: quietly the fp32 weights
    assert auto.plan.routes["linear"] != "gguf Q4_0/Q4_1/Q8_0 blocks (c)"
    assert "gguf_blocks" in auto.plan.refused
    if kernels.qmatmul_fast():  # where None would have used them, the reason is the change itself
        assert "changed after loading" in auto.plan.refused["gguf_blocks"]
    # fp32 weights that were never the blocks' values (a synthetic model done wrong)
    other = gguf_model()
    with torch.no_grad():
        other.lm_head.weight.mul_(1.5)
    with pytest.raises(ValueError, match="the weights were changed after loading"):
        _engine(other, c_kernels=True, gguf_blocks=True)


@needs_kernels
def test_a_weight_changed_in_any_column_is_never_served_from_the_blocks():
    model = gguf_model()
    with torch.no_grad():
        model.layers[0].self_attn.o_proj.weight[3, 40] += 0.5  # one weight, anywhere
    with pytest.raises(ValueError, match="the weights were changed after loading"):
        _engine(model, c_kernels=True, gguf_blocks=True)


@pytest.mark.slow
def test_the_default_models_blocks_are_its_fp32_weights_exactly(smollm2):
    model, _ = smollm2
    assert model.source is not None and model.source.format == "gguf"
    blocks = read_blocks(model.source.path, model.config)
    names = hf_names(model)
    assert set(blocks) == set(names), set(names) ^ set(blocks)  # every linear layer, the (tied) head too
    assert len(blocks) == 7 * model.config.num_layers + 1
    assert sorted({b.kind for b in blocks.values()}) == ["Q4_1", "Q8_0"]
    for name, b in blocks.items():
        w = names[name].weight
        assert torch.equal(b.dequantize(), w), f"{name}: the file's blocks are not its weight"
        assert torch.equal(b.dequantize_rows(), w), f"{name}: its row layout is not its weight"


@needs_kernels
def test_engine_setting_on_off_and_refused():
    from minipaged.engine import LLMEngine
    from minipaged.sampling import SamplingParams

    model = gguf_model()
    with pytest.raises(ValueError, match="gguf_blocks must be True, False or None"):
        LLMEngine(model, None, num_blocks=16, gguf_blocks=1)
    with pytest.raises(ValueError, match="gguf_blocks=True needs fast_paths=True"):
        LLMEngine(model, None, num_blocks=16, gguf_blocks=True, fast_paths=False)
    prompts = [[5, 9, 100, 17, 3], [1, 2], [7] * 13, list(range(40, 70))]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    def tokens(**settings):
        eng = _engine(model, **settings)
        ids = [eng.add_request(p, params) for p in prompts]
        done = eng.run()
        return eng, [done[i].token_ids for i in ids]

    off, want = tokens(c_kernels=True, gguf_blocks=False)
    assert off.plan.refused["gguf_blocks"] == "gguf_blocks=False" and off.plan.routes["linear"] != \
        "gguf Q4_0/Q4_1/Q8_0 blocks (c)"
    on, got = tokens(c_kernels=True, gguf_blocks=True)
    assert on.plan.routes["linear"] == "gguf Q4_0/Q4_1/Q8_0 blocks (c)" and "gguf_blocks" not in on.plan.refused
    assert got == want
    _, plain = tokens(fast_paths=False)
    assert plain == want
    auto, got = tokens(c_kernels=True)  # None: on with AVX-512, refused (with the reason) without
    if kernels.qmatmul_fast():
        assert auto.plan.routes["linear"].startswith("gguf")
    else:
        assert "AVX-512" in auto.plan.refused["gguf_blocks"], auto.plan.refused
    assert got == want


def test_gguf_blocks_true_is_refused_where_there_are_none():
    from minipaged.engine import LLMEngine
    from test_cpu_kernels import _tiny

    with pytest.raises(ValueError, match="gguf_blocks=True cannot be honoured"):
        LLMEngine(_tiny(), None, num_blocks=16, gguf_blocks=True)
    eng = LLMEngine(_tiny(), None, num_blocks=16)  # auto: quietly off, saying why
    assert not eng.plan.routes["linear"].startswith("gguf") and "gguf_blocks" in eng.plan.refused
    if build.library() is not None:
        with pytest.raises(ValueError, match="the model was not loaded from a GGUF file"):
            LLMEngine(_tiny(), None, num_blocks=16, c_kernels=True, gguf_blocks=True)
        # a GGUF model whose file holds no Q4_0/Q4_1/Q8_0 linear weights
        model = gguf_model()
        model.source = ModelSource(path="(memory)", format="gguf", cache={"gguf_blocks": {}})
        with pytest.raises(ValueError, match="holds no Q4_0/Q4_1/Q8_0 linear weights"):
            LLMEngine(model, None, num_blocks=16, c_kernels=True, gguf_blocks=True)


def portable_build(tmp_path):
    """The kernels built as on a CPU without AVX-512 and without OpenMP (skips without a compiler)."""
    import ctypes
    import shutil
    import subprocess

    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        pytest.skip("no C compiler")
    so = tmp_path / "portable.so"
    subprocess.run([cc, "-O2", "-fPIC", "-shared", str(build.SOURCE), "-o", str(so), "-lm"], check=True,
                   capture_output=True, timeout=120)
    lib = ctypes.CDLL(str(so))
    assert lib.minipaged_qmatmul_fast() == 0 and lib.minipaged_openmp() == 0
    return lib


def test_the_portable_loop_gives_the_same_products_and_says_it_is_slow(tmp_path):
    """Built without AVX-512 (a laptop, a Mac), the kernel keeps a plain loop over the same
    layout: right, but far too slow to serve with, so it reports itself as not fast."""
    import ctypes

    lib = portable_build(tmp_path)
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.minipaged_qmatmul_f32.argtypes = [p, i64, p, p, p, i64, p, i64, i64, i64]
    lib.minipaged_qmatvec_f32.argtypes = [p, i64, p, p, p, i64, p, i64, i64, i64]
    for kind in sorted(KINDS):
        blocks = GGUFBlocks.from_file_rows(kind, random_rows(kind, 21, 96, seed=7))
        x = torch.randn(3, 96, generator=torch.Generator().manual_seed(7))
        y = torch.empty(3, 21)
        rc = lib.minipaged_qmatmul_f32(x.data_ptr(), 96, blocks.qt.data_ptr(), blocks.dt.data_ptr(),
                                       None if blocks.mt is None else blocks.mt.data_ptr(), KINDS[kind], y.data_ptr(),
                                       3, 21, 96)
        assert rc == 0
        assert_fp32_close(y, x, blocks.dequantize())
        y2 = torch.empty(3, 21)  # the row layout's loop
        rc = lib.minipaged_qmatvec_f32(x.data_ptr(), 96, blocks.rq.data_ptr(), blocks.rd.data_ptr(),
                                       None if blocks.rm is None else blocks.rm.data_ptr(), KINDS[kind], y2.data_ptr(),
                                       3, 21, 96)
        assert rc == 0
        assert_fp32_close(y2, x, blocks.dequantize())


@needs_slow
def test_without_the_fast_kernel_the_fp32_weights_serve_unless_required():
    """Without AVX-512 the GGUF matmul is the portable loop: exact, far too slow to serve with. By
    default the plan refuses it, saying so, and every linear layer runs F.linear (the blocks are
    not even read); gguf_blocks=True runs the loop anyway, with the same greedy tokens."""
    from minipaged.sampling import SamplingParams

    model = gguf_model()
    model.source = ModelSource(path="/nonexistent/never-read.gguf", format="gguf")
    eng = _engine(model, c_kernels=True)
    assert "AVX-512" in eng.plan.refused["gguf_blocks"] and "gguf_blocks=True" in eng.plan.refused["gguf_blocks"]
    assert eng.plan.routes["linear"].startswith(("torch", "mkl")), eng.plan
    assert eng.plan.routes["whole_step_decode"].startswith("off") and eng.plan.routes["next_token"].startswith("sampler")
    assert "gguf_blocks" not in model.source.cache, "blocks were read where no kernel uses them"
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    req = eng.add_request([3, 4, 5, 6], params)
    want = eng.run()[req].token_ids
    served = gguf_model()  # the same weights, with their blocks
    loop = _engine(served, **ALL_ON)
    assert loop.plan.routes["linear"].startswith("gguf")
    req = loop.add_request([3, 4, 5, 6], params)
    assert loop.run()[req].token_ids == want


@pytest.mark.slow
def test_a_files_blocks_are_read_once_while_a_plan_holds_them_and_freed_after(smollm2, monkeypatch):
    """A second engine on a loaded GGUF model reuses the blocks the first one's plan holds (reading
    the file's metadata again costs seconds an engine); once no plan holds them they are freed, and
    the next engine reads the file again."""
    import gc

    from minipaged.cpu import gguf_blocks

    model, _ = smollm2
    reads = []
    real = gguf_blocks.read_blocks
    monkeypatch.setattr(gguf_blocks, "read_blocks", lambda *a: reads.append(1) or real(*a))
    model.source.cache.pop("gguf_blocks", None)
    first, why = gguf_blocks.model_blocks(model)
    second, _ = gguf_blocks.model_blocks(model)
    assert why is None and len(reads) == 1 and all(second[m] is first[m] for m in first)
    del first, second
    gc.collect()
    assert model.source.cache["gguf_blocks"]() is None, "no plan holds the blocks: they must be freed"
    gguf_blocks.model_blocks(model)
    assert len(reads) == 2
