"""The PyTorch serving path: the reference's maths through PyTorch's fused attention, batched.

Owns speed on a CPU (and on a GPU without Triton). It never writes the cache and never decides
who runs; reference.py remains the oracle it is tested against (tests/test_attention_fast.py).

- Decode: ONE call per layer covers every decode sequence. Their blocks are gathered with one
  ``index_select`` through the block table into a padded (S, H_kv, C, D) view, and one
  ``scaled_dot_product_attention`` with a length mask attends all S queries at once. Only when
  contexts are so unequal that padding would more than double the work (``DECODE_PAD_LIMIT``)
  are they cut into at most ``DECODE_MAX_GROUPS`` calls of similar lengths.
- Prefill and chunked prefill: batched the same way (queries padded to the longest new chunk,
  keys to the longest context, a causal-with-offset mask) when padding wastes at most
  ``PREFILL_PAD_LIMIT`` times the real work; otherwise one SDPA call per sequence.

The runner puts decode sequences first and says how many (``num_decodes``); given no count,
this module finds the one-query sequences itself, wherever they sit in the batch.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kv_quant import read_blocks

# Batch the prefills into one padded call while padded work <= this x the real work
# (sum of q_len * context_len). Above it, one call per sequence wastes less.
PREFILL_PAD_LIMIT = 2.0
# Decodes: one call while padding every context to the longest costs <= this x the real work;
# past it (very unequal contexts) at most DECODE_MAX_GROUPS calls, longest contexts together.
DECODE_PAD_LIMIT = 2.0
DECODE_MAX_GROUPS = 4


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """q: (B, H, Q, D); k, v: (B, H_kv, C, D); mask: bool, True where a key may be seen."""
    try:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    except TypeError:  # torch < 2.5 has no enable_gqa: expand the KV heads instead
        g = q.shape[1] // k.shape[1]
        return F.scaled_dot_product_attention(
            q, k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1), attn_mask=mask, scale=scale
        )


def _gather_padded(cache: torch.Tensor, block_tables: torch.Tensor, n_blocks: int,
                   dtype: torch.dtype | None = None) -> torch.Tensor:
    """The first ``n_blocks`` blocks of every row of ``block_tables``: (S, H_kv, n_blocks * block_size, D).
    A quantized cache (kv_quant.py) is dequantized to ``dtype`` (the queries') as it is gathered.

    ``index_select`` on a flat id list is several times faster on a CPU than ``cache[table]``."""
    S = block_tables.shape[0]
    _, block_size, h_kv, d = cache.shape
    ids = block_tables[:, :n_blocks].reshape(-1).long()
    return read_blocks(cache, ids, dtype).view(S, n_blocks * block_size, h_kv, d).transpose(1, 2)


def decode_attention(
    q: torch.Tensor,  # (S, H, D): one query per sequence, the sequence's last position
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # (S, max_blocks)
    context_lens: torch.Tensor,  # (S,)
    scale: float,
    max_context_len: int | None = None,
) -> torch.Tensor:
    """All decode sequences in one SDPA call over a padded gather -> (S, H, D)."""
    S, H, D = q.shape
    block_size = k_cache.shape[1]
    c_max = int(context_lens.max()) if max_context_len is None else max_context_len
    n_blocks = -(-c_max // block_size)
    k = _gather_padded(k_cache, block_tables, n_blocks, q.dtype)
    v = _gather_padded(v_cache, block_tables, n_blocks, q.dtype)
    C = n_blocks * block_size
    mask = (torch.arange(C, device=q.device)[None, :] < context_lens[:, None].long())[:, None, None, :]
    return _sdpa(q.view(S, H, 1, D), k, v, mask, scale).view(S, H, D)


def _prefill_one(q, k_cache, v_cache, table, c_len, scale):
    """One sequence's q_len new tokens (its last positions) over its whole context: (Q, H, D)."""
    q_len = q.shape[0]
    block_size = k_cache.shape[1]
    n_blocks = -(-c_len // block_size)
    k = _gather_padded(k_cache, table[None], n_blocks, q.dtype)[:, :, :c_len]  # (1, H_kv, C, D)
    v = _gather_padded(v_cache, table[None], n_blocks, q.dtype)[:, :, :c_len]
    q_pos = torch.arange(c_len - q_len, c_len, device=q.device)[:, None]
    mask = torch.arange(c_len, device=q.device)[None, :] <= q_pos  # causal over the cached prefix too
    return _sdpa(q.transpose(0, 1)[None], k, v, mask, scale)[0].transpose(0, 1)


def _prefill_padded(q, k_cache, v_cache, block_tables, context_lens, q_lens, scale, q_max, c_max):
    """P prefill (or chunk) sequences in one padded SDPA call; returns their packed (sum q_len, H, D)."""
    P = block_tables.shape[0]
    H, D = q.shape[1], q.shape[2]
    block_size = k_cache.shape[1]
    dev = q.device
    n_blocks = -(-c_max // block_size)
    k = _gather_padded(k_cache, block_tables, n_blocks, q.dtype)  # (P, H_kv, C, D)
    v = _gather_padded(v_cache, block_tables, n_blocks, q.dtype)
    C = n_blocks * block_size
    ql = q_lens.to(dev).long()
    cl = context_lens.long()
    # packed row r of sequence p at offset i  ->  padded row p * q_max + i
    seq_of_row = torch.repeat_interleave(torch.arange(P, device=dev), ql)
    offset = torch.arange(int(ql.sum()), device=dev) - (torch.cumsum(ql, 0) - ql)[seq_of_row]
    padded_row = seq_of_row * q_max + offset
    qp = q.new_zeros(P * q_max, H, D)
    qp.index_copy_(0, padded_row, q)
    qp = qp.view(P, q_max, H, D).transpose(1, 2)  # (P, H, Q, D)
    i = torch.arange(q_max, device=dev)
    q_pos = (cl - ql)[:, None] + i[None, :]  # (P, Q): each query's position in its sequence
    j = torch.arange(C, device=dev)
    mask = j[None, None, :] <= q_pos[:, :, None]  # (P, Q, C): causal with the cached prefix
    mask |= (i[None, :, None] >= ql[:, None, None]) & (j[None, None, :] == 0)  # padded query rows see key 0
    o = _sdpa(qp, k, v, mask[:, None], scale)  # (P, H, Q, D)
    return o.transpose(1, 2).reshape(P * q_max, H, D).index_select(0, padded_row)


def decode_groups(context_lens: list[int], pad_limit: float | None = None, max_groups: int | None = None) -> list[list[int]]:
    """Which decode sequences to attend together: one group (one SDPA call) unless padding every
    context to the longest would do more than ``pad_limit`` x the real work; then the sequences,
    longest first, are cut into at most ``max_groups`` groups that each keep within the limit
    (the last takes the rest). Returns lists of indices into ``context_lens``."""
    pad_limit = DECODE_PAD_LIMIT if pad_limit is None else pad_limit
    max_groups = DECODE_MAX_GROUPS if max_groups is None else max_groups
    n = len(context_lens)
    if n == 0:
        return []
    if n * max(context_lens) <= pad_limit * sum(context_lens):
        return [list(range(n))]
    order = sorted(range(n), key=lambda i: -context_lens[i])
    groups: list[list[int]] = []
    for i in order:
        g = groups[-1] if groups else None
        if g is not None and (len(groups) == max_groups or
                              (len(g) + 1) * context_lens[g[0]] <= pad_limit * (sum(context_lens[j] for j in g) + context_lens[i])):
            g.append(i)
        else:
            groups.append([i])
    return groups


def _plan(query_start_loc: torch.Tensor, context_lens: torch.Tensor, num_decodes: int | None):
    """(qsl, ctx, q_lens, num_decodes, decodes, rest) for one step's metadata, validated."""
    num_seqs = context_lens.shape[0]
    qsl = query_start_loc.tolist()
    ctx = context_lens.tolist()
    q_lens = [qsl[s + 1] - qsl[s] for s in range(num_seqs)]
    for s, (n, c) in enumerate(zip(q_lens, ctx)):
        if not 0 <= n <= c:
            raise ValueError(f"sequence {s}: {n} new tokens but context_len is only {c}; need 0 <= new tokens <= context_len")
    if num_decodes is not None:
        if not 0 <= num_decodes <= num_seqs or qsl[num_decodes] != num_decodes:
            raise ValueError(
                f"num_decodes={num_decodes} but the first sequences' query lengths are {q_lens[:num_decodes + 1]}: "
                "the first num_decodes sequences must have exactly one query each (put decodes first, or pass None)"
            )
        decodes = None  # a prefix: rows 0 .. num_decodes - 1
        rest = list(range(num_decodes, num_seqs))
    else:
        ones = [s for s, n in enumerate(q_lens) if n == 1]
        num_decodes = len(ones)
        if ones == list(range(num_decodes)):
            decodes, rest = None, list(range(num_decodes, num_seqs))
        else:
            decodes = ones
            rest = [s for s, n in enumerate(q_lens) if n != 1]
    return qsl, ctx, q_lens, num_decodes, decodes, rest


def paged_attention(
    q: torch.Tensor,  # (num_tokens, num_heads, head_dim)
    k_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # (num_seqs, max_blocks) int32
    context_lens: torch.Tensor,  # (num_seqs,) int32
    query_start_loc: torch.Tensor,  # (num_seqs + 1,) int32
    scale: float,
    out: torch.Tensor | None = None,
    *,
    num_decodes: int | None = None,
) -> torch.Tensor:
    """Same signature and result as reference.paged_attention (to fp32 rounding).

    ``num_decodes``: the first ``num_decodes`` sequences have exactly one query each (the
    runner orders them so); None finds every one-query sequence wherever it is.
    """
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    if out is None:
        out = torch.empty_like(q)
    qsl, ctx, q_lens, num_decodes, decodes, rest = _plan(query_start_loc, context_lens, num_decodes)
    if num_decodes:
        dec = list(range(num_decodes)) if decodes is None else decodes
        groups = decode_groups([ctx[s] for s in dec])
        if len(groups) == 1 and decodes is None:  # the common case: one call, no row shuffling
            o = decode_attention(q[:num_decodes], k_cache, v_cache, block_tables[:num_decodes],
                                 context_lens[:num_decodes], scale, max(ctx[:num_decodes]))
            out[:num_decodes] = o.to(out.dtype)
        else:
            for group in groups:
                seqs = [dec[i] for i in group]
                idx = torch.tensor(seqs, dtype=torch.long, device=q.device)
                rows = torch.tensor([qsl[s] for s in seqs], dtype=torch.long, device=q.device)
                o = decode_attention(q[rows], k_cache, v_cache, block_tables[idx], context_lens[idx], scale,
                                     max(ctx[s] for s in seqs))
                out[rows] = o.to(out.dtype)
    rest = [s for s in rest if q_lens[s] > 0]  # a sequence with no new token has nothing to attend
    if not rest:
        return out
    q_max = max(q_lens[s] for s in rest)
    c_max = max(ctx[s] for s in rest)
    real = sum(q_lens[s] * ctx[s] for s in rest)
    if len(rest) > 1 and len(rest) * q_max * c_max <= PREFILL_PAD_LIMIT * real:
        idx = torch.tensor(rest, dtype=torch.long, device=q.device)
        contiguous = rest == list(range(rest[0], rest[-1] + 1))
        if contiguous:
            lo, hi = qsl[rest[0]], qsl[rest[-1] + 1]
            rows = None
            qq = q[lo:hi]
        else:
            rows = torch.cat([torch.arange(qsl[s], qsl[s + 1], device=q.device) for s in rest])
            qq = q[rows]
        ql = torch.tensor([q_lens[s] for s in rest], dtype=torch.long, device=q.device)
        o = _prefill_padded(qq, k_cache, v_cache, block_tables[idx], context_lens[idx], ql, scale, q_max, c_max)
        if rows is None:
            out[lo:hi] = o.to(out.dtype)
        else:
            out[rows] = o.to(out.dtype)
        return out
    for s in rest:
        q0, q1 = qsl[s], qsl[s + 1]
        out[q0:q1] = _prefill_one(q[q0:q1], k_cache, v_cache, block_tables[s], ctx[s], scale).to(out.dtype)
    return out
