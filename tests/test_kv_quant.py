"""KV cache quantization (kv_cache_dtype): the names, the round trip, every reading backend on
8-bit pages, scales through copy-on-write / rollback / the prefix cache, bad input, capacity.

The Triton kernels on 8-bit pages are in test_kv_quant_triton.py (they need the interpreter)."""
from __future__ import annotations

import argparse

import pytest
import torch

from minipaged import kv_quant as kq
from minipaged.attention.reference import gather_kv
from minipaged.attention.reference import paged_attention as reference_attention
from minipaged.attention.torch_sdpa import paged_attention as sdpa_attention
from minipaged.config import EngineConfig
from minipaged.kv_cache import KVCache, kv_bytes_per_block, kv_bytes_per_token, num_blocks_for_budget, write_kv

QUANTIZED = ["int8", "fp8_e4m3", "fp8_e5m2"]
# largest relative rounding error of one stored value, in units of the value (fp8: half an ulp of
# its mantissa, 3 bits for e4m3 and 2 for e5m2) or of its block's largest |value| (int8: half a step)
REL = {"fp8_e4m3": 2.0**-4, "fp8_e5m2": 2.0**-3}


def new_pages(name: str, shape=(12, 4, 2, 8)) -> tuple[torch.Tensor, torch.Tensor]:
    fmt = kq.resolve(name)
    return kq.new_cache(shape, fmt), kq.new_cache(shape, fmt)


def slots_of(table: list[int], start: int, n: int, block_size: int) -> torch.Tensor:
    pos = torch.arange(start, start + n)
    return torch.tensor(table)[pos // block_size] * block_size + pos % block_size


# -- the names ------------------------------------------------------------------------------------
def test_names_as_vllm_spells_them():
    assert kq.KV_CACHE_DTYPES == ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8")
    assert kq.resolve("auto") is None
    assert kq.resolve("fp8") is kq.resolve("fp8_e4m3")  # a synonym
    assert kq.resolve("fp8_e4m3").storage == torch.float8_e4m3fn and kq.resolve("fp8_e4m3").qmax == 448
    assert kq.resolve("fp8_e5m2").storage == torch.float8_e5m2 and kq.resolve("fp8_e5m2").qmax == 57344
    assert kq.resolve("int8").per_block and not kq.resolve("fp8").per_block


@pytest.mark.parametrize("bad", ["fp4", "FP8", "float8", "", None, 8])
def test_unknown_name_lists_the_valid_ones(bad):
    with pytest.raises(ValueError, match="auto, fp8, fp8_e4m3, fp8_e5m2, int8"):
        EngineConfig(kv_cache_dtype=bad)


def test_cli_flag_takes_the_names():
    from minipaged.flags import add_engine_flags, engine_kwargs

    p = argparse.ArgumentParser()
    add_engine_flags(p)
    assert engine_kwargs(p.parse_args(["--kv-cache-dtype", "fp8"]))["kv_cache_dtype"] == "fp8"
    assert engine_kwargs(p.parse_args(["--calculate-kv-scales"]))["calculate_kv_scales"] is True
    with pytest.raises(SystemExit):
        p.parse_args(["--kv-cache-dtype", "fp4"])


def test_a_dtype_this_torch_lacks_is_an_error_not_a_fallback(monkeypatch):
    monkeypatch.delitem(kq.FORMATS, "fp8_e5m2")
    assert "float8_e5m2" in kq.unavailable("fp8_e5m2")
    with pytest.raises(ValueError, match="cannot run: this torch"):
        kq.resolve("fp8_e5m2")
    assert kq.unavailable("int8") is None and kq.unavailable("auto") is None


# -- the round trip ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", QUANTIZED)
def test_round_trip_error_bound(name):
    torch.manual_seed(0)
    k, v = new_pages(name, (8, 4, 2, 16))
    x = torch.randn(32, 2, 16) * 3
    slots = torch.randperm(32)
    write_kv(k, v, x, -x, slots)
    got = kq.read_blocks(k, torch.arange(8)).reshape(32, 2, 16)[slots]
    err = (got - x).abs()
    if name == "int8":
        amax = x.new_zeros(8, 2).scatter_reduce_(0, (slots // 4)[:, None].expand(-1, 2), x.abs().amax(-1), "amax")  # per (block, head)
        bound = amax[slots // 4][:, :, None] / 127 * 0.5 + 1e-7
    else:  # scale 1.0: fp8's own rounding (the values are far inside its normal range)
        bound = REL[name] * x.abs() + 2.0**-9
    assert (err <= bound).all(), float((err - bound).max())
    assert torch.equal(kq.read_blocks(v, torch.arange(8)).reshape(32, 2, 16)[slots], -got)


def test_int8_scale_grows_and_rerounds_the_rows_already_there():
    k, v = new_pages("int8", (4, 4, 1, 8))
    small, big = torch.full((1, 1, 8), 0.5), torch.full((1, 1, 8), 50.0)
    write_kv(k, v, small, small, torch.tensor([4]))  # block 1, row 0
    assert k.kv_scales[1, 0] == pytest.approx(0.5 / 127)
    write_kv(k, v, big, big, torch.tensor([5]))  # row 1 of the same block: its scale grows
    assert k.kv_scales[1, 0] == pytest.approx(50 / 127)
    rows = kq.read_blocks(k, torch.tensor([1]))[0, :2, 0]
    assert torch.allclose(rows[1], big[0, 0]) and (rows[0] - 0.5).abs().max() <= 0.5 * 50 / 127 + 1e-6


def test_a_write_at_row_0_starts_the_block_afresh():
    k, v = new_pages("int8", (4, 4, 1, 8))
    write_kv(k, v, torch.full((1, 1, 8), 100.0), torch.ones(1, 1, 8), torch.tensor([8]))
    write_kv(k, v, torch.full((1, 1, 8), 0.01), torch.ones(1, 1, 8), torch.tensor([8]))  # a new owner
    assert k.kv_scales[2, 0] == pytest.approx(0.01 / 127)  # not the earlier owner's 100/127
    assert torch.allclose(kq.read_blocks(k, torch.tensor([2]))[0, 0, 0], torch.full((8,), 0.01))


def test_fp8_layer_scale_is_used_and_calibrated_from_the_first_batch():
    cache = KVCache(1, 4, 4, 2, 8, kv_cache_dtype="fp8", calculate_kv_scales=True)
    x = torch.randn(6, 2, 8) * 1000  # beyond e4m3's 448 at scale 1.0
    cache.write(0, x, x / 1000, torch.arange(6))
    assert float(cache.k[0].kv_scales[0, 0]) == pytest.approx(float(x.abs().max()) / 448)
    assert float(cache.v[0].kv_scales[3, 1]) == pytest.approx(float(x.abs().max()) / 1000 / 448)
    got = kq.read_blocks(cache.k[0], torch.arange(2)).reshape(8, 2, 8)[:6]
    assert ((got - x).abs() <= REL["fp8_e4m3"] * x.abs() + 1e-3).all()
    assert not cache.k[0].kv_calibrate  # once: a later batch keeps the scale


# -- every reading backend on 8-bit pages ------------------------------------------------------------
def filled(name: str, seed: int = 0):
    """Two sequences written in pieces (prefill, chunks, decodes) into 8-bit pages and fp32 ones."""
    torch.manual_seed(seed)
    k, v = new_pages(name)
    kf, vf = torch.zeros(12, 4, 2, 8), torch.zeros(12, 4, 2, 8)
    tables = [[3, 5, 1, 0], [2, 7, 8, 9]]
    for seq, start, n in [(0, 0, 5), (1, 0, 6), (0, 5, 1), (1, 6, 1), (0, 6, 1), (1, 7, 3)]:
        kk, vv = torch.randn(n, 2, 8) * (1 + 3 * seq), torch.randn(n, 2, 8)
        s = slots_of(tables[seq], start, n, 4)
        write_kv(k, v, kk, vv, s)
        write_kv(kf, vf, kk, vv, s)
    return k, v, kf, vf, torch.tensor(tables, dtype=torch.int32), torch.tensor([7, 10], dtype=torch.int32)


@pytest.mark.parametrize("name", QUANTIZED)
@pytest.mark.parametrize("qsl", [[0, 1, 2], [0, 2, 5], [0, 7, 17]])  # decode, chunks, whole prefill
def test_sdpa_equals_the_reference_on_quantized_pages(name, qsl):
    k, v, kf, vf, tables, ctx = filled(name)
    q = torch.randn(qsl[-1], 4, 8)
    qsl = torch.tensor(qsl, dtype=torch.int32)
    ref = reference_attention(q, k, v, tables, ctx, qsl, 8**-0.5)
    torch.testing.assert_close(sdpa_attention(q, k, v, tables, ctx, qsl, 8**-0.5), ref, atol=2e-6, rtol=1e-5)
    # and the reference on 8-bit pages is the reference on their dequantized fp32 copy
    deq_k = kq.read_blocks(k, torch.arange(12))
    deq_v = kq.read_blocks(v, torch.arange(12))
    torch.testing.assert_close(reference_attention(q, deq_k, deq_v, tables, ctx, qsl, 8**-0.5), ref)
    # which is near the fp32 pages' answer, not equal to it: the rounding is real (e5m2 the coarsest)
    off = (ref - reference_attention(q, kf, vf, tables, ctx, qsl, 8**-0.5)).abs().max()
    assert 0 < off < {"int8": 0.1, "fp8_e4m3": 0.5, "fp8_e5m2": 1.0}[name]


def test_attention_that_ignores_the_scales_is_wrong():
    k, v, *_ , tables, ctx = filled("int8")
    qsl = torch.tensor([0, 1, 2], dtype=torch.int32)
    q = torch.randn(2, 4, 8)
    raw_k, raw_v = k.float(), v.float()  # the stored integers, no scale: what a forgetful kernel reads
    assert (reference_attention(q, raw_k, raw_v, tables, ctx, qsl, 0.35)
            - reference_attention(q, k, v, tables, ctx, qsl, 0.35)).abs().max() > 1


# -- blocks that move ----------------------------------------------------------------------------------
def test_copy_on_write_copies_the_scales():
    from minipaged.prefix_cache import copy_blocks

    cache = KVCache(2, 6, 4, 2, 8, kv_cache_dtype="int8")
    for layer in range(2):
        cache.write(layer, torch.randn(3, 2, 8) * (layer + 1), torch.randn(3, 2, 8), torch.tensor([4, 5, 6]))
    copy_blocks(cache, [(1, 3)])
    for t in cache.k + cache.v:
        assert torch.equal(t.kv_scales[3], t.kv_scales[1]) and t.kv_scales[3].min() > 0
        assert torch.equal(kq.read_blocks(t, torch.tensor([3])), kq.read_blocks(t, torch.tensor([1])))
    # the copy is then written on its own: the source's scale stays as it was
    before = cache.k[0].kv_scales[1].clone()
    cache.write(0, torch.full((1, 2, 8), 99.0), torch.ones(1, 2, 8), torch.tensor([15]))
    assert torch.equal(cache.k[0].kv_scales[1], before) and cache.k[0].kv_scales[3].min() == pytest.approx(99 / 127)


def test_clearing_a_block_clears_its_scales():
    for name in QUANTIZED:
        k, v = new_pages(name)
        write_kv(k, v, torch.randn(4, 2, 8), torch.randn(4, 2, 8), torch.arange(4, 8))
        kq.clear_blocks(k, torch.tensor([1]))
        assert kq.read_blocks(k, torch.tensor([1])).abs().max() == 0
        if name == "int8":
            assert k.kv_scales[1].abs().max() == 0


def test_rollback_then_rewrite_keeps_the_accepted_tokens():
    """A verifying step writes k + 1 tokens, some are rejected and their slots written again: the
    block's scale stays >= what its accepted tokens need, so they read back within one step."""
    k, v = new_pages("int8", (2, 8, 1, 8))
    accepted = torch.randn(3, 1, 8)
    drafts = torch.randn(3, 1, 8) * 20  # rejected later, but they raised the scale
    write_kv(k, v, torch.cat([accepted, drafts]), torch.cat([accepted, drafts]), torch.arange(6))
    redo = torch.randn(2, 1, 8)
    write_kv(k, v, redo, redo, torch.arange(3, 5))  # rollback to 3 tokens, two new ones
    got = kq.read_blocks(k, torch.tensor([0]))[0, :5]
    truth = torch.cat([accepted, redo])
    assert ((got - truth).abs() <= float(k.kv_scales[0, 0]) + 1e-6).all()


# -- bad input ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", QUANTIZED)
def test_nan_and_inf_never_poison_a_block(name):
    k, v = new_pages(name, (2, 4, 1, 8))
    x = torch.randn(4, 1, 8)
    bad = x.clone()
    bad[1, 0, 0], bad[2, 0, 3], bad[3, 0, 5] = float("nan"), float("inf"), float("-inf")
    write_kv(k, v, bad, bad, torch.arange(4))
    got = kq.read_blocks(k, torch.tensor([0]))[0]
    assert torch.isfinite(got).all() and torch.isfinite(k.kv_scales).all()
    assert got[1, 0, 0] == 0  # NaN is stored as 0
    assert got[2, 0, 3] > 0 and got[3, 0, 5] < 0  # +-inf: clipped to the largest value the block holds
    fine = torch.ones_like(x, dtype=torch.bool)
    fine[1, 0, 0] = fine[2, 0, 3] = fine[3, 0, 5] = False
    if name == "int8":  # the scale is the finite values' (the inf set none)
        assert float(k.kv_scales[0, 0]) == pytest.approx(float(x[fine.view(4, 1, 8)].abs().max()) / 127)
    bound = float(k.kv_scales[0, 0]) / 2 + 1e-6 if name == "int8" else REL[name] * x.abs() + 2.0**-9
    assert ((got - x).abs() <= bound)[fine].all()  # the other values survive, at the format's precision


@pytest.mark.parametrize("name,largest", [("int8", 65504.0), ("fp8_e4m3", 448.0), ("fp8_e5m2", 57344.0)])
def test_values_beyond_the_range_are_clipped(name, largest):
    """fp8 at scale 1.0 holds |x| <= its largest value; int8 pages hold fp16's range (65504)."""
    k, v = new_pages(name, (2, 4, 1, 8))
    x = torch.randn(2, 1, 8)
    x[0, 0, 0], x[1, 0, 1] = 1e30, -1e30
    write_kv(k, v, x, x, torch.arange(2))
    got = kq.read_blocks(k, torch.tensor([0]))[0]
    assert torch.isfinite(got).all()
    assert got[0, 0, 0] == pytest.approx(largest, rel=2**-7) and got[1, 0, 1] == pytest.approx(-largest, rel=2**-7)


@pytest.mark.parametrize("scale", [0.0, -1.0, float("nan"), float("inf")])
def test_a_bad_layer_scale_is_refused(scale):
    k, _ = new_pages("fp8")
    with pytest.raises(ValueError, match="finite number > 0"):
        kq.set_layer_scale(k, scale)
    assert float(k.kv_layer_scale) == 1.0


def test_calibration_never_sets_a_zero_or_nan_scale():
    assert kq.calibration_scale(torch.zeros(4, 2, 8), 448) == 1.0
    assert kq.calibration_scale(torch.full((4,), float("nan")), 448) == 1.0
    assert kq.calibration_scale(torch.tensor([float("inf"), -896.0]), 448) == 2.0


def test_an_all_zero_int8_block_has_scale_zero_and_reads_zero():
    k, v = new_pages("int8", (2, 4, 1, 8))
    write_kv(k, v, torch.zeros(4, 1, 8), torch.zeros(4, 1, 8), torch.arange(4))
    assert k.kv_scales[0].abs().max() == 0
    assert kq.read_blocks(k, torch.tensor([0])).abs().max() == 0  # 0 * 0, no 0 / 0


# -- capacity ------------------------------------------------------------------------------------------
SMOL = dict(num_layers=30, num_kv_heads=3, head_dim=64)  # SmolLM2-135M


@pytest.mark.parametrize("name,per_token,per_block", [
    ("auto", 2 * 30 * 3 * 64 * 4, 16 * 2 * 30 * 3 * 64 * 4),
    ("fp8", 2 * 30 * 3 * 64, 16 * 2 * 30 * 3 * 64),
    ("fp8_e5m2", 2 * 30 * 3 * 64, 16 * 2 * 30 * 3 * 64),
    ("int8", 2 * 30 * 3 * 64, 16 * 2 * 30 * 3 * 64 + 2 * 30 * 3 * 4),  # + an fp32 scale per (block, head), K and V
])
def test_bytes_per_token_and_block_follow_the_dtype(name, per_token, per_block):
    assert kv_bytes_per_token(**SMOL, dtype=torch.float32, kv_cache_dtype=name) == per_token
    assert kv_bytes_per_block(**SMOL, block_size=16, dtype=torch.float32, kv_cache_dtype=name) == per_block


@pytest.mark.parametrize("name,seqs", [("auto", 22), ("fp8", 91), ("fp8_e4m3", 91), ("fp8_e5m2", 91), ("int8", 90)])
def test_sequences_that_fit_a_budget(name, seqs):
    """1 GiB of KV, sequences of 1024 tokens (64 blocks of 16): 1456 fp32 blocks hold 22 of them;
    8-bit pages hold 4x the blocks (int8's scales cost 720 bytes a block: 5802, not 5825)."""
    blocks = num_blocks_for_budget(2**30, **SMOL, block_size=16, dtype=torch.float32, kv_cache_dtype=name)
    assert blocks // 64 == seqs


def test_memory_calculator_knows_the_names():
    from minipaged import memory

    for name in ("fp8", "fp8_e4m3", "fp8_e5m2", "int8"):
        assert memory.token_kv_bytes("SmolLM2-135M", name) == 2 * 30 * 3 * 64
    assert memory.token_kv_bytes("SmolLM2-135M", "float16") == 2 * memory.token_kv_bytes("SmolLM2-135M", "fp8")


@pytest.mark.parametrize("name", ["fp8", "fp8_e4m3", "fp8_e5m2", "int8"])
def test_memory_calculator_counts_blocks_as_the_engine_does(name):
    """The lesson 01 calculator (memory.py) and the engine (kv_cache.num_blocks_for_budget) agree on
    the blocks of a budget, int8's per-block scales included: 1 GiB of SmolLM2 KV in fp16 model
    config terms. A budget just short of one more int8 block shows the scales are counted."""
    from minipaged import memory

    cfg = memory.get_model("SmolLM2-135M")
    per_block = memory.block_kv_bytes(cfg, 16, name)
    assert per_block == kv_bytes_per_block(**SMOL, block_size=16, dtype=torch.float32, kv_cache_dtype=name)
    engine_blocks = num_blocks_for_budget(2**30, **SMOL, block_size=16, dtype=torch.float32, kv_cache_dtype=name)
    c = memory.concurrency(2**30, cfg, 1024, 1024, 16, name)
    assert c.num_blocks == engine_blocks
    assert memory.paged_seqs_that_fit(2**30, cfg, 1024, 16, name) == engine_blocks // 64 == c.paged_seqs
    assert c.paged_reserved_bytes == c.paged_seqs * 64 * per_block
    # 64 blocks' worth of bare 8-bit pages, without their scales: int8 holds one sequence fewer.
    bare = 64 * 16 * memory.token_kv_bytes(cfg, name)
    assert memory.paged_seqs_that_fit(bare, cfg, 1024, 16, name) == (0 if name == "int8" else 1)


def test_kv_cache_reports_its_bytes_with_the_scales():
    plain = KVCache(2, 10, 16, 2, 8)
    q8 = KVCache(2, 10, 16, 2, 8, kv_cache_dtype="int8")
    f8 = KVCache(2, 10, 16, 2, 8, kv_cache_dtype="fp8_e5m2")
    assert plain.nbytes == 4 * f8.nbytes
    assert q8.nbytes == f8.nbytes + 2 * 2 * 10 * 2 * 4
    assert f8.storage_dtype == torch.float8_e5m2 and "fp8_e5m2" in repr(f8)
