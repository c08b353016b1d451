"""Paged attention in plain PyTorch: the oracle every other backend is checked against.

Owns the maths only: gather a sequence's K/V through its block table, expand KV heads
for grouped-query attention, softmax in fp32, causal within the new tokens. It does not
write the cache (see kv_cache.write_kv) and does not decide who runs (the scheduler).
"""
from __future__ import annotations

import torch

from ..kv_quant import read_blocks
from ..parts import cdiv


def gather_kv(
    cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
    block_table: torch.Tensor,  # (max_blocks,) int: physical block ids of one sequence
    context_len: int,
) -> torch.Tensor:
    """The first ``context_len`` tokens of one sequence, contiguous: (context_len, num_kv_heads, head_dim).
    A quantized cache (kv_quant.py) comes back dequantized, in fp32: each block times its scales."""
    block_size = cache.shape[1]
    n_blocks = cdiv(context_len, block_size)
    blocks = read_blocks(cache, block_table[:n_blocks].long())  # (n_blocks, block_size, H_kv, D)
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
    if out is None:
        out = torch.empty_like(q)
    qsl = query_start_loc.tolist()
    ctx = context_lens.tolist()
    q_lens = [qsl[s + 1] - qsl[s] for s in range(len(ctx))]
    # Decode rows (one query each) are done together; it is the same maths, batched.
    decode = [s for s, n in enumerate(q_lens) if n == 1]
    if decode:
        idx = torch.tensor(decode, dtype=torch.long, device=q.device)
        rows = query_start_loc[:-1].long()[idx]
        out[rows] = _decode_batched(q[rows], k_cache, v_cache, block_tables[idx], context_lens[idx], scale).to(out.dtype)
    for s in range(len(ctx)):
        q0, q1 = qsl[s], qsl[s + 1]
        q_len, c_len = q1 - q0, ctx[s]
        if q_len <= 1:
            continue
        if q_len > c_len:
            raise ValueError(f"sequence {s}: {q_len} new tokens but context_len is only {c_len}")
        k = gather_kv(k_cache, block_tables[s], c_len).float()  # (C, H_kv, D)
        v = gather_kv(v_cache, block_tables[s], c_len).float()
        out[q0:q1] = _attend(q[q0:q1].float(), k, v, scale, c_len - q_len).to(out.dtype)
    return out


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, first_pos: int) -> torch.Tensor:
    """q: (Q, H, D) at positions first_pos..first_pos+Q-1; k, v: (C, H_kv, D). Returns (Q, H, D)."""
    Q, H, D = q.shape
    C, H_kv, _ = k.shape
    qg = q.view(Q, H_kv, H // H_kv, D)  # GQA: query head h reads KV head h // group
    scores = torch.einsum("qhgd,khd->hgqk", qg, k) * scale  # (H_kv, G, Q, C)
    q_pos = torch.arange(first_pos, first_pos + Q, device=q.device).unsqueeze(1)  # (Q, 1)
    k_pos = torch.arange(C, device=q.device).unsqueeze(0)  # (1, C)
    scores = scores.masked_fill(k_pos > q_pos, float("-inf"))  # causal: no peeking at later tokens
    probs = torch.softmax(scores, dim=-1)  # fp32, max-subtracted inside
    return torch.einsum("hgqk,khd->qhgd", probs, v).reshape(Q, H, D)


def _decode_batched(
    q: torch.Tensor,  # (S, H, D): one query per sequence
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # (S, max_blocks)
    context_lens: torch.Tensor,  # (S,)
    scale: float,
) -> torch.Tensor:
    S, H, D = q.shape
    block_size, H_kv = k_cache.shape[1], k_cache.shape[2]
    n_blocks = cdiv(int(context_lens.max()), block_size)
    bt = block_tables[:, :n_blocks].long()
    k = read_blocks(k_cache, bt.reshape(-1)).reshape(S, n_blocks * block_size, H_kv, D).float()  # (S, C, H_kv, D), padded
    v = read_blocks(v_cache, bt.reshape(-1)).reshape(S, n_blocks * block_size, H_kv, D).float()
    qg = q.float().view(S, H_kv, H // H_kv, D)
    scores = torch.einsum("shgd,schd->shgc", qg, k) * scale  # (S, H_kv, G, C)
    pad = torch.arange(n_blocks * block_size, device=q.device)[None, :] >= context_lens[:, None].long()  # (S, C)
    scores = scores.masked_fill(pad[:, None, None, :], float("-inf"))  # slots past the context are not tokens
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("shgc,schd->shgd", probs, v).reshape(S, H, D)
