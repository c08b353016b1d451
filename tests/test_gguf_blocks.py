"""Batches multiply straight from the GGUF blocks (model/gguf_blocks.py, cpu_kernels.qmatmul).

- the kernel rebuilds every weight bit for bit as gguf.quants dequantizes it, for Q4_0, Q4_1
  and Q8_0 (fp16 scales of every sign and size, subnormal ones too), and its products are an
  fp32 matmul's, at every row count the kernel splits differently (1..20) and on strided rows;
- the default model's kept blocks are its fp32 copies exactly, Q and K rows un-permuted too;
- a Linear uses its blocks only for batches of at most ``gguf_rows`` rows, never once its weight
  is replaced or changed, and adds its bias;
- ``EngineConfig.gguf_blocks``: validated, off when asked, refused with a reason where it cannot
  be on; greedy output is the same with the blocks and without them.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from minipaged.attention import cpu_kernels
from minipaged.model.gguf_blocks import KINDS, GGUFBlocks
from minipaged.model.llama import GGUF_MATMUL_MAX_ROWS, Linear

needs_kernels = pytest.mark.skipif(not cpu_kernels.available(), reason=f"no CPU kernels here: {cpu_kernels.why_not()}")
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
        got = cpu_kernels.qmatmul(eye, blocks)
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
    assert_fp32_close(cpu_kernels.qmatmul(x, blocks), x, w)


@needs_kernels
@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_a_long_batch_goes_in_row_chunks_and_each_row_gets_the_same_bits(kind):
    """A prefill's batch runs 1024 rows at a time (QROWS in cpu_kernels.c): rows on either side
    of a chunk boundary, and the part-filled last chunk, get exactly the bits they get in a small
    batch of their own, and every row is an fp32 matmul's."""
    k = 320
    blocks = GGUFBlocks.from_file_rows(kind, random_rows(kind, 40, k, seed=5))
    g = torch.Generator().manual_seed(5)
    wide = torch.randn(2 * 1024 + 21, k + 8, generator=g)
    x = wide[:, 3:3 + k]  # strided rows
    got = cpu_kernels.qmatmul(x, blocks)
    assert_fp32_close(got, x, blocks.dequantize())
    for start in (0, 1016, 1020, 1024, 2040, 2048, 2048 + 21 - 13):
        part = cpu_kernels.qmatmul(x[start:start + 13], blocks)
        assert torch.equal(got[start:start + 13], part), f"rows {start}..{start + 12} differ from a batch of their own"


@needs_kernels
def test_bad_blocks_and_inputs_are_refused_with_a_reason():
    raw = random_rows("Q4_1", 4, 64)
    with pytest.raises(ValueError, match="Q2_K blocks are not supported"):
        GGUFBlocks.from_file_rows("Q2_K", raw)
    with pytest.raises(ValueError, match=r"Q4_1 rows must be uint8 \(N, K/32 \* 20\)"):
        GGUFBlocks.from_file_rows("Q4_1", raw[:, :30])
    blocks = GGUFBlocks.from_file_rows("Q4_1", raw)
    with pytest.raises(ValueError, match=r"x must be fp32 \(M, 64\) on the CPU"):
        cpu_kernels.qmatmul(torch.randn(2, 65), blocks)
    with pytest.raises(ValueError, match=r"x must be fp32"):
        cpu_kernels.qmatmul(torch.randn(2, 64, dtype=torch.float64), blocks)
    lin = Linear(64, 5, bias=False)
    with pytest.raises(ValueError, match=r"blocks of a \(4, 64\) weight cannot stand for this \(5, 64\) one"):
        lin.keep_blocks(blocks)


@needs_kernels
@pytest.mark.parametrize("bias", [False, True])
def test_a_linear_uses_its_blocks_only_for_small_batches_and_never_stale(bias, monkeypatch):
    blocks = GGUFBlocks.from_file_rows("Q4_1", random_rows("Q4_1", 48, 96, seed=4))
    lin = Linear(96, 48, bias=bias).requires_grad_(False)
    with torch.no_grad():
        lin.weight.copy_(blocks.dequantize())
        if bias:
            lin.bias.uniform_(-1, 1)
    lin.keep_blocks(blocks)
    calls = []
    real = cpu_kernels.qmatmul
    monkeypatch.setattr(cpu_kernels, "qmatmul", lambda x, b: calls.append(x.shape[0]) or real(x, b))
    x3, x20 = torch.randn(3, 96), torch.randn(20, 96)
    lin(x3)
    assert calls == [], "gguf_rows is 0 until it is set: the blocks must not be used yet"
    lin.gguf_rows = 16
    assert_fp32_close(lin(x3), x3, lin.weight, lin.bias)
    lin(x20)  # above gguf_rows: the fp32 copy
    assert calls == [3]
    with torch.no_grad():
        lin.weight.mul_(-1.5)  # changed in place: the blocks no longer stand for it
    assert lin.blocks is None
    torch.testing.assert_close(lin(x3), F.linear(x3, lin.weight, lin.bias), rtol=0, atol=0)  # F.linear itself
    lin.keep_blocks(blocks)
    lin.weight.data = blocks.dequantize().clone()  # replaced memory: same values, still not trusted
    assert lin.blocks is None and calls == [3]


@needs_kernels
def test_the_default_models_blocks_are_its_fp32_weights_exactly(smollm2):
    model, _ = smollm2
    info = model.gguf_blocks_info()
    assert info["layers"] == info["of"] == 7 * model.config.num_layers + 1
    assert info["kinds"] == ["Q4_1", "Q8_0"]
    for name, module in model.named_modules():
        if isinstance(module, Linear):
            assert torch.equal(module.blocks.dequantize(), module.weight), f"{name}: kept blocks are not its weight"
            assert torch.equal(module.blocks.dequantize_rows(), module.weight), f"{name}: its row layout is not its weight"


@needs_kernels
def test_engine_setting_on_off_and_refused(smollm2):
    from minipaged import LLM, SamplingParams
    from minipaged.engine import LLMEngine

    model, tok = smollm2
    with pytest.raises(ValueError, match="gguf_blocks must be True, False or None"):
        LLMEngine(model, tok, num_blocks=16, gguf_blocks=1)
    prompts = ["The capital of France is", "List three prime numbers:"]
    params = SamplingParams(max_tokens=12, temperature=0.0)
    try:
        off = LLM(model, tok, gguf_blocks=False, num_blocks=64)
        assert off.engine.gguf_blocks is False and model.gguf_blocks_info()["max_rows"] == 0
        want = [o.token_ids for o in off.generate(prompts, params)]
        on = LLM(model, tok, num_blocks=64)
        assert on.engine.gguf_blocks is True and model.gguf_blocks_info()["max_rows"] == GGUF_MATMUL_MAX_ROWS
        assert [o.token_ids for o in on.generate(prompts, params)] == want
    finally:
        model.use_gguf_blocks()  # the session's model as load_model left it


def test_gguf_blocks_true_is_refused_where_there_are_none():
    from minipaged.engine import LLMEngine
    from test_cpu_kernels import _tiny

    with pytest.raises(ValueError, match="gguf_blocks=True cannot be honoured: the model keeps no GGUF blocks"):
        LLMEngine(_tiny(), None, num_blocks=16, gguf_blocks=True)
    eng = LLMEngine(_tiny(), None, num_blocks=16)  # auto: quietly off
    assert eng.gguf_blocks is False


def portable_build(tmp_path):
    """The kernels built as on a CPU without AVX-512 and without OpenMP (skips without a compiler)."""
    import ctypes
    import shutil
    import subprocess

    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        pytest.skip("no C compiler")
    so = tmp_path / "portable.so"
    subprocess.run([cc, "-O2", "-fPIC", "-shared", str(cpu_kernels.SOURCE), "-o", str(so), "-lm"], check=True,
                   capture_output=True, timeout=120)
    lib = ctypes.CDLL(str(so))
    assert lib.minipaged_qmatmul_fast() == 0
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


@needs_kernels
def test_without_the_fast_kernel_the_fp32_copy_serves(monkeypatch, smollm2):
    from minipaged.engine import LLMEngine

    model, tok = smollm2
    monkeypatch.setattr(cpu_kernels, "qmatmul_fast", lambda: False)
    monkeypatch.setattr(cpu_kernels, "qmatmul", lambda *a: pytest.fail("the GGUF matmul ran where it is not fast"))
    try:
        with pytest.raises(ValueError, match="gguf_blocks=True cannot be honoured"):
            LLMEngine(model, tok, num_blocks=16, gguf_blocks=True)
        eng = LLMEngine(model, tok, num_blocks=16)
        assert eng.gguf_blocks is False and model.gguf_blocks_info()["in_use"] is False
        model.lm_head(torch.randn(2, model.config.hidden_size))  # the fp32 copy, not the blocks
    finally:
        model.use_gguf_blocks()
