"""The GGUF matmul's lane kernel on AMX tiles (csrc/gguf_matmul.c, ``kernels.qmatmul_amx``).

Where the CPU has AMX-BF16 every product of more than 8 rows runs on the tile unit: each fp32 x
is split into three bf16 parts whose sum is x exactly, the integers of the weights are exact in
bf16, so every product is exact and only the sums round. What must hold:

- it is on where the CPU has it, and off with ``MINIPAGED_AMX=0`` (and ``set_amx``);
- its products are an fp32 matmul's for Q4_0, Q4_1 and Q8_0, strided rows, every row count the
  tiles split differently, and rows whose values span every exponent;
- the split loses nothing: a block holding one value of x gives d q x exactly;
- each row's bits are the same in any batch (chunks of 64 rows, the padded last tile);
- the head's argmax is the argmax of its own logits, and the engine's greedy tokens are the
  same with the tiles on and off.
"""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from minipaged.cpu import build, kernels
from minipaged.cpu.gguf_blocks import KINDS, GGUFBlocks

from test_gguf_blocks import ALL_ON, assert_fp32_close, gguf_model, random_rows

needs_amx = pytest.mark.skipif(build.library() is None or not kernels.qmatmul_amx(),
                               reason="the AMX kernel needs a CPU with AMX-BF16 (Sapphire Rapids or later) and Linux")


@pytest.fixture
def amx_off():
    """The AVX-512 panel for the length of a test (the AMX kernel back on after)."""
    was = kernels.set_amx(False)
    yield
    kernels.set_amx(was)


def _cpu_has_amx() -> bool:
    """The CPU says it has AMX-BF16 and Linux grants this process the tile state (5.16 and later)."""
    import ctypes
    import platform

    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    if not (" amx_bf16" in flags and " amx_tile" in flags) or platform.machine() != "x86_64":
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.syscall(158, 0x1023, 18) == 0  # SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA


@pytest.mark.skipif(build.library() is None, reason="no CPU kernels here")
def test_it_is_on_where_the_cpu_has_it_and_the_announcement_says_so():
    native = "-march=native" in build.info().get("flags", "")
    if os.environ.get("MINIPAGED_AMX", "").lower() in ("0", "false", "off", "no"):
        assert not kernels.qmatmul_amx()
    elif _cpu_has_amx() and native and kernels.qmatmul_fast():
        assert kernels.qmatmul_amx(), "this CPU has AMX-BF16 and the build is native, but the tile kernel is off"
        assert "AMX tiles" in build.announcement()
    else:
        assert not kernels.qmatmul_amx()
        with pytest.raises(RuntimeError, match="cannot run here"):
            kernels.set_amx(True)


@needs_amx
def test_minipaged_amx_0_keeps_the_avx512_panel():
    code = ("from minipaged.cpu import kernels, build; print(kernels.qmatmul_amx(), 'AMX tiles' in build.announcement())")
    for value, want in (("0", "False False"), ("OFF", "False False"), ("false", "False False"), ("1", "True True"),
                        ("", "True True")):
        out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, MINIPAGED_AMX=value),
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        assert out.stdout.split()[-2:] == want.split(), (value, out.stdout)


@needs_amx
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_the_tiles_give_an_fp32_matmul_at_every_row_count(kind):
    blocks = GGUFBlocks.from_file_rows(kind, random_rows(kind, 37, 160, seed=3))  # a part-filled lane group and pair
    w = blocks.dequantize()
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(150, 171, generator=g) * torch.logspace(-6, 6, 171)[None, :]  # every exponent
    for m in (9, 15, 16, 17, 31, 32, 33, 64, 65, 130):
        x = wide[:m, 5:165]  # strided rows
        assert_fp32_close(kernels.qmatmul(x, blocks), x, w)


@needs_amx
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_the_split_of_x_is_exact(kind):
    """x's values carry bits in each of its three bf16 parts (2^a (1 + 2^-9 + 2^-18)), one a row,
    and the scales are powers of two: then every product and sum is exact in fp32, so y must be
    w x to the bit. A split that drops or rounds away x's lowest part fails here."""
    rows = random_rows(kind, 16, 64, seed=11).reshape(16, 2, -1)
    rows[..., 0:2] = np.array([0.5], dtype=np.float16).view(np.uint8)  # d
    if kind == "Q4_1":
        rows[..., 2:4] = np.array([0.25], dtype=np.float16).view(np.uint8)  # m
    if kind == "Q8_0":  # integers of 4 bits and a sign, as the nibble kinds' (so that q x fits fp32)
        rows[..., 2:] = np.random.default_rng(11).integers(-15, 16, size=rows[..., 2:].shape).astype(np.int8).view(np.uint8)
    blocks = GGUFBlocks.from_file_rows(kind, rows.reshape(16, -1))
    w = blocks.dequantize()
    g = torch.Generator().manual_seed(11)
    x = torch.zeros(16, 64)
    for r in range(16):
        a = int(torch.randint(-20, 20, (), generator=g))
        x[r, (5 * r) % 32] = (-1) ** r * 2.0 ** a * (1 + 2.0 ** -9 + 2.0 ** -18)
    want = (x.double() @ w.double().T).float()
    assert torch.equal(want.double(), x.double() @ w.double().T), "the test's own values must be exact in fp32"
    got = kernels.qmatmul(x, blocks)
    assert torch.equal(got, want), (got - want).abs().max()


@needs_amx
@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_each_row_gets_the_same_bits_in_any_batch(kind):
    blocks = GGUFBlocks.from_file_rows(kind, random_rows(kind, 40, 320, seed=5))
    x = torch.randn(300, 320, generator=torch.Generator().manual_seed(5))
    got = kernels.qmatmul(x, blocks)
    for start, n in ((0, 9), (60, 13), (63, 2 + 9), (64, 16), (128, 33), (287, 13)):
        assert torch.equal(got[start:start + n], kernels.qmatmul(x[start:start + n], blocks)), (start, n)


@needs_amx
def test_the_tiles_and_the_panel_agree_to_fp32_rounding_and_the_argmax_is_its_own_logits(amx_off):
    blocks = GGUFBlocks.from_file_rows("Q8_0", random_rows("Q8_0", 300, 128, seed=9))
    x = torch.randn(40, 128, generator=torch.Generator().manual_seed(9))
    panel = kernels.qmatmul(x, blocks)
    kernels.set_amx(True)
    tiles = kernels.qmatmul(x, blocks)
    assert_fp32_close(tiles, x, blocks.dequantize())
    assert_fp32_close(panel, x, blocks.dequantize())
    assert kernels.qmatmul_argmax(x, blocks) == tiles.argmax(dim=1).tolist()


@needs_amx
def test_the_engine_gives_the_same_greedy_tokens_with_the_tiles_on_and_off(amx_off):
    from minipaged.engine import LLMEngine
    from minipaged.sampling import SamplingParams

    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [[3 + i, 4, 5 + i % 7, 6, 9 + i] for i in range(12)]  # 12 sequences: the lane kernel serves
    runs = []
    for on in (False, True):
        kernels.set_amx(on)
        eng = LLMEngine(gguf_model(), None, num_blocks=64, block_size=4, max_num_seqs=12, record_trace=False, **ALL_ON)
        ids = [eng.add_request(p, params) for p in prompts]
        done = eng.run()
        runs.append([done[i].token_ids for i in ids])
        assert eng.route_counts.get("whole_step+head_argmax", 0) > 0, eng.route_counts
    assert runs[0] == runs[1]
