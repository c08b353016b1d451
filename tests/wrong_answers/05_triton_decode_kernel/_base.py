"""A Triton decode kernel with switches for the classic mistakes (not a wrong answer itself)."""
import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
import triton
import triton.language as tl


@triton.jit
def decode_kernel(out_ptr, q_ptr, k_ptr, v_ptr, bt_ptr, ctx_ptr, scale, bt_stride,
                  NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                  USE_TABLE: tl.constexpr, MASK_TAIL: tl.constexpr, GQA_DIV: tl.constexpr, RESCALE: tl.constexpr,
                  MAX_FROM_ZERO: tl.constexpr = False):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    if GQA_DIV:
        kv_head = head // (NUM_HEADS // NUM_KV_HEADS)
    else:
        kv_head = head % NUM_KV_HEADS
    ctx = tl.load(ctx_ptr + seq)
    d = tl.arange(0, HEAD_DIM)
    t = tl.arange(0, BLOCK_SIZE)
    q = tl.load(q_ptr + (seq * NUM_HEADS + head) * HEAD_DIM + d).to(tl.float32)
    m = float("-inf")
    if MAX_FROM_ZERO:
        m = 0.0
    l = 0.0
    acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
    for i in range(0, tl.cdiv(ctx, BLOCK_SIZE)):
        if USE_TABLE:
            block = tl.load(bt_ptr + seq * bt_stride + i).to(tl.int64)
        else:
            block = i
        if MASK_TAIL:
            valid = i * BLOCK_SIZE + t < ctx
        else:
            valid = t < BLOCK_SIZE
        offs = ((block * BLOCK_SIZE + t[:, None]) * NUM_KV_HEADS + kv_head) * HEAD_DIM + d[None, :]
        k = tl.load(k_ptr + offs, mask=valid[:, None], other=0.0).to(tl.float32)
        s = tl.where(valid, tl.sum(k * q[None, :], axis=1) * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=0))
        p = tl.exp(s - m_new)
        alpha = tl.exp(m - m_new)
        if not RESCALE:
            alpha = 1.0
        v = tl.load(v_ptr + offs, mask=valid[:, None], other=0.0).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        l = l * alpha + tl.sum(p, axis=0)
        m = m_new
    tl.store(out_ptr + (seq * NUM_HEADS + head) * HEAD_DIM + d, acc / l)


def make(use_table=True, mask_tail=True, gqa_div=True, rescale=True, max_from_zero=False):
    def paged_decode(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale, out=None):
        num_seqs, num_heads, head_dim = q.shape
        _, block_size, num_kv_heads, _ = k_cache.shape
        o = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        bt = block_tables.contiguous()
        decode_kernel[(num_seqs, num_heads)](
            o, q.contiguous(), k_cache, v_cache, bt, context_lens, scale, bt.shape[1],
            NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
            USE_TABLE=use_table, MASK_TAIL=mask_tail, GQA_DIV=gqa_div, RESCALE=rescale,
            MAX_FROM_ZERO=max_from_zero)
        return o.to(q.dtype)
    return paged_decode
