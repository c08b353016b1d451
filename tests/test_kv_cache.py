"""The paged KV cache: layout, byte arithmetic, and the write through a slot mapping.

The central check: what kv_cache.write_kv stores through a block table's slot mapping is
exactly what attention.reference.gather_kv reads back through the same block table, for
sequences that grow in interleaved chunks over a shuffled pool.
"""
from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minipaged.parts import allocate_many, check_pool, check_table
from minipaged.runner import pad_block_tables
from minipaged.attention.reference import gather_kv
from minipaged.block_allocator import BlockAllocator
from minipaged.block_table import BlockTable
from minipaged.kv_cache import KVCache, dtype_bytes, kv_bytes_per_token, num_blocks_for_budget, write_kv


def test_layout_per_layer():
    c = KVCache(num_layers=3, num_blocks=7, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float16)
    assert len(c.k) == len(c.v) == 3
    for t in c.k + c.v:
        assert t.shape == (7, 4, 2, 8) and t.dtype == torch.float16 and t.is_contiguous()
    assert len({t.data_ptr() for t in c.k + c.v}) == 6, "every layer needs its own K and V storage"
    assert c.nbytes == 3 * 2 * 7 * 4 * 2 * 8 * 2
    assert "blocks=7x4" in repr(c)


def test_bytes_per_token_and_budget():
    # SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64.
    assert kv_bytes_per_token(30, 3, 64, torch.float16) == 2 * 30 * 3 * 64 * 2 == 23040
    assert kv_bytes_per_token(1, 1, 1) == 8  # float32 by default
    per_block = 23040 * 16
    assert num_blocks_for_budget(10 * per_block, 30, 3, 64, 16, torch.float16) == 10
    assert num_blocks_for_budget(10 * per_block + per_block - 1, 30, 3, 64, 16, torch.float16) == 10
    assert num_blocks_for_budget(per_block, 30, 3, 64, 16, torch.float16) == 1
    # The budget is what KVCache really allocates, never more.
    n = num_blocks_for_budget(2**20, 2, 2, 16, 8, torch.bfloat16)
    c = KVCache(2, n, 8, 2, 16, torch.bfloat16)
    assert c.nbytes <= 2**20 < c.nbytes + kv_bytes_per_token(2, 2, 16, torch.bfloat16) * 8


def test_budget_too_small_says_how_much_a_block_needs():
    with pytest.raises(ValueError) as e:
        num_blocks_for_budget(1000, 30, 3, 64, 16, torch.float16)
    msg = str(e.value)
    assert "1000 bytes holds no block" in msg and "368640 bytes" in msg and "larger budget" in msg


def test_unsupported_dtype_lists_supported_ones():
    with pytest.raises(ValueError, match=r"unsupported KV dtype torch.int8.*float16"):
        dtype_bytes(torch.int8)
    assert [dtype_bytes(d) for d in (torch.float32, torch.float16, torch.bfloat16)] == [4, 2, 2]


def test_write_puts_each_token_at_its_slot():
    k_cache = torch.zeros(3, 2, 1, 1)
    v_cache = torch.zeros(3, 2, 1, 1)
    k = torch.tensor([1.0, 2.0, 3.0]).view(3, 1, 1)
    write_kv(k_cache, v_cache, k, -k, torch.tensor([5, 0, 2]))  # slot = block * 2 + offset
    assert k_cache.flatten().tolist() == [2.0, 0.0, 3.0, 0.0, 0.0, 1.0]
    assert v_cache.flatten().tolist() == [-2.0, 0.0, -3.0, 0.0, 0.0, -1.0]


def test_write_casts_to_cache_dtype_and_leaves_other_slots_alone():
    c = KVCache(1, 2, 2, 1, 2, dtype=torch.float16)
    c.k[0].fill_(7)
    k = torch.full((1, 1, 2), 0.5, dtype=torch.float32)
    c.write(0, k, k, torch.tensor([1], dtype=torch.int32))
    assert c.k[0].dtype == torch.float16
    assert c.k[0].reshape(4, 2).tolist() == [[7, 7], [0.5, 0.5], [7, 7], [7, 7]]


@settings(max_examples=40, deadline=None)
@given(
    block_size=st.one_of(st.integers(1, 8), st.sampled_from([16, 64, 256])),
    num_seqs=st.integers(1, 4),
    num_kv_heads=st.integers(1, 3),
    head_dim=st.sampled_from([1, 4, 8]),
    seed=st.integers(0, 2**32 - 1),
)
def test_write_then_gather_by_block_table_round_trips(block_size, num_seqs, num_kv_heads, head_dim, seed):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    lengths = [rng.randint(1, 3 * block_size + 2) for _ in range(num_seqs)]
    num_blocks = sum(-(-n // block_size) for n in lengths) + rng.randint(0, 3)
    # A shuffled free list: tables get scattered, non-increasing block ids.
    alloc = BlockAllocator(num_blocks, block_size=block_size)
    taken = allocate_many(alloc, num_blocks)
    rng.shuffle(taken)
    for b in taken:
        alloc.free(b)
    num_layers = 2
    cache = KVCache(num_layers, num_blocks, block_size, num_kv_heads, head_dim)
    for layer in range(num_layers):  # garbage where nothing was written
        cache.k[layer].normal_(generator=gen)
        cache.v[layer].normal_(generator=gen)
    tables = [BlockTable(alloc) for _ in lengths]
    written = [[torch.empty(0, num_kv_heads, head_dim) for _ in range(2 * num_layers)] for _ in lengths]

    # Sequences grow in interleaved chunks, as a scheduler with a token budget would make them.
    pending = list(range(num_seqs))
    while pending:
        s = rng.choice(pending)
        t = tables[s]
        n = min(rng.randint(1, 2 * block_size + 1), lengths[s] - t.num_tokens)
        start = t.num_tokens
        t.append_tokens(n)
        slots = t.slot_mapping(start, start + n)
        for layer in range(num_layers):
            k = torch.randn(n, num_kv_heads, head_dim, generator=gen)
            v = torch.randn(n, num_kv_heads, head_dim, generator=gen)
            cache.write(layer, k, v, slots)
            written[s][2 * layer] = torch.cat([written[s][2 * layer], k])
            written[s][2 * layer + 1] = torch.cat([written[s][2 * layer + 1], v])
        if t.num_tokens == lengths[s]:
            pending.remove(s)
    check_pool(alloc)

    width = max(len(t.blocks) for t in tables) + 1  # padded rows, as a batch has them
    for s, t in enumerate(tables):
        check_table(t)
        row = pad_block_tables([t.blocks], width=width)[0]
        for layer in range(num_layers):
            got_k = gather_kv(cache.k[layer], row, lengths[s])
            got_v = gather_kv(cache.v[layer], row, lengths[s])
            assert torch.equal(got_k, written[s][2 * layer]), f"seq {s} layer {layer}: K read back differs"
            assert torch.equal(got_v, written[s][2 * layer + 1]), f"seq {s} layer {layer}: V read back differs"
            # Token by token, through (block, offset), as a learner would index it.
            for p in rng.sample(range(lengths[s]), min(3, lengths[s])):
                block, offset = t.blocks[p // t.block_size], p % t.block_size
                assert torch.equal(cache.k[layer][block, offset], written[s][2 * layer][p])


# -- sizing the pool from the configuration ----------------------------------------------------
def test_plan_num_blocks_follows_the_config_and_the_model_shape(monkeypatch):
    from minipaged import kv_cache
    from minipaged.config import EngineConfig

    monkeypatch.setattr(kv_cache, "available_memory_bytes", lambda device="cpu": 64 * 2**30)
    per_token = kv_bytes_per_token(30, 3, 64, torch.float32)  # SmolLM2-135M in fp32: 46,080 bytes
    assert per_token == 2 * 30 * 3 * 64 * 4
    shape = dict(num_layers=30, num_kv_heads=3, head_dim=64, max_model_len=2048)
    # num_blocks wins over everything
    assert kv_cache.plan_num_blocks(EngineConfig(num_blocks=7, kv_cache_bytes=10**9), **shape) == 7
    # a budget: whole blocks only
    cfg = EngineConfig(block_size=16, kv_cache_bytes=100 * per_token * 16 + 5)
    assert kv_cache.plan_num_blocks(cfg, **shape) == 100
    # never more than max_num_seqs full-length sequences could use
    cfg = EngineConfig(block_size=16, kv_cache_bytes=2**30, max_num_seqs=2)
    assert kv_cache.plan_num_blocks(cfg, **shape) == 2 * (2048 // 16)
    # block size changes the count, bytes per block scale with it
    cfg = EngineConfig(block_size=32, kv_cache_bytes=100 * per_token * 16)
    assert kv_cache.plan_num_blocks(cfg, **shape) == 50


def test_plan_num_blocks_refuses_a_budget_past_the_memory_there_is(monkeypatch):
    from minipaged import kv_cache
    from minipaged.config import EngineConfig

    monkeypatch.setattr(kv_cache, "available_memory_bytes", lambda device="cpu": 2**30)
    shape = dict(num_layers=30, num_kv_heads=3, head_dim=64, max_model_len=2048)
    with pytest.raises(ValueError, match=r"kv_cache_bytes=2147483648 \(2.00 GiB\) is more than the memory available.*1.00 GiB free"):
        kv_cache.plan_num_blocks(EngineConfig(kv_cache_bytes=2**31), **shape)
    with pytest.raises(ValueError, match=r"num_blocks=100000 .* is more than the memory available"):
        kv_cache.plan_num_blocks(EngineConfig(num_blocks=100000), **shape)
    with pytest.raises(ValueError, match="holds no block"):
        kv_cache.plan_num_blocks(EngineConfig(kv_cache_bytes=10), **shape)
