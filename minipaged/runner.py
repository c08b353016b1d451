"""The model runner: one SchedulerOutput in, the flat tensors of one forward pass out.

Owns the step's inputs: packed token ids and positions, the slot mapping (through each
block table's ``slot_mapping``), the block tables padded into one batch tensor, and the
attention metadata. Decode sequences go first, so a backend can attend all of them at once
(``AttentionMetadata.num_decodes``). It never decides who runs (the scheduler) and never
samples (the sampler).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .attention import AttentionMetadata
from .scheduler import ScheduledSeq, SchedulerOutput


@dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor  # (N,) int64
    positions: torch.Tensor  # (N,) int64
    meta: AttentionMetadata
    order: list[ScheduledSeq]  # the scheduled sequences in packed order (decodes first)
    sample_rows: list[int]  # row of the last new token of every sequence that samples, in order
    samplers: list[ScheduledSeq]  # those sequences, in the same order as sample_rows
    # speculative decoding: draft tokens each sampler verifies (0 when it does not); a verifying
    # sequence's sample_rows entry is the row of its last real token, and its drafts' rows follow
    num_drafts: list[int] = field(default_factory=list)


def pad_block_tables(tables: list[list[int]], pad: int = 0, width: int | None = None) -> torch.Tensor:
    """Block id lists -> one (num_seqs, width) int32 tensor (default width: the longest), short rows padded with ``pad``."""
    longest = max((len(t) for t in tables), default=0)
    width = max(longest, 1) if width is None else width
    if width < longest:
        raise ValueError(f"width {width} is smaller than the {longest} blocks of the longest table")
    if not tables:
        return torch.full((0, width), pad, dtype=torch.int32)
    # one tensor built from padded Python rows: no per-row tensor, no per-row copy
    return torch.tensor([list(t) + [pad] * (width - len(t)) for t in tables], dtype=torch.int32)


class ModelRunner:
    """Turns a SchedulerOutput into the flat tensors one forward pass needs."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)

    def prepare(self, out: SchedulerOutput) -> StepInputs:
        order = [s for s in out.scheduled if not s.is_prefill] + [s for s in out.scheduled if s.is_prefill]
        num_decodes = len(order) - sum(1 for s in order if s.is_prefill)
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[torch.Tensor] = []
        context_lens: list[int] = []
        query_start_loc = [0]
        sample_rows: list[int] = []
        samplers: list[ScheduledSeq] = []
        num_drafts: list[int] = []
        for s in order:
            seq, a, n = s.seq, s.start, s.num_new_tokens
            tokens = seq.token_ids
            d = max(0, a + n - len(tokens))  # draft tokens to verify, after the sequence's own
            if d:
                tokens = tokens + list(seq.spec_token_ids[:d])
            if a + n > len(tokens):
                raise ValueError(
                    f"the scheduler asked for positions {a}..{a + n - 1} of sequence {seq.seq_id!r}, "
                    f"which has only {len(tokens)} tokens"
                )
            input_ids.extend(tokens[a : a + n])
            positions.extend(range(a, a + n))
            slots.append(seq.block_table.slot_mapping(a, a + n))
            context_lens.append(a + n)
            query_start_loc.append(query_start_loc[-1] + n)
            if s.samples:
                sample_rows.append(query_start_loc[-1] - 1 - d)
                samplers.append(s)
                num_drafts.append(d)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.cat(slots).to(device=dev, dtype=torch.int64),
            block_tables=pad_block_tables([list(s.seq.block_table.blocks) for s in order]).to(dev),
            context_lens=torch.tensor(context_lens, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=dev),
            num_decodes=num_decodes,
        )
        ids = torch.tensor(input_ids, dtype=torch.long, device=dev)
        pos = torch.tensor(positions, dtype=torch.long, device=dev)
        return StepInputs(ids, pos, meta, order, sample_rows, samplers, num_drafts)


__all__ = ["ModelRunner", "StepInputs", "pad_block_tables"]
