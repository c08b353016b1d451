"""The records the parts hand each other: a request's state and one step's schedule.

Owns plain data only, and imports nothing else of minipaged: it is the floor the contracts
(``interfaces.py``) and every part stand on. ``Sequence`` is a request as the scheduler sees it
(tokens, status, how far its KV is computed); ``ScheduledSeq`` and ``SchedulerOutput`` are what
the scheduler decides for one step, which the runner, the trace and the pictures read.
``minipaged.sequence`` and ``minipaged.scheduler`` re-export these names.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class SequenceStatus(str, Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    REJECTED = "rejected"


class FinishReason(str, Enum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens reached, or the model's context is full
    ABORT = "abort"  # cancelled by the caller
    REJECTED = "rejected"  # could never fit; see Sequence.reject_reason
    ERROR = "error"  # the step that ran it raised (a learner's attention, a model error); see Sequence.reject_reason


@dataclass(eq=False)
class Sequence:
    """One request. ``num_computed_tokens`` is the one number the scheduler's rule moves:

    each step it catches up towards ``num_tokens`` (prefill, chunked prefill, decode and
    recompute after preemption are then the same thing).

    The request's stop settings live here and only here (``max_tokens``, ``eos_token_ids``,
    ``stop_token_ids``, ``ignore_eos``): the scheduler reads them, and so does the sequence's
    stop checker. ``sampling_params`` is read for how to sample (temperature, seed, ...).
    """

    seq_id: Any
    prompt_token_ids: list[int]
    max_tokens: int = 16
    eos_token_ids: tuple[int, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    sampling_params: Any = None
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    reject_reason: str | None = None
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    block_table: Any = None  # a BlockTable (any BlockTableProtocol), given by the scheduler
    # parallel sampling: samples 1..n-1 of this request, forked from it (sharing its blocks)
    # when its prompt is computed and its first token sampled; empty once forked
    forks: list = field(default_factory=list)
    # speculative decoding: draft tokens proposed for this step (minipaged.spec_decode), not yet
    # verified. The scheduler budgets them after the sequence's own tokens; the update keeps the
    # accepted ones (as output tokens) and rolls the others back. Empty when not speculating.
    spec_token_ids: list = field(default_factory=list)
    # beam search: the request's BeamGroup (minipaged.beam_search) when this sequence is one of its
    # beams (None otherwise). A beam's next token is chosen by the group, across all its beams, not
    # by the sampler: update() moves its computed tokens but appends none.
    beam: Any = None
    # the one rule that decides when this request is done (detokenizer.StopChecker, made by
    # StopChecker.for_sequence): the engine attaches one with the tokenizer and stop strings,
    # the scheduler one for a sequence that has none when its first token is sampled
    stop_checker: Any = None
    # timing, filled by the engine (seconds since the engine started)
    arrival_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None

    def __post_init__(self) -> None:
        self.prompt_token_ids = list(self.prompt_token_ids)

    @classmethod
    def for_request(cls, seq_id: Any, prompt_token_ids: list[int], params: Any, eos_token_ids: tuple[int, ...] = (),
                    max_tokens: int | None = None) -> "Sequence":
        """A sequence for a request made with ``params`` (a SamplingParams): the one place its
        stop settings are taken from them (``max_tokens``, when given, is ``params.max_tokens``
        resolved by the engine, e.g. None -> the room left in the context)."""
        return cls(
            seq_id, prompt_token_ids, max_tokens=params.max_tokens if max_tokens is None else max_tokens,
            eos_token_ids=tuple(eos_token_ids),
            stop_token_ids=tuple(params.stop_token_ids), ignore_eos=params.ignore_eos, sampling_params=params,
        )

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def max_total_tokens(self) -> int:
        """The most tokens whose KV this request can ever need: prompt + max_tokens - 1.

        The last sampled token is returned but never fed back, so its KV is never written.
        """
        return self.num_prompt_tokens + self.max_tokens - 1

    @property
    def is_finished(self) -> bool:
        return self.status in (SequenceStatus.FINISHED, SequenceStatus.REJECTED)

    def append_token(self, token_id: int) -> str:
        """Add a sampled token; its stop checker decides whether the request is done.

        Returns the text the token adds (empty without a tokenizer, or while held back)."""
        if self.stop_checker is None:
            raise RuntimeError(
                f"{self!r} has no stop checker: the scheduler's update() attaches one before the first token "
                "(minipaged.detokenizer.StopChecker.for_sequence(seq))"
            )
        self.output_token_ids.append(int(token_id))
        reason, delta = self.stop_checker.append(token_id)
        if reason is not None:
            self.finish_reason = reason
        return delta

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id!r}, {self.status.value}, prompt={self.num_prompt_tokens}, "
            f"out={len(self.output_token_ids)}/{self.max_tokens}, computed={self.num_computed_tokens})"
        )


@dataclass(frozen=True)
class ScheduledSeq:
    """One sequence's share of a step, filled in by the scheduler; the runner, trace and viz
    read these fields and never recompute them."""

    seq: Sequence
    start: int  # num_computed_tokens before the step: positions start .. start + num_new_tokens - 1
    num_new_tokens: int  # tokens whose KV this step computes
    samples: bool  # the step reaches the end of the sequence (and verifies any drafts past it), so its logits give new tokens
    is_prefill: bool  # False only for a decode: one new token after the whole prompt is computed

    @classmethod
    def of(cls, seq: Sequence, num_new_tokens: int) -> "ScheduledSeq":
        """The record for ``seq`` running ``num_new_tokens`` from its ``num_computed_tokens`` on."""
        start = seq.num_computed_tokens
        return cls(
            seq=seq,
            start=start,
            num_new_tokens=num_new_tokens,
            samples=start + num_new_tokens >= seq.num_tokens,  # past it: draft tokens to verify
            is_prefill=not (num_new_tokens == 1 and start >= seq.num_prompt_tokens),
        )


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)  # sent back to waiting in this step
    finished: list[Sequence] = field(default_factory=list)  # filled by update(): done in this step
    num_batched_tokens: int = 0
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst), before the step writes

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


__all__ = ["SequenceStatus", "FinishReason", "Sequence", "ScheduledSeq", "SchedulerOutput"]
