"""The PyTorch serving path: the reference's maths through PyTorch's fused attention.

Owns speed on a CPU (and on a GPU without Triton): the same gather through block tables as
reference.py, but each score matrix is handled by ``scaled_dot_product_attention``
instead of explicit einsum + softmax, and decode sequences are batched in groups of similar
context length so that padding stays small. reference.py remains the oracle it is tested against.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .reference import gather_kv

DECODE_GROUP = 8  # decode sequences attended together, each group padded to its longest context


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """q: (B, H, Q, D); k, v: (B, H_kv, C, D); mask: bool, True where a key may be seen."""
    try:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    except TypeError:  # torch < 2.5 has no enable_gqa: expand the KV heads instead
        g = q.shape[1] // k.shape[1]
        return F.scaled_dot_product_attention(
            q, k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1), attn_mask=mask, scale=scale
        )


def _decode(q, k_cache, v_cache, block_tables, context_lens, scale):
    """q: (S, H, D), one query per sequence -> (S, H, D)."""
    S, H, D = q.shape
    block_size, H_kv = k_cache.shape[1], k_cache.shape[2]
    n_blocks = -(-int(context_lens.max()) // block_size)
    bt = block_tables[:, :n_blocks].long()
    C = n_blocks * block_size
    k = k_cache[bt].view(S, C, H_kv, D).transpose(1, 2)  # (S, H_kv, C, D)
    v = v_cache[bt].view(S, C, H_kv, D).transpose(1, 2)
    mask = (torch.arange(C, device=q.device)[None, :] < context_lens[:, None].long())[:, None, None, :]
    return _sdpa(q.view(S, H, 1, D), k, v, mask, scale).view(S, H, D)


def paged_attention(
    q: torch.Tensor,  # (num_tokens, num_heads, head_dim)
    k_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # (num_seqs, max_blocks) int32
    context_lens: torch.Tensor,  # (num_seqs,) int32
    query_start_loc: torch.Tensor,  # (num_seqs + 1,) int32
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same signature and result as reference.paged_attention (to fp32 rounding)."""
    if out is None:
        out = torch.empty_like(q)
    qsl = query_start_loc.tolist()
    ctx = context_lens.tolist()
    q_lens = [qsl[s + 1] - qsl[s] for s in range(len(ctx))]
    decode = sorted((s for s, n in enumerate(q_lens) if n == 1), key=lambda s: ctx[s])
    for g in range(0, len(decode), DECODE_GROUP):
        idx = torch.tensor(decode[g : g + DECODE_GROUP], dtype=torch.long, device=q.device)
        rows = query_start_loc[:-1].long()[idx]
        out[rows] = _decode(q[rows], k_cache, v_cache, block_tables[idx], context_lens[idx], scale).to(out.dtype)
    for s, q_len in enumerate(q_lens):
        if q_len <= 1:
            continue
        c_len, q0 = ctx[s], qsl[s]
        if q_len > c_len:
            raise ValueError(f"sequence {s}: {q_len} new tokens but context_len is only {c_len}")
        k = gather_kv(k_cache, block_tables[s], c_len).transpose(0, 1)[None]  # (1, H_kv, C, D)
        v = gather_kv(v_cache, block_tables[s], c_len).transpose(0, 1)[None]
        q_pos = torch.arange(c_len - q_len, c_len, device=q.device)[:, None]
        mask = torch.arange(c_len, device=q.device)[None, :] <= q_pos  # causal over the cached prefix too
        o = _sdpa(q[q0 : q0 + q_len].transpose(0, 1)[None], k, v, mask, scale)  # (1, H, Q, D)
        out[q0 : q0 + q_len] = o[0].transpose(0, 1).to(out.dtype)
    return out
