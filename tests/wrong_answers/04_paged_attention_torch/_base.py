"""A learner-style paged attention with switches for the classic mistakes (not a wrong answer itself)."""
import torch


def attention(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale, *,
              stable=True, gqa="div", use_table=True, mask_partial=True, causal_offset=True, mask_decode=True,
              max_floor=None, mask_value=float("-inf"), diagonal=True, scaled=True):
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    group = q.shape[1] // num_kv_heads
    out = torch.empty_like(q)
    for s in range(len(context_lens)):
        q0, q1 = int(query_start_loc[s]), int(query_start_loc[s + 1])
        ctx, q_len = int(context_lens[s]), q1 - q0
        n_blocks = -(-ctx // block_size)
        rows = block_tables[s, :n_blocks].long() if use_table else torch.arange(n_blocks)
        k = k_cache[rows].reshape(-1, num_kv_heads, head_dim)
        v = v_cache[rows].reshape(-1, num_kv_heads, head_dim)
        if mask_partial:
            k, v = k[:ctx], v[:ctx]
        if gqa == "div":
            heads = torch.arange(q.shape[1]) // group
        elif gqa == "first_kv_head_last":  # heads past the first group read the last KV head
            heads = torch.clamp(torch.arange(q.shape[1]), max=num_kv_heads - 1)
        else:
            heads = torch.arange(q.shape[1]) % num_kv_heads
        k, v = k[:, heads].float(), v[:, heads].float()
        scores = torch.einsum("qhd,khd->hqk", q[q0:q1].float(), k) * (scale if scaled else 1.0)
        first = ctx - q_len if causal_offset else 0
        q_pos = torch.arange(first, first + q_len)[:, None]
        k_pos = torch.arange(k.shape[0])[None, :]
        if mask_decode or q_len > 1:
            scores = scores.masked_fill((k_pos > q_pos) if diagonal else (k_pos >= q_pos), mask_value)
        if stable and max_floor is not None:
            p = torch.exp(scores - scores.amax(-1, keepdim=True).clamp(min=max_floor))
        elif stable:
            p = torch.exp(scores - scores.amax(-1, keepdim=True))
        else:
            p = torch.exp(scores)
        p = p / p.sum(-1, keepdim=True)
        out[q0:q1] = torch.einsum("hqk,khd->qhd", p, v).to(q.dtype)
    return out
