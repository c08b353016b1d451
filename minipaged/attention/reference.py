"""Paged attention in plain PyTorch: the oracle every other backend is checked against.

Owns the maths only: gather a sequence's K/V through its block table, expand KV heads
for grouped-query attention, softmax in fp32, causal within the new tokens. It does not
write the cache (see kv_cache.write_kv) and does not decide who runs (the scheduler).
"""
from __future__ import annotations

import torch


def gather_kv(
    cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
    block_table: torch.Tensor,  # (max_blocks,) int: physical block ids of one sequence
    context_len: int,
) -> torch.Tensor:
    """The first ``context_len`` tokens of one sequence, contiguous: (context_len, num_kv_heads, head_dim)."""
    block_size = cache.shape[1]
    n_blocks = -(-context_len // block_size)
    blocks = cache[block_table[:n_blocks].long()]  # (n_blocks, block_size, H_kv, D)
    return blocks.reshape(-1, *cache.shape[2:])[:context_len]


def paged_attention(
    q: torch.Tensor,  # (num_tokens, num_heads, head_dim): new tokens of all sequences, packed
    k_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim), new K already written
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # (num_seqs, max_blocks_per_seq) int32
    context_lens: torch.Tensor,  # (num_seqs,) int32: cached prefix + new tokens, per sequence
    query_start_loc: torch.Tensor,  # (num_seqs + 1,) int32: cumulative query lengths, starts at 0
    scale: float,
    out: torch.Tensor | None = None,  # (num_tokens, num_heads, head_dim), written in place if given
) -> torch.Tensor:
    """Attention of each sequence's new tokens over its whole context in the paged cache.

    Sequence ``s`` owns query rows ``query_start_loc[s] : query_start_loc[s+1]`` (``q_len`` of
    them). They are its *last* ``q_len`` positions, so query ``i`` sits at position
    ``context_len - q_len + i`` and may see keys ``0 .. context_len - q_len + i``. Decode is
    ``q_len == 1``; prefill is ``q_len == context_len``; chunked prefill is anything between.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(q)
    qsl = query_start_loc.tolist()
    ctx = context_lens.tolist()
    for s in range(len(ctx)):
        q0, q1 = qsl[s], qsl[s + 1]
        q_len, c_len = q1 - q0, ctx[s]
        if q_len == 0:
            continue
        if q_len > c_len:
            raise ValueError(f"sequence {s}: {q_len} new tokens but context_len is only {c_len}")
        k = gather_kv(k_cache, block_tables[s], c_len).float()  # (C, H_kv, D)
        v = gather_kv(v_cache, block_tables[s], c_len).float()
        # GQA: query head h reads KV head h // group.
        k = k.repeat_interleave(group, dim=1)  # (C, H, D)
        v = v.repeat_interleave(group, dim=1)
        qs = q[q0:q1].float()  # (Q, H, D)
        scores = torch.einsum("qhd,khd->hqk", qs, k) * scale  # (H, Q, C)
        q_pos = torch.arange(c_len - q_len, c_len).unsqueeze(1)  # (Q, 1)
        k_pos = torch.arange(c_len).unsqueeze(0)  # (1, C)
        scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
        probs = torch.softmax(scores, dim=-1)  # fp32 softmax, max-subtracted inside
        out[q0:q1] = torch.einsum("hqk,khd->qhd", probs, v).to(out.dtype)
    return out
