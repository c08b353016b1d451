"""KV-cache arithmetic against numbers worked out by hand."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minipaged import memory as mem
from minipaged.memory import GiB, KiB


# -- bytes per token -----------------------------------------------------------------------
@pytest.mark.parametrize(
    "model, dtype, expected",
    [
        ("Llama-2-7B", "float16", 512 * KiB),  # 2 * 32 layers * 32 heads * 128 * 2 bytes
        ("Llama-3-8B", "float16", 128 * KiB),  # GQA: 8 KV heads instead of 32
        ("SmolLM2-135M", "float32", 2 * 30 * 3 * 64 * 4),  # 46080
        ("SmolLM2-135M", "bfloat16", 23040),
        ("Qwen2.5-0.5B", "fp16", 2 * 24 * 2 * 64 * 2),  # 12288
        ("Llama-2-7B", "fp8", 256 * KiB),
        ("Llama-2-7B", torch.float32, 1024 * KiB),
    ],
)
def test_token_kv_bytes(model, dtype, expected):
    assert mem.token_kv_bytes(model, dtype) == expected


def test_model_table_numbers():
    smol = mem.MODEL_CONFIGS["SmolLM2-135M"]
    assert (smol.num_layers, smol.num_kv_heads, smol.head_dim, smol.num_heads, smol.hidden_size) == (30, 3, 64, 9, 576)
    assert smol.num_params == 134_515_008
    assert smol.num_heads * smol.head_dim == smol.hidden_size
    assert mem.MODEL_CONFIGS["Llama-3-8B"].num_params == pytest.approx(8.03e9, rel=1e-3)
    assert mem.MODEL_CONFIGS["Llama-2-7B"].num_params == pytest.approx(6.74e9, rel=1e-3)
    assert mem.MODEL_CONFIGS["Qwen2.5-0.5B"].num_params == pytest.approx(0.494e9, rel=1e-2)
    assert mem.get_model("llama-2-7b") is mem.MODEL_CONFIGS["Llama-2-7B"]


def test_sequence_and_weights_bytes():
    # A full 4096-token Llama-2-7B context in fp16 is exactly 2 GiB of KV.
    assert mem.sequence_kv_bytes("Llama-2-7B", 4096, "float16") == 2 * GiB
    assert mem.weights_bytes("Llama-2-7B", "float16") == 2 * 6_738_415_616
    assert mem.weights_bytes("SmolLM2-135M", "float32") == 4 * 134_515_008
    assert mem.weights_bytes("Llama-3-8B", "int4") == 8_030_261_248 // 2
    assert mem.weights_bytes("Llama-3-8B", "int8") == 8_030_261_248


def test_custom_model_and_errors():
    m = mem.custom_model(3e9, num_layers=28, num_kv_heads=8, head_dim=128, name="mine")
    assert mem.token_kv_bytes(m, "fp16") == 2 * 28 * 8 * 128 * 2
    assert mem.weights_bytes(m, "bf16") == 6_000_000_000
    with pytest.raises(KeyError, match="custom_model"):
        mem.get_model("GPT-5")
    with pytest.raises(ValueError, match="unknown dtype"):
        mem.token_kv_bytes("Llama-2-7B", "float13")
    with pytest.raises(ValueError, match="num_kv_heads"):
        mem.custom_model(1e9, num_layers=4, num_kv_heads=0, head_dim=64)


# -- the device ----------------------------------------------------------------------------
def test_memory_breakdown_by_hand():
    b = mem.memory_breakdown(24 * GiB, "Llama-2-7B", "float16", overhead_fraction=0.1)
    assert b.weights_bytes == 13_476_831_232
    assert b.overhead_bytes == int(24 * GiB * 0.1) == 2_576_980_377
    assert b.kv_budget_bytes == 24 * GiB - 13_476_831_232 - 2_576_980_377 == 9_715_992_167
    assert b.fits and b.free_bytes == b.kv_budget_bytes and b.kv_wasted_bytes == 0
    half = b.with_kv(b.kv_budget_bytes // 2, b.kv_budget_bytes // 8)
    assert half.free_bytes == b.kv_budget_bytes - b.kv_budget_bytes // 2
    assert half.kv_wasted_bytes == b.kv_budget_bytes // 2 - b.kv_budget_bytes // 8
    g = half.as_gib()
    assert g["weights"] + g["kv_used"] + g["kv_wasted"] + g["free"] + g["overhead"] == pytest.approx(24.0, abs=1e-6)
    with pytest.raises(ValueError, match="KV budget"):
        b.with_kv(b.kv_budget_bytes + 1)
    small = mem.memory_breakdown(8 * GiB, "Llama-3-8B", "float16")
    assert not small.fits and small.kv_budget_bytes == 0
    assert mem.memory_breakdown(8 * GiB, "Llama-3-8B", "int4").fits


# -- how many fit --------------------------------------------------------------------------
def test_concurrency_by_hand():
    budget = 9_715_992_167  # the 24 GiB Llama-2-7B budget above
    # contiguous: each sequence reserves 2048 * 512 KiB = 1 GiB
    assert mem.contiguous_seqs_that_fit(budget, "Llama-2-7B", 2048) == 9
    # paged: blocks of 16 * 512 KiB = 8 MiB; 1158 of them; 300 tokens need 19 blocks
    c = mem.concurrency(budget, "Llama-2-7B", 300, max_len=2048, block_size=16)
    assert c.num_blocks == 1158
    assert c.paged_seqs == 1158 // 19 == 60
    assert c.contiguous_seqs == 9
    assert c.gain == pytest.approx(60 / 9)
    assert c.contiguous_waste == pytest.approx(1 - 300 / 2048)
    assert c.paged_waste == pytest.approx(4 / 304)
    assert c.contiguous_reserved_bytes == 9 * GiB
    assert c.contiguous_used_bytes == 9 * 300 * 512 * KiB
    assert c.paged_reserved_bytes == 60 * 19 * 16 * 512 * KiB
    assert c.paged_used_bytes == 60 * 300 * 512 * KiB


def test_waste_by_hand():
    assert mem.paged_waste([1, 16, 17], 16) == pytest.approx(30 / 64)
    assert mem.paged_waste([16, 32], 16) == 0.0
    assert mem.paged_waste(5, 1) == 0.0
    assert mem.contiguous_waste([100, 300], 400) == pytest.approx(1 - 400 / 800)
    with pytest.raises(ValueError, match="max_len"):
        mem.contiguous_waste([500], 400)
    with pytest.raises(ValueError, match="positive"):
        mem.paged_waste([], 16)


def test_paged_lengths_taken_in_order_and_repeated():
    bpt = mem.token_kv_bytes("SmolLM2-135M", "fp16")
    budget = 10 * 16 * bpt  # exactly 10 blocks of 16
    # costs 1, 3, 1, 3, ... blocks: 1+3+1+3 = 8, +1 = 9, +3 = 12 > 10
    assert mem.paged_seqs_that_fit(budget, "SmolLM2-135M", [16, 40], 16) == 5
    assert mem.paged_seqs_that_fit(budget, "SmolLM2-135M", 16, 16) == 10
    assert mem.paged_seqs_that_fit(budget - 1, "SmolLM2-135M", 16, 16) == 9
    c = mem.concurrency(budget, "SmolLM2-135M", [16, 40], max_len=64, block_size=16)
    assert c.paged_seqs == 5 and c.paged_used_bytes == (16 + 40 + 16 + 40 + 16) * bpt
    assert c.paged_reserved_bytes == 9 * 16 * bpt


def test_huge_budget_is_fast_and_exact():
    # millions of tiny sequences: counted by whole cycles, not one by one
    c = mem.concurrency(80 * GiB, "SmolLM2-135M", [1, 2, 3], max_len=8, block_size=1)
    bpt = mem.token_kv_bytes("SmolLM2-135M")
    n_blocks = 80 * GiB // bpt
    assert c.num_blocks == n_blocks
    full, rest = divmod(n_blocks, 6)
    assert c.paged_seqs == 3 * full + (1 if rest >= 1 else 0) + (1 if rest >= 3 else 0)


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 2000), min_size=1, max_size=20),
    block_size=st.sampled_from([1, 8, 16, 32]),
    budget_blocks=st.integers(0, 5000),
)
def test_paging_never_fits_fewer(lengths, block_size, budget_blocks):
    max_len = 2048  # a multiple of every block size: a paged sequence never needs more than max_len
    bpt = mem.token_kv_bytes("Llama-3-8B")
    c = mem.concurrency(budget_blocks * block_size * bpt, "Llama-3-8B", lengths, max_len, block_size)
    assert c.paged_seqs >= c.contiguous_seqs
    assert 0 <= c.paged_waste < 1 and 0 <= c.contiguous_waste < 1
    assert c.paged_waste <= c.contiguous_waste + 1e-12
    # internal fragmentation is under one block per sequence
    assert c.paged_waste * sum(mem.blocks_for(n, block_size) * block_size for n in lengths) < len(lengths) * block_size
    assert 0 <= c.paged_used_bytes <= c.paged_reserved_bytes <= c.kv_budget_bytes
    assert 0 <= c.contiguous_used_bytes <= c.contiguous_reserved_bytes <= c.kv_budget_bytes


def test_format_bytes():
    assert mem.format_bytes(1536) == "1.5 KiB"
    assert mem.format_bytes(5 * GiB) == "5.00 GiB"
    assert mem.format_bytes(12) == "12 B"
    assert math.isinf(mem.Concurrency(0, 1, 16, 8, 0, 0, 3, 0.5, 0.0, 0, 0, 0, 0).gain)


def test_seed_scenario_recomputes_every_figure_by_hand():
    """The seed page's A100-40GB / 7B fp16 / 2,048-token scenario, each figure worked out by hand here."""
    s = mem.seed_scenario()
    f, claims = s["figures"], {c.number: c for c in s["claims"]}
    assert sorted(claims) == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    per_token = 2 * 32 * 32 * 128 * 2  # K and V, layers, KV heads, head_dim, fp16 bytes
    assert f["kv_bytes_per_token"] == per_token == 512 * 1024
    assert f["kv_bytes_per_sequence"] == 2048 * per_token == GiB
    assert f["weights_bytes"] == 14 * 10**9 and f["kv_budget_bytes"] == (40 - 14 - 2) * 10**9
    assert f["contiguous_seqs"] == 24 * 10**9 // GiB == 22  # not the page's 9
    assert f["tokens_per_reservation_for_9"] == pytest.approx(24e9 / 9 / per_token)
    n_blocks = 24 * 10**9 // (16 * per_token)
    assert f["paged_seqs_at_60pct_lengths"] == n_blocks // math.ceil(819 / 16) == 55
    assert f["continuous_over_static"] == pytest.approx(2576 / 1820) and round(2576 / 1820, 2) == 1.42
    assert f["continuous_over_naive"] == pytest.approx(3.07, abs=0.005)
    verdicts = {n: c.verdict for n, c in claims.items()}
    assert verdicts == {1: "reproduced", 2: "reproduced", 3: "inconsistent", 4: "inconsistent", 5: "off",
                        6: "reproduced", 7: "no method", 8: "inconsistent", 9: "inconsistent", 10: "reproduced"}
    assert claims[3].off_by == pytest.approx(9 / 22)
    assert claims[5].off_by == pytest.approx(3.5 / (24 / 9))
    assert "22, not 9" in claims[3].note and "1.42x" in claims[9].note and "2,576" in claims[8].note


def test_seed_scenario_follows_its_inputs():
    # An 80 GB device leaves 64 GB: 59 full reservations; a 4096-token max_len halves them.
    assert mem.seed_scenario(device_gb=80)["figures"]["contiguous_seqs"] == 64 * 10**9 // GiB == 59
    assert mem.seed_scenario(max_len=4096)["figures"]["contiguous_seqs"] == 24 * 10**9 // (2 * GiB) == 11
