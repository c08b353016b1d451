"""What ends a request inside a step, keeping the others: a NaN or inf in its rows (hidden states or
logits), a grammar that leaves it no token, or a step that raised. Each ends only the requests it
names, with finish_reason "error" and a message that says why, and clears the blocks they alone
wrote, so that nothing a failed step wrote reaches a block's next owner. LLMEngine.step calls these."""
from __future__ import annotations

import bisect
import warnings
from typing import TYPE_CHECKING, Any

import torch

from .data import FinishReason, Sequence
from .outputs import RequestOutput

if TYPE_CHECKING:
    from .engine import _Request


def fail_nonfinite_rows(engine, hidden: torch.Tensor, inputs: Any) -> None:
    """End the requests whose rows of the step's hidden states hold NaN or inf."""
    seq_of_row = _token_row_owner(hidden, inputs)
    if seq_of_row is not None:  # else not one row per token: the logits check still guards the sampled rows
        fail_nonfinite(engine, hidden, seq_of_row, "hidden states (the last layer's output: attention or a layer after it made them)")


def fail_nonfinite(engine, values: torch.Tensor, seq_of_row: Any, part: str) -> set[int]:
    """End, with finish_reason "error", every request with a row of ``values`` that holds NaN or
    inf (``seq_of_row(r)``: the sequence of row r), before update() could cache a block it wrote;
    its blocks are cleared, so a later owner never reads the NaN. Returns those rows."""
    bad_rows = _nonfinite_rows(values)
    if not bad_rows:
        return set()
    by_request: dict[str, tuple[_Request, list[int]]] = {}
    for r in bad_rows:
        req = engine._request(seq_of_row(r))
        if req is not None and req.seq.seq_id in engine.requests:
            by_request.setdefault(req.seq.seq_id, (req, []))[1].append(r)
    step = engine.num_steps + 1
    for req, rows in by_request.values():
        _scrub(req, engine.kv_cache, engine.prefix_cache)
        engine._end(req, FinishReason.ERROR, _nonfinite_message(step, part, values, rows))
    if by_request:
        warnings.warn(f"minipaged: step {step}: {len(by_request)} request(s) failed: non-finite {part.split(' (')[0]}",
                      stacklevel=6)  # the caller of step()
    return set(bad_rows)


def fail_step(engine, out: Any, error: Exception) -> list[RequestOutput]:
    """Finish the requests of a step that raised with finish_reason "error"; keep the rest."""
    where = "the scheduler" if out is None else "the step"
    msg = f"{where} raised {type(error).__name__}: {error}"
    seqs = _blamed_sequences(engine.scheduler, out)
    for seq in seqs:
        req = engine._request(seq)
        if req is not None and req.seq.seq_id in engine.requests:
            _scrub(req, engine.kv_cache, engine.prefix_cache)  # whatever the step wrote before it raised never reaches a later owner
            engine._end(req, FinishReason.ERROR, msg)
    if not seqs:  # nothing to blame: surface the error rather than spin
        raise error
    warnings.warn(f"minipaged: {len(seqs)} request(s) failed: {msg}", stacklevel=3)
    failed, engine._pending = engine._pending, []
    return failed


def _blamed_sequences(scheduler: Any, out: Any) -> list[Sequence]:
    """The sequences a step that raised ends: ``out`` is what schedule() returned (None: it raised)."""
    if out is None:  # schedule() itself raised: the sequences it was working on are suspect
        return list(scheduler.running) + [s for s in scheduler.waiting if s.block_table is not None]
    if out.is_empty:  # no progress is possible: end everything rather than spin
        return list(scheduler.running) + list(scheduler.waiting)
    return [s.seq for s in out.scheduled]


def _scrub(req: _Request, kv_cache: Any, prefix_cache: Any) -> None:
    """Zero the K/V of ``req``'s blocks that no other request can read, so that what a failed
    step wrote there (a NaN) never reaches the block's next owner."""
    blocks = req.unshared_blocks(prefix_cache)
    k, v = getattr(kv_cache, "k", None), getattr(kv_cache, "v", None)
    if not blocks or not k or not v:
        return
    from .kv_quant import clear_blocks

    idx = torch.tensor(sorted(blocks), dtype=torch.long, device=k[0].device)
    for t in list(k) + list(v):
        clear_blocks(t, idx)  # 8-bit pages: their per-block scales too


def _nonfinite_rows(values: torch.Tensor) -> list[int]:
    """The rows of ``values`` (2-D) that hold a NaN or an inf."""
    ok = torch.isfinite(values).all(dim=-1)
    return [] if bool(ok.all()) else (~ok).nonzero().flatten().tolist()


def _nonfinite_message(step: int, part: str, values: torch.Tensor, rows: list[int]) -> str:
    kind = "NaN" if bool(torch.isnan(values[rows]).any()) else "inf"
    return (f"step {step}: the {part} of this request hold {kind} ({len(rows)} row(s)), so its next token would "
            "be garbage: the request was ended, and no block it wrote in this step was cached")


def _token_row_owner(hidden: torch.Tensor, inputs: Any) -> Any:
    """``seq_of_row(r)``: the sequence whose token row r of ``hidden`` is; None when ``hidden`` is
    not one row per scheduled token."""
    qsl = inputs.meta.query_start_loc
    if hidden.dim() != 2 or hidden.shape[0] != int(qsl[-1]):
        return None
    starts = qsl.tolist()
    order = inputs.order
    return lambda r: order[bisect.bisect_right(starts, r) - 1].seq




def mask_batch(engine, logits: torch.Tensor, seqs: list) -> tuple[torch.Tensor, list]:
    """Mask the constrained rows of ``logits``; a request whose grammar leaves no token is
    ended with finish_reason "error" (the others are sampled)."""
    dead = engine.structured.apply(logits, seqs)
    if not dead:
        return logits, seqs
    for r, why in dead.items():
        req = engine._request(seqs[r])
        if req is not None and req.seq.seq_id in engine.requests:
            engine._end(req, FinishReason.ERROR, f"structured outputs: {why}")
    keep = [r for r in range(len(seqs)) if r not in dead and not seqs[r].is_finished]
    return logits[keep], [seqs[r] for r in keep]


__all__ = ["fail_nonfinite_rows", "fail_nonfinite", "fail_step", "mask_batch"]
