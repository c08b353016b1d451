"""A request's state as the scheduler sees it: tokens, status, and how far its KV is computed.

Owns no memory and no model; the block table it carries is filled by the scheduler.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .block_table import BlockTable


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
    block_table: "BlockTable | None" = None
    # parallel sampling: samples 1..n-1 of this request, forked from it (sharing its blocks)
    # when its prompt is computed and its first token sampled; empty once forked
    forks: list = field(default_factory=list)
    # the one rule that decides when this request is done (detokenizer.StopChecker); the
    # engine attaches one with the tokenizer and stop strings, else one is made from the fields above
    stop_checker: Any = None
    # timing, filled by the engine (seconds since the engine started)
    arrival_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None

    def __post_init__(self) -> None:
        self.prompt_token_ids = list(self.prompt_token_ids)

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
            from .detokenizer import StopChecker

            self.stop_checker = StopChecker(
                self.max_tokens, self.num_prompt_tokens, self.eos_token_ids, self.stop_token_ids, ignore_eos=self.ignore_eos
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
