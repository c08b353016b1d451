"""What serving looked like before PagedAttention: naive and static batching over a contiguous cache.

Owns the two comparison systems. They run the *same* model code and attention backend as
the engine; only the memory policy (reserve the maximum length up front) and the batching
policy (a batch ends when its longest member ends) differ, so a measured difference is theirs.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from .attention import get_backend
from .block_allocator import BlockAllocator
from .block_table import BlockTable
from .parts import allocate_many, cdiv, check_pool, num_reserved_slots
from .runner import ModelRunner
from .kv_cache import KVCache
from .scheduler import ScheduledSeq, SchedulerOutput
from .sequence import Sequence
from .trace import StepRecord, Trace


class ContiguousTable(BlockTable):
    """A block table that reserves ``reserve_tokens`` slots at once, as a contiguous cache does.

    The slots exist from admission to the end of the batch whether or not they are used:
    that is the waste the PagedAttention paper measured.
    """

    def __init__(self, allocator: BlockAllocator, reserve_tokens: int) -> None:
        super().__init__(allocator)
        self.blocks = allocate_many(allocator, cdiv(reserve_tokens, allocator.block_size))

    def append_tokens(self, num_new_tokens: int = 1) -> list[int]:
        if self.num_tokens + num_new_tokens > num_reserved_slots(self):
            raise ValueError(f"a contiguous slot of {num_reserved_slots(self)} tokens cannot hold {self.num_tokens + num_new_tokens}")
        self.num_tokens += num_new_tokens
        return []


@dataclass
class BatchRun:
    """What a baseline did: per-request outputs and timings, and its memory over time."""

    outputs: dict[int, list[int]] = field(default_factory=dict)
    first_token_time: dict[int, float] = field(default_factory=dict)
    finish_time: dict[int, float] = field(default_factory=dict)
    trace: Trace = field(default_factory=lambda: Trace(kind="static"))  # memory and slots per step
    seconds: float = 0.0


@torch.inference_mode()
def run_static(
    model: torch.nn.Module,
    requests: list[tuple[list[int], int]],  # (prompt token ids, output length)
    batch_size: int,
    reserve_len: int,
    block_size: int = 16,
    attention: Any = "auto",
    progress: bool = False,
    desc: str = "static batching",
) -> BatchRun:
    """Static batching, greedy, EOS ignored: ``batch_size`` requests at a time, each reserving
    ``reserve_len`` slots; every row computes until the batch's longest output is done
    (finished rows keep producing padding, as ``generate`` on a padded batch does).
    ``batch_size=1`` is the naive server: one request at a time."""
    cfg = model.config
    if reserve_len > cfg.max_position_embeddings:
        raise ValueError(f"reserve_len={reserve_len} is past the model's context ({cfg.max_position_embeddings} tokens)")
    p = next(model.parameters())
    blocks_per_seq = -(-reserve_len // block_size)
    allocator = BlockAllocator(blocks_per_seq * batch_size, block_size)
    kv = KVCache(cfg.num_layers, allocator.num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, p.dtype, p.device)
    backend = get_backend(attention, p.device)
    runner = ModelRunner(p.device)
    run = BatchRun()
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(requests), desc=desc, unit="req")
    t0 = time.perf_counter()
    for b0 in range(0, len(requests), batch_size):
        batch = list(range(b0, min(b0 + batch_size, len(requests))))
        seqs = []
        longest = max(requests[i][1] for i in batch)
        for i in batch:
            prompt, n_out = requests[i]
            if len(prompt) + longest - 1 > reserve_len:
                raise ValueError(
                    f"request {i} (prompt {len(prompt)}) padded to the batch's longest output ({longest}) needs "
                    f"{len(prompt) + longest - 1} slots, more than reserve_len={reserve_len}"
                )
            s = Sequence(i, prompt, max_tokens=n_out, ignore_eos=True)
            s.block_table = ContiguousTable(allocator, reserve_len)
            seqs.append(s)
        start = time.perf_counter() - t0
        first_step = len(run.trace.steps)
        slots = {s.seq_id: k for k, s in enumerate(seqs)}
        waiting = tuple(range(batch[-1] + 1, len(requests)))
        for step in range(longest):
            # Step 0 is the prefill of every prompt; then one token per row per step.
            out = SchedulerOutput()
            for s in seqs:
                n = s.num_tokens - s.num_computed_tokens
                s.block_table.append_tokens(n)
                out.scheduled.append(ScheduledSeq.of(s, n))
            inputs = runner.prepare(out)
            hidden = model(inputs.input_ids, inputs.positions, kv, inputs.meta, backend)
            tokens = model.compute_logits(hidden[inputs.sample_rows]).argmax(-1).tolist()
            assert [x.seq for x in inputs.samplers] == seqs, "every row of a static batch samples, in order"
            now = time.perf_counter() - t0
            reserved = used = sampled = 0
            for s, t in zip(seqs, tokens):
                s.num_computed_tokens = s.num_tokens
                s.output_token_ids.append(int(t))  # past max_tokens this is padding work
                k = len(s.output_token_ids)
                sampled += k <= s.max_tokens
                if k == 1:
                    run.first_token_time[s.seq_id] = now
                if k == s.max_tokens:
                    run.finish_time[s.seq_id] = now
                    run.outputs[s.seq_id] = list(s.output_token_ids)
                    if bar is not None:
                        bar.update(1)
                reserved += num_reserved_slots(s.block_table)
                used += s.num_prompt_tokens + min(k, s.max_tokens) - 1
            run.trace.steps.append(StepRecord(
                step=len(run.trace.steps), time=now, running=tuple(slots), waiting=waiting, batch=tuple(slots),
                prefill_tokens=sum(len(x.prompt_token_ids) for x in seqs) if step == 0 else 0,
                decode_tokens=0 if step == 0 else len(seqs), sampled_tokens=sampled, preemptions=0,
                reserved_slots=reserved, used_slots=used, slots=dict(slots),
                blocks_used=allocator.num_blocks - allocator.num_free_blocks, blocks_free=allocator.num_free_blocks,
            ))
        end_step = len(run.trace.steps)
        for slot, s in enumerate(seqs):
            run.trace._closed.append({
                "request": s.seq_id, "slot": slot, "start": first_step, "end": end_step,
                "start_time": start, "end_time": run.trace.steps[-1].time,
                "finish": first_step + s.max_tokens, "finish_time": run.finish_time[s.seq_id], "outcome": "length",
            })
            s.block_table.free()
    run.seconds = time.perf_counter() - t0
    run.trace.max_len = reserve_len
    run.trace.meta.update(batch_size=batch_size, time_unit="s")
    if bar is not None:
        bar.close()
    check_pool(allocator)
    return run


def run_naive(model: torch.nn.Module, requests: list[tuple[list[int], int]], reserve_len: int, **kw: Any) -> BatchRun:
    """One request at a time over a contiguous cache: the server with no batching at all."""
    kw.setdefault("desc", "naive (one at a time)")
    return run_static(model, requests, 1, reserve_len, **kw)
