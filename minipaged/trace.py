"""A per-step record of the scheduler's state: what the pictures and the bench read.

Owns what the pictures need: who runs and waits, which physical block belongs to whom, reserved
vs used KV slots, and a stable batch slot per request for a Gantt chart. It only reads the
scheduler (its queues, its output's ``ScheduledSeq`` fields, the pool through
``minipaged.parts``); it never changes it and never reads allocator internals. The simulators
that produce a trace without a model live in ``minipaged.bench.simulate``.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import parts

if TYPE_CHECKING:  # pragma: no cover
    from .data import SchedulerOutput, Sequence


@dataclass(slots=True)
class StepRecord:
    """The state right after one engine step (after ``Scheduler.update``).

    ``owners[b]`` is the seq_id holding physical block ``b`` (None: free; a tuple of ids if several
    tables share it). ``tables`` maps seq_id -> (its physical blocks in logical order, tokens).
    Static-batching records have no pages: ``owners``, ``tables`` and the block counts are None.
    """

    step: int
    time: float
    running: tuple  # seq_ids in the running queue after the step
    waiting: tuple  # seq_ids still waiting (including preempted ones)
    batch: tuple  # seq_ids that computed tokens this step
    prefill_tokens: int  # tokens of prompts (or recomputation) computed this step
    decode_tokens: int  # single generated tokens fed back this step
    sampled_tokens: int  # new output tokens produced this step
    preemptions: int  # preemptions so far in the run
    reserved_slots: int  # KV token slots handed to sequences
    used_slots: int  # of those, slots holding a computed token
    slots: dict  # seq_id -> batch slot index (stable while the request holds it)
    blocks_used: int | None = None
    blocks_free: int | None = None
    owners: list | None = None
    tables: dict | None = None
    # prefix caching (None when it is off): prompt tokens found cached / asked for so far,
    # blocks findable by hash now, and cached blocks evicted so far
    hit_tokens: int | None = None
    queried_tokens: int | None = None
    cached_blocks: int | None = None
    evictions: int | None = None
    # what the step ran (the engine's executor): "whole_step" (all layers, one C call), "layers" (one
    # forward, layer by layer on the plan's table) or "model" (the plain forward), then "+" the
    # next token's route, "head_argmax" or "sampler" (None: a simulated step, no model ran)
    route: str | None = None
    # copy-on-write in this step: (shared source block, its fresh copy) pairs, copied before the write
    copied: tuple = ()

    @property
    def shared_blocks(self) -> list[int] | None:
        """Physical blocks that several tables hold after the step (None: no pages)."""
        return None if self.owners is None else [b for b, o in enumerate(self.owners) if isinstance(o, tuple)]

    @property
    def hit_rate(self) -> float | None:
        if self.queried_tokens is None:
            return None
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    @property
    def wasted_slots(self) -> int:
        return self.reserved_slots - self.used_slots

    def to_dict(self) -> dict:
        d = {
            "step": self.step, "time": self.time, "running": list(self.running), "waiting": list(self.waiting),
            "batch": list(self.batch), "prefill_tokens": self.prefill_tokens, "decode_tokens": self.decode_tokens,
            "sampled_tokens": self.sampled_tokens, "preemptions": self.preemptions,
            "reserved_slots": self.reserved_slots, "used_slots": self.used_slots,
            "slots": [[k, v] for k, v in self.slots.items()],  # JSON keys must be strings; ids need not be
            "blocks_used": self.blocks_used, "blocks_free": self.blocks_free,
            "hit_tokens": self.hit_tokens, "queried_tokens": self.queried_tokens,
            "cached_blocks": self.cached_blocks, "evictions": self.evictions,
            "copied": [list(p) for p in self.copied],
        }
        if self.owners is not None:
            d["owners"] = [list(o) if isinstance(o, tuple) else o for o in self.owners]
            d["tables"] = [{"request": k, "blocks": list(b), "num_tokens": n} for k, (b, n) in self.tables.items()]
        return d


class Trace:
    """Call ``record(scheduler, output, time)`` once per step, after ``scheduler.update``.

    ``time`` is when the step ended (seconds since the engine started, or step units in a
    simulation); step ``i`` spans ``(steps[i-1].time, steps[i].time]``, the first one from
    ``start_time``. Recording is O(num_blocks + running) per step and copies no tensor.
    """

    def __init__(self, start_time: float = 0.0, kind: str = "paged") -> None:
        self.kind = kind  # "paged" (a real scheduler) or "static" (simulate_static)
        self.start_time = float(start_time)
        self.steps: list[StepRecord] = []
        self.num_blocks: int | None = None
        self.block_size: int | None = None
        self.max_len: int | None = None  # static: slots reserved per request
        self.meta: dict[str, Any] = {}
        self.rejected: list[tuple[Any, str]] = []
        self._slot_of: dict[Any, int] = {}
        self._free_slots: list[int] = []  # a heap: the lowest free slot is reused first
        self._next_slot = 0
        self._open: dict[Any, dict] = {}
        self._closed: list[dict] = []

    # -- recording -------------------------------------------------------------------------
    def record(self, scheduler: Any, output: "SchedulerOutput", time: float, route: str | None = None) -> StepRecord:
        alloc = scheduler.allocator
        if self.num_blocks is None:
            self.num_blocks, self.block_size = alloc.num_blocks, alloc.block_size
        bs = alloc.block_size
        step = len(self.steps)

        owners: list = [None] * alloc.num_blocks
        tables: dict = {}
        reserved = used = 0
        for seq in scheduler.running:
            table = seq.block_table
            if table is None:
                continue
            blocks = tuple(table.blocks)
            tables[seq.seq_id] = (blocks, table.num_tokens)
            for b in blocks:
                o = owners[b]
                owners[b] = seq.seq_id if o is None else (o + (seq.seq_id,) if isinstance(o, tuple) else (o, seq.seq_id))
            reserved += len(blocks) * bs
            used += min(seq.num_computed_tokens, table.num_tokens)

        prefill = decode = sampled = 0
        active: dict[Any, "Sequence"] = {}
        for s in output.scheduled:
            seq = s.seq
            active.setdefault(seq.seq_id, seq)
            if is_prefill(s):
                prefill += s.num_new_tokens
            else:
                decode += 1
            sampled += bool(s.samples)  # decided when the step was scheduled
        for seq in scheduler.running:
            active.setdefault(seq.seq_id, seq)

        preempted = {seq.seq_id for seq in output.preempted}
        prev_time = self.steps[-1].time if self.steps else self.start_time
        for sid in [sid for sid in self._slot_of if sid not in active]:
            self._release(sid, "preempted" if sid in preempted else "left")
        for sid in active:
            if sid not in self._slot_of:
                self._acquire(sid, step, prev_time)
            iv = self._open[sid]
            iv["end"], iv["end_time"] = step + 1, float(time)
        slots = dict(self._slot_of)
        for sid, seq in active.items():
            if seq.is_finished:  # it used its slot during this step; the next step may reuse it
                self._release(sid, seq.finish_reason.value if seq.finish_reason else "finished")

        rec = StepRecord(
            step=step, time=float(time),
            running=tuple(seq.seq_id for seq in scheduler.running),
            waiting=tuple(seq.seq_id for seq in scheduler.waiting),
            batch=tuple(s.seq.seq_id for s in output.scheduled),
            prefill_tokens=prefill, decode_tokens=decode, sampled_tokens=sampled,
            preemptions=scheduler.num_preemptions, reserved_slots=reserved, used_slots=used, slots=slots,
            blocks_used=parts.num_used_blocks(alloc), blocks_free=alloc.num_free_blocks, owners=owners, tables=tables,
            route=route, copied=tuple(tuple(p) for p in getattr(output, "blocks_to_copy", ()) or ()),
        )
        stats = getattr(scheduler, "prefix_stats", None)
        if stats is not None and getattr(scheduler, "prefix_caching", False):
            rec.hit_tokens, rec.queried_tokens = stats.hit_tokens, stats.queried_tokens
            rec.cached_blocks, rec.evictions = alloc.num_cached_blocks, alloc.num_evictions
        self.steps.append(rec)
        return rec

    def _acquire(self, sid: Any, step: int, start_time: float) -> int:
        if self._free_slots:
            slot = heapq.heappop(self._free_slots)
        else:
            slot, self._next_slot = self._next_slot, self._next_slot + 1
        self._slot_of[sid] = slot
        self._open[sid] = {"request": sid, "slot": slot, "start": step, "end": step + 1,
                           "start_time": float(start_time), "end_time": float(start_time)}
        return slot

    def _release(self, sid: Any, outcome: str) -> None:
        slot = self._slot_of.pop(sid)
        heapq.heappush(self._free_slots, slot)
        iv = self._open.pop(sid)
        iv.update(finish=iv["end"], finish_time=iv["end_time"], outcome=outcome)
        self._closed.append(iv)

    # -- queries ---------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.steps)

    def __getitem__(self, step: int) -> StepRecord:
        return self.steps[step]

    @property
    def total_time(self) -> float:
        return (self.steps[-1].time if self.steps else self.start_time) - self.start_time

    def kv_waste(self, by: str = "steps") -> float:
        """Reserved-but-unused KV slots / reserved slots over the run.

        ``by="steps"`` weighs every step the same; ``by="time"`` weighs each by its duration.
        """
        if by not in ("steps", "time"):
            raise ValueError(f"by must be 'steps' or 'time', got {by!r}")
        reserved = wasted = 0.0
        prev = self.start_time
        for r in self.steps:
            w = 1.0 if by == "steps" else max(r.time - prev, 0.0)
            prev = r.time
            reserved += w * r.reserved_slots
            wasted += w * r.wasted_slots
        return wasted / reserved if reserved else 0.0

    def sharing_saving(self) -> float:
        """The paper's memory saving over the run: blocks saved by sharing / blocks the tables
        would need without it, summed over the steps (0.0 when nothing was shared)."""
        logical = physical = 0
        for r in self.steps:
            if r.tables is None:
                continue
            logical += sum(len(b) for b, _ in r.tables.values())
            physical += len({x for b, _ in r.tables.values() for x in b})
        return (logical - physical) / logical if logical else 0.0

    @property
    def peak_blocks_used(self) -> int | None:
        """Most physical blocks in use at once (None for a static trace, which has no pages)."""
        used = [r.blocks_used for r in self.steps if r.blocks_used is not None]
        return max(used) if used else None

    @property
    def peak_concurrency(self) -> int:
        """Most requests holding a batch slot at once."""
        return max((len(r.slots) for r in self.steps), default=0)

    @property
    def peak_step(self) -> int:
        """The step with the most KV slots reserved (the fullest page table): a good one to show."""
        if not self.steps:
            raise ValueError("the trace is empty: record at least one step")
        return max(range(len(self.steps)), key=lambda i: (self.steps[i].reserved_slots, -i))

    def timeline(self) -> list[dict]:
        """One dict per stretch a request held a batch slot.

        Keys: request, slot, start, end (step indices, end exclusive), start_time, end_time,
        finish/finish_time (when the request's own work ended; earlier than end only in static
        batching, where a slot is held until the batch's longest request is done), and outcome
        ('length', 'stop', 'preempted', 'abort', 'running' if still open at the end, ...).
        """
        ivs = [dict(iv) for iv in self._closed]
        for iv in self._open.values():
            ivs.append(dict(iv, finish=iv["end"], finish_time=iv["end_time"], outcome="running"))
        return sorted(ivs, key=lambda iv: (iv["start"], iv["slot"]))

    def summary(self) -> dict:
        out_tokens = sum(r.sampled_tokens for r in self.steps)
        t = self.total_time
        return {
            "kind": self.kind, "steps": len(self.steps), "total_time": t,
            "requests": len({iv["request"] for iv in self.timeline()}), "output_tokens": out_tokens,
            "output_tokens_per_s": out_tokens / t if t > 0 else 0.0,
            "kv_waste": self.kv_waste(), "peak_blocks_used": self.peak_blocks_used,
            "peak_concurrency": self.peak_concurrency,
            "mean_concurrency": sum(len(r.slots) for r in self.steps) / len(self.steps) if self.steps else 0.0,
            "preemptions": self.steps[-1].preemptions if self.steps else 0,
            "rejected": len(self.rejected),
            "prefix_hit_rate": self.steps[-1].hit_rate if self.steps else None,
            "evictions": self.steps[-1].evictions if self.steps else None,
        }

    def to_dict(self) -> dict:
        """Everything as JSON-able lists and dicts (seq_ids are kept as they are)."""
        return {
            "kind": self.kind, "num_blocks": self.num_blocks, "block_size": self.block_size,
            "max_len": self.max_len, "start_time": self.start_time, "meta": dict(self.meta),
            "rejected": [[k, why] for k, why in self.rejected], "summary": self.summary(),
            "steps": [r.to_dict() for r in self.steps], "timeline": self.timeline(),
        }

    def __repr__(self) -> str:
        return (f"Trace({self.kind}, {len(self.steps)} steps, peak {self.peak_concurrency} requests, "
                f"KV waste {self.kv_waste():.1%})")




def is_prefill(s: Any) -> bool:
    """Whether a scheduled record computes prompt (or recomputed) tokens rather than one decode
    token: the scheduler's ``ScheduledSeq.is_prefill``, read, never recomputed."""
    return bool(s.is_prefill)
