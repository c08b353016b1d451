"""Paged attention in Triton: store K/V through the slot mapping, paged decode, paged prefill.

Owns three kernels and their launch wrappers, with the signatures of kv_cache.write_kv and
reference.paged_attention (the spec every kernel here is tested against). It does not choose
the backend: attention/__init__.py does, and turns on Triton's CPU interpreter without a GPU.

    write_kv         one program per new token: copy its K and V rows to their slot
    paged_decode     one query token per sequence; a program owns (sequence, KV head[, split])
    paged_prefill    packed new tokens of several sequences (prefill, chunked prefill, prefix reuse)
    paged_attention  the engine's entry point: decode if every sequence has one new token, else prefill

Cache layout (see kv_cache.py): K and V are (num_blocks, block_size, num_kv_heads, head_dim), any
strides; token ``t`` of a sequence lives in block ``block_table[t // block_size]`` at row
``t % block_size``.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

LOG2E = 1.4426950408889634  # exp(x) == exp2(x * LOG2E); exp2 is the instruction the GPU has


# ----------------------------------------------------------------------------------------------
# Kernel 1: store K/V through the slot mapping
# ----------------------------------------------------------------------------------------------
@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr,  # (num_tokens, num_kv_heads, head_dim): the new tokens' K and V
    k_cache_ptr, v_cache_ptr,  # (num_blocks, block_size, num_kv_heads, head_dim)
    slot_ptr,  # (num_tokens,) int: block_id * block_size + offset; negative = padding, skip
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kcb, stride_kct, stride_kch, stride_kcd,
    stride_vcb, stride_vct, stride_vch, stride_vcd,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # A program owns one new token: all its KV heads, for K and for V.
    token = tl.program_id(0).to(tl.int64)
    # int64: block_id * block_size * heads * head_dim passes 2**31 in a large pool.
    slot = tl.load(slot_ptr + token).to(tl.int64)
    block = slot // BLOCK_SIZE
    row = slot % BLOCK_SIZE
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    num_heads = tl.where(slot >= 0, NUM_KV_HEADS, 0)  # a padding token writes nothing
    mask = (offs_h[:, None] < num_heads) & (offs_d[None, :] < HEAD_DIM)

    k = tl.load(k_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd, mask=mask)
    v = tl.load(v_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd, mask=mask)
    k_dst = k_cache_ptr + block * stride_kcb + row * stride_kct + offs_h[:, None] * stride_kch + offs_d[None, :] * stride_kcd
    v_dst = v_cache_ptr + block * stride_vcb + row * stride_vct + offs_h[:, None] * stride_vch + offs_d[None, :] * stride_vcd
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------
# Kernel 2: paged decode (the workbook's model answer)
# ----------------------------------------------------------------------------------------------
@triton.jit
def _paged_decode_kernel(
    out_ptr,  # (num_seqs, num_heads, head_dim): written when NUM_SPLITS == 1
    part_acc_ptr, part_m_ptr, part_l_ptr,  # split-KV scratch, written when NUM_SPLITS > 1
    q_ptr,  # (num_seqs, num_heads, head_dim): one new token per sequence
    k_cache_ptr, v_cache_ptr,  # (num_blocks, block_size, num_kv_heads, head_dim)
    k_scale_ptr, v_scale_ptr,  # (num_blocks, num_kv_heads) fp32: a quantized cache's scales (QUANT)
    block_tables_ptr,  # (num_seqs, max_blocks) int32
    context_lens_ptr,  # (num_seqs,) int32
    qk_scale,  # softmax scale * log2(e)
    tokens_per_split,  # a multiple of TILE
    stride_qs, stride_qh, stride_qd,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_vb, stride_vt, stride_vh, stride_vd,
    stride_bts, stride_btb,
    stride_os, stride_oh, stride_od,
    stride_pas, stride_pah, stride_pak,  # part_acc: (num_seqs, num_heads, NUM_SPLITS, head_dim)
    stride_pms, stride_pmh,  # part_m, part_l: (num_seqs, num_heads, NUM_SPLITS)
    stride_ksb, stride_ksh, stride_vsb, stride_vsh,  # the scales' strides (0, 0 for one scale per layer)
    QUANT: tl.constexpr,  # the cache holds fp8/int8: each K/V row is multiplied by its (block, head) scale
    QUERIES_PER_KV: tl.constexpr,  # GQA group: query heads that share one KV head
    HEADS_PER_PROGRAM: tl.constexpr,  # QUERIES_PER_KV (grouped), or 1 to switch grouping off
    BLOCK_H: tl.constexpr,  # HEADS_PER_PROGRAM padded to a power of two >= 16 (tl.dot's minimum)
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,  # BLOCK_D: HEAD_DIM padded to a power of two
    BLOCK_SIZE: tl.constexpr,  # tokens per KV block (page)
    TILE: tl.constexpr,  # tokens of context handled per loop iteration
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 (no tf32 rounding), else the default
):
    # What a program owns: one sequence, HEADS_PER_PROGRAM query heads that all read the same KV
    # head, and one split (a range of the context; the whole context when NUM_SPLITS == 1).
    # Splits exist for small batches: 1 sequence x 8 KV heads is 8 programs, far too few to keep
    # a GPU's ~100 SMs reading, so a long context is cut into ranges read in parallel and
    # _split_kv_reduce_kernel merges their partial softmaxes.
    #
    # Why GQA grouping saves bandwidth: decode does ~2 flops per byte of K/V it reads, so its
    # time is the time to read the cache. With 32 query heads over 8 KV heads, a program per
    # query head would read each KV block 4 times; a program per KV head reads it once and
    # scores all 4 query heads against it (4 rows of one small matrix product).
    seq = tl.program_id(0).to(tl.int64)
    first_head = tl.program_id(1) * HEADS_PER_PROGRAM
    kv_head = (first_head // QUERIES_PER_KV).to(tl.int64)
    split = tl.program_id(2)

    offs_h = tl.arange(0, BLOCK_H)
    heads = (first_head + offs_h).to(tl.int64)  # rows: the query heads of this group
    head_mask = offs_h < HEADS_PER_PROGRAM  # rows past the group are padding for tl.dot
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM  # head_dim need not be a power of two (masked columns load 0)
    offs_t = tl.arange(0, TILE)

    context_len = tl.load(context_lens_ptr + seq)
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, context_len)

    q = tl.load(
        q_ptr + seq * stride_qs + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
        mask=head_mask[:, None] & d_mask[None, :], other=0.0,
    )
    if QUANT:
        q = q.to(tl.float32)  # the pages are dequantized to fp32 as they are read
    else:
        q = q.to(k_cache_ptr.dtype.element_ty)  # (BLOCK_H, BLOCK_D), in the cache's dtype for tl.dot

    # Online softmax, per query head (row), in fp32. After the tiles seen so far:
    #   m   = the largest score so far (in log2 units),
    #   l   = sum of exp2(score - m) over those tokens,
    #   acc = sum of exp2(score - m) * v over those tokens.
    # The answer is acc / l after the last tile. When a tile raises the maximum from m to m_new,
    # everything accumulated so far was weighted relative to the old m, so it is rescaled by
    # alpha = exp2(m - m_new) <= 1 before the tile's own terms are added. Nothing overflows
    # (every exponent is <= 0) and the context is read once, never stored as a score row.
    m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)

    bt_row = block_tables_ptr + seq * stride_bts
    k_head = k_cache_ptr + kv_head * stride_kh
    v_head = v_cache_ptr + kv_head * stride_vh
    for tile_start in range(start, end, TILE):
        t = tile_start + offs_t  # context positions in this tile
        t_mask = t < end
        # The page-table lookup: position t lives in physical block block_table[t // BLOCK_SIZE],
        # row t % BLOCK_SIZE. A tile may span several blocks, or part of one; each token finds
        # its own. int64 before multiplying by the block stride: a large pool overflows int32.
        block = tl.load(bt_row + (t // BLOCK_SIZE) * stride_btb, mask=t_mask, other=0).to(tl.int64)
        row = (t % BLOCK_SIZE).to(tl.int64)
        # K is loaded already transposed, (BLOCK_D, TILE), ready for q @ K^T.
        k = tl.load(
            k_head + (block * stride_kb + row * stride_kt)[None, :] + offs_d[:, None] * stride_kd,
            mask=d_mask[:, None] & t_mask[None, :], other=0.0,
        )
        if QUANT:  # each token's K times the scale of its (block, KV head)
            k_sc = tl.load(k_scale_ptr + block * stride_ksb + kv_head * stride_ksh, mask=t_mask, other=0.0)
            k = k.to(tl.float32) * k_sc[None, :]
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # (BLOCK_H, TILE) fp32
        s = tl.where(t_mask[None, :], s, float("-inf"))  # positions past the context are no tokens

        m_new = tl.maximum(m, tl.max(s, axis=1))  # finite: every tile has >= 1 real token
        alpha = tl.exp2(m - m_new)  # exp2(-inf) = 0 on the first tile
        p = tl.exp2(s - m_new[:, None])  # (BLOCK_H, TILE), 0 where masked
        l = l * alpha + tl.sum(p, axis=1)

        v = tl.load(
            v_head + (block * stride_vb + row * stride_vt)[:, None] + offs_d[None, :] * stride_vd,
            mask=t_mask[:, None] & d_mask[None, :], other=0.0,
        )  # (TILE, BLOCK_D)
        if QUANT:
            v_sc = tl.load(v_scale_ptr + block * stride_vsb + kv_head * stride_vsh, mask=t_mask, other=0.0)
            v = v.to(tl.float32) * v_sc[:, None]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m = m_new

    out_mask = head_mask[:, None] & d_mask[None, :]
    if NUM_SPLITS == 1:
        out = acc / l[:, None]
        tl.store(
            out_ptr + seq * stride_os + heads[:, None] * stride_oh + offs_d[None, :] * stride_od,
            out.to(out_ptr.dtype.element_ty), mask=out_mask,
        )
    else:
        # Split-KV: keep this split's unnormalised (m, l, acc); the reduce kernel merges the splits
        # with the same rescaling rule as the loop above. An empty split stores m=-inf, l=0, acc=0.
        tl.store(part_m_ptr + seq * stride_pms + heads * stride_pmh + split, m, mask=head_mask)
        tl.store(part_l_ptr + seq * stride_pms + heads * stride_pmh + split, l, mask=head_mask)
        tl.store(
            part_acc_ptr + seq * stride_pas + heads[:, None] * stride_pah + split * stride_pak + offs_d[None, :],
            acc, mask=out_mask,
        )


@triton.jit
def _split_kv_reduce_kernel(
    out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr,
    stride_os, stride_oh, stride_od,
    stride_pas, stride_pah, stride_pak,
    stride_pms, stride_pmh,
    NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # A program owns one (sequence, query head) and merges its NUM_SPLITS partial softmaxes.
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    offs_k = tl.arange(0, SPLITS_PAD)
    k_mask = offs_k < NUM_SPLITS
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    m = tl.load(part_m_ptr + seq * stride_pms + head * stride_pmh + offs_k, mask=k_mask, other=float("-inf"))
    l = tl.load(part_l_ptr + seq * stride_pms + head * stride_pmh + offs_k, mask=k_mask, other=0.0)
    acc = tl.load(
        part_acc_ptr + seq * stride_pas + head * stride_pah + offs_k[:, None] * stride_pak + offs_d[None, :],
        mask=k_mask[:, None] & d_mask[None, :], other=0.0,
    )  # (SPLITS_PAD, BLOCK_D)
    m_all = tl.max(m, axis=0)  # finite: split 0 always holds token 0
    w = tl.exp2(m - m_all)  # each split's weight relative to the global maximum; 0 for empty splits
    out = tl.sum(acc * w[:, None], axis=0) / tl.sum(l * w, axis=0)
    tl.store(out_ptr + seq * stride_os + head * stride_oh + offs_d * stride_od, out.to(out_ptr.dtype.element_ty), mask=d_mask)


# ----------------------------------------------------------------------------------------------
# Kernel 3: paged prefill (varlen: several sequences' new tokens packed)
# ----------------------------------------------------------------------------------------------
@triton.jit
def _paged_prefill_kernel(
    out_ptr,  # (num_tokens, num_heads, head_dim)
    q_ptr,  # (num_tokens, num_heads, head_dim): sequence s owns rows query_start_loc[s]:[s+1]
    k_cache_ptr, v_cache_ptr,
    k_scale_ptr, v_scale_ptr,  # (num_blocks, num_kv_heads) fp32: a quantized cache's scales (QUANT)
    block_tables_ptr, context_lens_ptr, query_start_loc_ptr,
    tile_seq_ptr,  # (num_tiles,) int64: which sequence each query tile belongs to
    qk_scale,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_vb, stride_vt, stride_vh, stride_vd,
    stride_bts, stride_btb,
    stride_ot, stride_oh, stride_od,
    stride_ksb, stride_ksh, stride_vsb, stride_vsh,
    QUANT: tl.constexpr,
    QUERIES_PER_KV: tl.constexpr,
    BLOCK_M: tl.constexpr,  # rows per program: BLOCK_Q tokens x QUERIES_PER_KV heads (+ padding)
    BLOCK_Q: tl.constexpr,  # BLOCK_M // QUERIES_PER_KV new tokens per program
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # A program owns up to BLOCK_Q consecutive new tokens of one sequence, for the query heads of
    # one KV head: row r is token r // QUERIES_PER_KV, head r % QUERIES_PER_KV of the group, so
    # as in decode every K/V tile is loaded once for the whole group.
    pid = tl.program_id(0)
    kv_head = tl.program_id(1).to(tl.int64)
    seq = tl.load(tile_seq_ptr + pid)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_end = tl.load(query_start_loc_ptr + seq + 1)
    context_len = tl.load(context_lens_ptr + seq)
    # Sequence s's tiles are numbered from q_start // BLOCK_Q + s (see _query_tiles); some
    # sequences get one tile more than they need, and that tile finds no token of its own.
    first_token = q_start + (pid - (q_start // BLOCK_Q + seq)) * BLOCK_Q
    last_token = tl.minimum(first_token + BLOCK_Q, q_end)  # exclusive
    prefix = context_len - (q_end - q_start)  # cached tokens before the new ones

    offs_m = tl.arange(0, BLOCK_M)
    tok = first_token + offs_m // QUERIES_PER_KV  # packed row of q/out
    heads = kv_head * QUERIES_PER_KV + offs_m % QUERIES_PER_KV
    row_mask = (offs_m < BLOCK_Q * QUERIES_PER_KV) & (tok < last_token)
    q_pos = prefix + (tok - q_start)  # each row's position in its sequence
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    offs_t = tl.arange(0, TILE)
    q_rows = tok.to(tl.int64) * stride_qt + heads * stride_qh
    q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :] * stride_qd, mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    if QUANT:
        q = q.to(tl.float32)
    else:
        q = q.to(k_cache_ptr.dtype.element_ty)  # (BLOCK_M, BLOCK_D)

    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # Causal: the last token of this tile sees positions 0 .. prefix + (last_token - q_start) - 1.
    # An empty tile gets kv_end <= 0 and skips the loop.
    kv_end = tl.where(first_token < last_token, prefix + (last_token - q_start), 0)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bts
    k_head = k_cache_ptr + kv_head * stride_kh
    v_head = v_cache_ptr + kv_head * stride_vh
    for tile_start in range(0, kv_end, TILE):
        t = tile_start + offs_t
        t_mask = t < kv_end
        block = tl.load(bt_row + (t // BLOCK_SIZE) * stride_btb, mask=t_mask, other=0).to(tl.int64)
        row = (t % BLOCK_SIZE).to(tl.int64)
        kv_off = block * stride_kb + row * stride_kt
        k = tl.load(k_head + kv_off[None, :] + offs_d[:, None] * stride_kd, mask=d_mask[:, None] & t_mask[None, :], other=0.0)
        if QUANT:
            k_sc = tl.load(k_scale_ptr + block * stride_ksb + kv_head * stride_ksh, mask=t_mask, other=0.0)
            k = k.to(tl.float32) * k_sc[None, :]
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # (BLOCK_M, TILE); k is K^T
        # Key 0 is visible to every row, so the first tile gives each row a finite maximum and
        # a later, fully masked tile only adds exp2(-inf) = 0.
        visible = t_mask[None, :] & (t[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        v = tl.load(v_head + (block * stride_vb + row * stride_vt)[:, None] + offs_d[None, :] * stride_vd, mask=t_mask[:, None] & d_mask[None, :], other=0.0)
        if QUANT:
            v_sc = tl.load(v_scale_ptr + block * stride_vsb + kv_head * stride_vsh, mask=t_mask, other=0.0)
            v = v.to(tl.float32) * v_sc[:, None]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m = m_new

    # A tile with no token of its own has l == 0; its rows are never stored. Dividing by 1
    # there keeps them finite instead of 0/0.
    out = acc / tl.where(l > 0.0, l, 1.0)[:, None]
    o_rows = tok.to(tl.int64) * stride_ot + heads * stride_oh
    tl.store(out_ptr + o_rows[:, None] + offs_d[None, :] * stride_od, out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])


# ----------------------------------------------------------------------------------------------
# Launch wrappers
# ----------------------------------------------------------------------------------------------
INTERPRETED = type(_paged_decode_kernel).__name__ == "InterpretedFunction"
if INTERPRETED != (type(tl.sum).__name__ == "InterpretedFunction"):
    # triton.language decides at its own import whether its library (tl.sum, tl.zeros, ...) is
    # interpreted; kernels defined later must agree, or the first launch fails obscurely.
    raise RuntimeError(
        "triton was imported before TRITON_INTERPRET was set (or changed since), so triton.language and "
        "these kernels disagree on whether they are interpreted. Restart Python and set TRITON_INTERPRET=1 "
        "before anything imports triton (get_backend('triton') does it for you if it comes first)."
    )
# Tile sizes, largest first. A GPU with less shared memory per block than the first needs (a T4
# with fp32 and head_dim 128, say) raises OutOfResources at launch; the next one is tried then,
# and the one that fits is remembered for that device and shape.
DECODE_TILES = (64, 32, 16)  # context tokens per decode loop iteration
PREFILL_CONFIGS = ((64, 64), (64, 32), (32, 32), (16, 16))  # (query rows per program, context tokens per iteration)
MIN_TOKENS_PER_SPLIT = 256  # split-KV never cuts the context finer than this
_fitting: dict[tuple, int] = {}


def _launch_first_that_fits(key: tuple, configs: tuple, launch: Callable[[Any], None]) -> None:
    """``launch(config)`` with the first config that fits the GPU, starting from the one that fitted last time."""
    for i in range(_fitting.get(key, 0), len(configs)):
        try:
            launch(configs[i])
        except OutOfResources:
            if i == len(configs) - 1:
                raise
            continue
        _fitting[key] = i
        return


def _pow2(n: int, at_least: int = 1) -> int:
    return max(at_least, triton.next_power_of_2(n))


def _check_device(t: torch.Tensor) -> None:
    if not INTERPRETED and t.device.type != "cuda":
        raise RuntimeError(
            f"the Triton kernels were compiled for a GPU but got tensors on {t.device}; "
            "set TRITON_INTERPRET=1 before anything imports triton to run them on the CPU"
        )


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor) -> None:
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"expected q (num_tokens, num_heads, head_dim) and K/V caches (num_blocks, block_size, num_kv_heads, "
            f"head_dim) of one shape; got q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}"
        )
    if q.shape[2] != k_cache.shape[3]:
        raise ValueError(f"q has head_dim {q.shape[2]} but the cache has head_dim {k_cache.shape[3]}")
    if q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"num_heads={q.shape[1]} is not a multiple of num_kv_heads={k_cache.shape[2]}")
    if k_cache.dtype != v_cache.dtype:
        raise TypeError(f"k_cache and v_cache must share a dtype; got {k_cache.dtype} and {v_cache.dtype}")
    quantized = _scales(k_cache) is not None
    for t in (q,) if quantized else (q, k_cache):  # q may differ from the cache: the kernels cast it to the cache's dtype
        if t.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise TypeError(f"the Triton kernels take float32, float16 or bfloat16, not {t.dtype}")
    if INTERPRETED and torch.bfloat16 in (q.dtype, k_cache.dtype):
        raise TypeError(
            "Triton's CPU interpreter has no bfloat16 arithmetic: use float16 or float32 here, "
            "or attention='torch' (bfloat16 works with the Triton kernels on a GPU)"
        )
    _check_device(q)
    if block_tables.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"block_tables must be int32 or int64, got {block_tables.dtype}")


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # tf32 only affects fp32 inputs


def _scales(cache: torch.Tensor) -> torch.Tensor | None:
    """A quantized cache's (num_blocks, num_kv_heads) scales (kv_quant.py), None for a plain one."""
    return getattr(cache, "kv_scales", None)


def _scale_args(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[tuple, tuple, bool]:
    """(the two scale pointers, their four strides, QUANT) for a launch; a plain cache passes itself
    as a placeholder pointer the kernel never reads."""
    ks, vs = _scales(k_cache), _scales(v_cache)
    if ks is None or vs is None:
        return (k_cache, v_cache), (0, 0, 0, 0), False
    return (ks, vs), (*ks.stride(), *vs.stride()), True


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store each new token's K and V at its slot: :func:`minipaged.kv_cache.write_kv` (its
    arguments and shapes), as a kernel.

    A negative slot means "no slot" (a padding token) and is skipped, as in vLLM.
    """
    num_tokens, num_kv_heads, head_dim = k.shape
    if k_cache.shape[2:] != k.shape[1:] or v.shape != k.shape or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"k/v {tuple(k.shape)}/{tuple(v.shape)} do not fit caches {tuple(k_cache.shape)}/{tuple(v_cache.shape)}: "
            "expected k, v (num_tokens, num_kv_heads, head_dim) and caches (num_blocks, block_size, num_kv_heads, head_dim)"
        )
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping must be ({num_tokens},), one slot per token; got {tuple(slot_mapping.shape)}")
    if num_tokens == 0:
        return
    if _scales(k_cache) is not None:  # a quantized cache: the quantizing write (scales per block grow)
        from ..kv_quant import write

        write(k_cache, k, slot_mapping)
        write(v_cache, v, slot_mapping)
        return
    _check_device(k)
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        *k.stride(), *v.stride(), *k_cache.stride(), *v_cache.stride(),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_H=_pow2(num_kv_heads), BLOCK_D=_pow2(head_dim),
    )


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def choose_num_splits(num_seqs: int, num_programs: int, max_context: int, device: torch.device) -> int:
    """How many pieces to cut each sequence's context into for split-KV decode.

    Decode at small batch has few programs (num_seqs x KV heads): too few to keep every SM busy
    on a long context. Splitting the context gives each SM work; a reduce kernel merges the
    pieces. ``max_context`` comes from the block table's width, a host-side shape, so the choice
    needs no device-to-host copy. On the CPU interpreter splitting only costs time: 1.
    """
    if device.type != "cuda":
        return 1
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    want = triton.cdiv(2 * sms, max(1, num_programs))  # two programs per SM
    return max(1, min(want, triton.cdiv(max_context, MIN_TOKENS_PER_SPLIT), 128))


def paged_decode(
    q: torch.Tensor,  # (num_seqs, num_heads, head_dim): one new token per sequence
    k_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim), new K already written
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # (num_seqs, max_blocks) int32
    context_lens: torch.Tensor,  # (num_seqs,) int32, each >= 1
    scale: float,
    out: torch.Tensor | None = None,
    *,
    num_splits: int | None = None,  # None: choose_num_splits; 1 switches split-KV off
    group_heads: bool = True,  # False: a program per query head (reads each KV block once per head)
    tile: int | None = None,  # None: the largest of DECODE_TILES that fits the GPU
) -> torch.Tensor:
    """Decode attention over the paged cache: query token s attends to all context_lens[s] tokens."""
    _check(q, k_cache, v_cache, block_tables)
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if block_tables.shape[0] != num_seqs or context_lens.shape != (num_seqs,):
        raise ValueError(
            f"decode takes one query per sequence: q has {num_seqs} rows, block_tables {tuple(block_tables.shape)}, "
            f"context_lens {tuple(context_lens.shape)}"
        )
    if out is None:
        out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    heads_per_program = group if group_heads else 1
    max_context = block_tables.shape[1] * block_size
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_seqs * num_heads // heads_per_program, max_context, q.device)
    context_lens = context_lens.contiguous()
    if num_splits > 1:
        part_acc = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        part_m = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
    else:  # unused by the kernel; any tensor will do as a placeholder pointer
        part_acc = part_m = part_l = out
    grid = (num_seqs, num_heads // heads_per_program, num_splits)
    scale_ptrs, scale_strides, quant = _scale_args(k_cache, v_cache)

    def launch(tile: int) -> None:
        tokens_per_split = triton.cdiv(triton.cdiv(max_context, num_splits), tile) * tile
        _paged_decode_kernel[grid](
            out, part_acc, part_m, part_l, q, k_cache, v_cache, *scale_ptrs, block_tables, context_lens,
            scale * LOG2E, tokens_per_split,
            *q.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride(), *out.stride(),
            *(part_acc.stride()[:3] if num_splits > 1 else (0, 0, 0)),
            *(part_m.stride()[:2] if num_splits > 1 else (0, 0)), *scale_strides, QUANT=quant,
            QUERIES_PER_KV=group, HEADS_PER_PROGRAM=heads_per_program, BLOCK_H=_pow2(heads_per_program, 16),
            HEAD_DIM=head_dim, BLOCK_D=_pow2(head_dim, 16), BLOCK_SIZE=block_size, TILE=tile,
            NUM_SPLITS=num_splits, DOT_PRECISION=_dot_precision(torch.float32 if quant else k_cache.dtype),
        )

    tiles = DECODE_TILES if tile is None else (_pow2(tile, 16),)
    key = ("decode", q.device, k_cache.dtype, head_dim, heads_per_program, block_size, num_splits > 1)
    _launch_first_that_fits(key, tiles, launch)
    if num_splits > 1:
        _split_kv_reduce_kernel[(num_seqs, num_heads)](
            out, part_acc, part_m, part_l, *out.stride(), *part_acc.stride()[:3], *part_m.stride()[:2],
            NUM_SPLITS=num_splits, SPLITS_PAD=_pow2(num_splits), HEAD_DIM=head_dim, BLOCK_D=_pow2(head_dim, 16),
        )
    return out


def _query_tiles(query_start_loc: torch.Tensor, block_q: int, num_tokens: int) -> torch.Tensor:
    """Which sequence each prefill program serves, computed on the device (no host sync).

    Sequence s gets the tiles numbered from ``query_start_loc[s] // block_q + s``: at least
    ceil(q_len / block_q) of them, at most one more. The total, num_tokens // block_q + num_seqs,
    is known from shapes alone.
    """
    num_seqs = query_start_loc.shape[0] - 1
    first_tile = query_start_loc[:-1].long() // block_q + torch.arange(num_seqs, device=query_start_loc.device)
    num_tiles = num_tokens // block_q + num_seqs
    tiles = torch.arange(num_tiles, device=query_start_loc.device)
    return torch.searchsorted(first_tile, tiles, right=True) - 1


def paged_prefill(
    q: torch.Tensor,  # (num_tokens, num_heads, head_dim): new tokens of all sequences, packed
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # (num_seqs, max_blocks) int32
    context_lens: torch.Tensor,  # (num_seqs,) int32: cached prefix + new tokens
    query_start_loc: torch.Tensor,  # (num_seqs + 1,) int32
    scale: float,
    out: torch.Tensor | None = None,
    *,
    block_m: int | None = None,  # None (both): the largest of PREFILL_CONFIGS that fits the GPU
    tile: int | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its cached prefix and themselves."""
    _check(q, k_cache, v_cache, block_tables)
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = block_tables.shape[0]
    if context_lens.shape != (num_seqs,) or query_start_loc.shape != (num_seqs + 1,):
        raise ValueError(
            f"{num_seqs} block-table rows need context_lens ({num_seqs},) and query_start_loc ({num_seqs + 1},); "
            f"got {tuple(context_lens.shape)} and {tuple(query_start_loc.shape)}"
        )
    if out is None:
        out = torch.empty_like(q)
    if num_tokens == 0 or num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    context_lens = context_lens.contiguous()
    query_start_loc = query_start_loc.contiguous()
    scale_ptrs, scale_strides, quant = _scale_args(k_cache, v_cache)

    def launch(config: tuple[int, int]) -> None:
        block_m = _pow2(max(config[0], group), 16)  # a program holds at least one token's whole group
        block_q = block_m // group
        tile_seq = _query_tiles(query_start_loc, block_q, num_tokens)
        _paged_prefill_kernel[(tile_seq.shape[0], num_kv_heads)](
            out, q, k_cache, v_cache, *scale_ptrs, block_tables, context_lens, query_start_loc, tile_seq,
            scale * LOG2E,
            *q.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride(), *out.stride(),
            *scale_strides, QUANT=quant,
            QUERIES_PER_KV=group, BLOCK_M=block_m, BLOCK_Q=block_q,
            HEAD_DIM=head_dim, BLOCK_D=_pow2(head_dim, 16), BLOCK_SIZE=block_size, TILE=_pow2(config[1], 16),
            DOT_PRECISION=_dot_precision(torch.float32 if quant else k_cache.dtype),
            num_warps=4 if head_dim <= 128 else 8,
        )

    if block_m is None and tile is None:
        configs = PREFILL_CONFIGS
    else:
        configs = ((block_m or PREFILL_CONFIGS[0][0], tile or PREFILL_CONFIGS[0][1]),)
    key = ("prefill", q.device, k_cache.dtype, head_dim, group, block_size)
    _launch_first_that_fits(key, configs, launch)
    return out


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    context_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`minipaged.attention.reference.paged_attention` (its arguments and shapes) on the
    GPU: the decode kernel when every sequence has exactly one new token, else the prefill kernel.

    Every scheduled sequence has at least one new token, so ``num_tokens == num_seqs`` means all
    of them have exactly one: a test on shapes, with no device-to-host copy.
    """
    if q.shape[0] == block_tables.shape[0]:
        return paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale, out)
    return paged_prefill(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale, out)


__all__ = ["write_kv", "paged_attention", "paged_decode", "paged_prefill", "choose_num_splits"]
