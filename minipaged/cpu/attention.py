"""The "cpu" attention backend: the paged-attention contract served by the C kernels.

The CPU sibling of lesson 05's Triton kernel. PyTorch can only attend pages by first gathering
them into a padded copy (``index_select``) and running SDPA over it: every cached K/V byte
crosses memory twice and the padding is computed. ``kernels.paged_decode`` walks each
sequence's block table and reads each cached row once, where it lies (csrc/paged_attention.c).

- K/V write: one C call for K and V (every slot checked first, nothing written if one is bad).
- Decodes: every decode sequence in one call of the decode kernel.
- Prefills whose contexts are at most ``PREFILL_AS_DECODES_MAX_CONTEXT`` long, and short queries
  (at most ``SHORT_QUERY_AS_DECODES`` new tokens, e.g. a speculative step's last token and its
  drafts) over any context (when the plan's ``prefill_as_decodes`` is on): each new token is one
  decode query over its causal prefix, all in one call: no gathered copy, no padding, no masked
  half. Longer chunks over longer contexts go to attention/torch_sdpa.py, which reuses each K/V
  tile across a chunk's queries. :func:`tokens_as_decodes` is the one rule, which the whole-step
  decode (minipaged/executor.py) follows too, so both routes run the same kernel on the same rows.

One instance per engine: the only state, the current step's per-token prefill rows, is that
engine's. The results equal attention/reference.py's to fp32 rounding (tests/test_attention_fast.py).
"""
from __future__ import annotations

import torch

from ..attention import AttentionBackend
from ..attention import torch_sdpa
from ..kv_cache import write_kv as torch_write_kv
from . import kernels

PREFILL_AS_DECODES_MAX_CONTEXT = 256
SHORT_QUERY_AS_DECODES = 16


def decode_rows(block_tables: torch.Tensor, seqs, q_lens, ctx) -> tuple[torch.Tensor, torch.Tensor]:
    """Each new token of sequences ``seqs`` as one decode query: its sequence's block-table row,
    and its causal context length (``ctx - q_len + i + 1`` for the sequence's ``i``-th new token)."""
    rows = torch.tensor([s for s in seqs for _ in range(q_lens[s])], dtype=torch.long, device=block_tables.device)
    lens = torch.tensor([ctx[s] - q_lens[s] + i + 1 for s in seqs for i in range(q_lens[s])], dtype=torch.int32)
    return block_tables.index_select(0, rows), lens


def tokens_as_decodes(q_lens, ctx) -> bool:
    """True where each new token of these sequences may attend as its own decode query: every
    context is short, or every query is (a verifying step's k + 1 tokens)."""
    return all(c <= PREFILL_AS_DECODES_MAX_CONTEXT or n <= SHORT_QUERY_AS_DECODES for n, c in zip(q_lens, ctx))


class CPUAttention:
    """``write_kv`` and ``paged_attention`` (the reference's signature, plus ``num_decodes=``)."""

    name = "cpu"

    def __init__(self, prefill_as_decodes: bool = True) -> None:
        self.prefill_as_decodes = prefill_as_decodes
        self._step_rows: tuple | None = None  # (block_tables, key, (tables, lens)) of this step

    def backend(self) -> AttentionBackend:
        return AttentionBackend("cpu", self.write_kv, self.paged_attention, takes_num_decodes=True)

    @staticmethod
    def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        def rows_ok(x: torch.Tensor) -> bool:  # heads contiguous within each token's row
            return x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2] and x.dtype == torch.float32

        if k_cache.is_contiguous() and v_cache.is_contiguous() and rows_ok(k) and rows_ok(v):
            return kernels.write_kv(k_cache, v_cache, k, v, slot_mapping)
        return torch_write_kv(k_cache, v_cache, k, v, slot_mapping)

    def _prefill_rows(self, block_tables: torch.Tensor, rest: list[int], q_lens: list[int], ctx: list[int]):
        """Each prefill token's block-table row and causal context length; made once per step
        (every layer of a step gets the same metadata tensors)."""
        key = (tuple(rest), tuple(q_lens[s] for s in rest), tuple(ctx[s] for s in rest))
        cached = self._step_rows
        if cached is not None and cached[0] is block_tables and cached[1] == key and torch.equal(cached[2], block_tables):
            return cached[3]
        result = decode_rows(block_tables, rest, q_lens, ctx)
        self._step_rows = (block_tables, key, block_tables.clone(), result)
        return result

    def paged_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, context_lens: torch.Tensor, query_start_loc: torch.Tensor,
                        scale: float, out: torch.Tensor | None = None, *, num_decodes: int | None = None) -> torch.Tensor:
        num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
        if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            return torch_sdpa.paged_attention(q, k_cache, v_cache, block_tables, context_lens, query_start_loc,
                                              scale, out, num_decodes=num_decodes)
        if out is None or not out.is_contiguous():
            out = torch.empty_like(q)
        qsl, ctx, q_lens, num_decodes, decodes, rest = torch_sdpa._plan(query_start_loc, context_lens, num_decodes)
        if num_decodes:
            if decodes is None:  # a prefix of one-query sequences: rows 0 .. num_decodes - 1
                kernels.paged_decode(q[:num_decodes], k_cache, v_cache, block_tables[:num_decodes],
                                     context_lens[:num_decodes], scale, out=out[:num_decodes])
            else:
                idx = torch.tensor(decodes, dtype=torch.long, device=q.device)
                rows = torch.tensor([qsl[s] for s in decodes], dtype=torch.long, device=q.device)
                out[rows] = kernels.paged_decode(q[rows], k_cache, v_cache, block_tables[idx], context_lens[idx], scale)
        rest = [s for s in rest if q_lens[s] > 0]  # a sequence with no new token has nothing to attend
        if not rest:
            return out
        lo, hi = qsl[rest[0]], qsl[rest[-1] + 1]
        contiguous = rest == list(range(rest[0], rest[-1] + 1))
        if self.prefill_as_decodes and contiguous and tokens_as_decodes([q_lens[s] for s in rest], [ctx[s] for s in rest]):
            tables, lens = self._prefill_rows(block_tables, rest, q_lens, ctx)
            kernels.paged_decode(q[lo:hi], k_cache, v_cache, tables, lens, scale, out=out[lo:hi])
            return out
        if contiguous:  # the prefills alone, as a batch of their own, through PyTorch's SDPA
            sub_qsl = query_start_loc[rest[0]:rest[-1] + 2] - qsl[rest[0]]
            torch_sdpa.paged_attention(q[lo:hi], k_cache, v_cache, block_tables[rest[0]:rest[-1] + 1],
                                       context_lens[rest[0]:rest[-1] + 1], sub_qsl, scale, out[lo:hi], num_decodes=0)
            return out
        o = torch_sdpa.paged_attention(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale)
        for s in rest:
            out[qsl[s]:qsl[s + 1]] = o[qsl[s]:qsl[s + 1]]
        return out


__all__ = ["CPUAttention", "PREFILL_AS_DECODES_MAX_CONTEXT", "SHORT_QUERY_AS_DECODES", "decode_rows", "tokens_as_decodes"]
