"""Deciding when a request is finished, and turning its tokens into text a piece at a time.

Owns the one stop rule of a request (EOS, stop tokens, stop strings, max_tokens, the model's
context) and incremental detokenizing. It never touches blocks or the model: the sequence
calls its checker once per appended token, and the engine reads the text deltas it returns.

Detokenizing is incremental (as in vLLM): each new token decodes only a short window of the
last few tokens, so a 1,000-token answer costs the same per token as a 10-token one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence as Seq

from .data import FinishReason

_PENDING = "\ufffd"  # what a tokenizer prints for a UTF-8 character whose other bytes are still to come


class IncrementalDetokenizer:
    """``append(token_id) -> new text``. Two decode calls of a few tokens each per token.

    It keeps two offsets into the output ids: text up to ``read`` is final; decoding from
    ``prefix`` (a token or so before it) gives the tokenizer the context it needs to print the
    next piece exactly as a decode of the whole output would.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""
        self._prefix = 0
        self._read = 0
        self.num_decode_calls = 0

    def _decode(self, ids: Seq[int]) -> str:
        self.num_decode_calls += 1
        return self.tokenizer.decode(ids)

    def append(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        before = self._decode(self.ids[self._prefix : self._read]) if self._read > self._prefix else ""
        after = self._decode(self.ids[self._prefix :])
        if len(after) > len(before) and not after.endswith(_PENDING):
            delta = after[len(before) :]
            self._prefix, self._read = self._read, len(self.ids)
            self.text += delta
            return delta
        return ""  # a partial UTF-8 character (or a token with no text yet): wait for more

    def flush(self) -> str:
        """At the end: whatever is still held back (an incomplete character prints as U+FFFD)."""
        if self._read == len(self.ids):
            return ""
        before = self._decode(self.ids[self._prefix : self._read]) if self._read > self._prefix else ""
        after = self._decode(self.ids[self._prefix :])
        delta = after[len(before) :]
        self._prefix = self._read = len(self.ids)
        self.text += delta
        return delta


@dataclass(frozen=True)
class _Settings:
    """The stop settings of a checker made by hand (the names a Sequence has for them)."""

    max_tokens: int
    num_prompt_tokens: int
    eos_token_ids: tuple = ()
    stop_token_ids: tuple = ()
    ignore_eos: bool = False
    min_tokens: int = 0


class StopChecker:
    """One per request: ``append(token_id) -> (finish_reason or None, text delta)``.

    The order of the rules: EOS (unless ``ignore_eos``), a stop token, a stop string (the text
    is cut before it, and no part of it is ever returned), ``max_tokens``, the model's context
    (``max_model_len``). Text that could still turn out to be the start of a stop string is held
    back until it cannot, so a streamed answer never shows a stop string.

    ``min_tokens`` (vLLM's rule): until that many tokens are out, neither EOS nor a stop token
    ends the request (the sampler masks them too), and stop strings are looked for only once
    more than ``min_tokens`` tokens are out, so a stop string that lies wholly in the text of the
    first ``min_tokens`` tokens is not honoured; one that ends in a later token's text is, even
    when it began earlier (vLLM's detokenizer, ``vllm/v1/engine/detokenizer.py``, skips the stop
    check while ``len(output_token_ids) <= min_tokens``; its scheduler's ``check_stop`` ignores
    EOS and stop tokens while ``num_output_tokens < min_tokens``).

    A sequence's checker is made by :meth:`for_sequence`, the one place one is built: it reads
    ``max_tokens``, ``eos_token_ids``, ``stop_token_ids`` and ``ignore_eos`` from the sequence
    (their one owner) and holds only what the sequence does not: the stop strings, the model's
    context and the tokenizer. ``StopChecker(max_tokens, num_prompt_tokens, ...)`` makes one
    from settings given by hand.
    """

    def __init__(
        self,
        max_tokens: int,
        num_prompt_tokens: int,
        eos_token_ids: Seq[int] = (),
        stop_token_ids: Seq[int] = (),
        stop: Seq[str] = (),
        ignore_eos: bool = False,
        max_model_len: int | None = None,
        tokenizer: Any = None,
        min_tokens: int = 0,
    ) -> None:
        settings = _Settings(max_tokens, num_prompt_tokens, tuple(eos_token_ids), tuple(stop_token_ids), ignore_eos,
                             int(min_tokens))
        self._setup(settings, stop, max_model_len, tokenizer)

    @classmethod
    def for_sequence(cls, seq: Any, stop: Seq[str] = (), max_model_len: int | None = None,
                     tokenizer: Any = None) -> "StopChecker":
        """The checker of ``seq`` (a :class:`minipaged.data.Sequence`): its stop settings are read
        from ``seq``; ``stop`` strings need the ``tokenizer``."""
        checker = cls.__new__(cls)
        checker._setup(seq, stop, max_model_len, tokenizer)
        return checker

    def _setup(self, settings: Any, stop: Seq[str], max_model_len: int | None, tokenizer: Any) -> None:
        self.settings = settings  # the sequence (or _Settings): max_tokens, eos/stop ids, ignore_eos
        self.stop = tuple(stop)
        self.max_model_len = max_model_len
        self.detok = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self._emitted = 0  # characters of self.text already returned
        self.num_output_tokens = 0
        self.finish_reason: FinishReason | None = None
        self._text = ""
        self._unread = ""  # deltas not yet taken by the engine (pop_delta)

    # the settings, read from their owner
    @property
    def max_tokens(self) -> int:
        return self.settings.max_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return self.settings.num_prompt_tokens

    @property
    def eos(self) -> frozenset:
        return frozenset(() if self.settings.ignore_eos else self.settings.eos_token_ids)

    @property
    def stop_ids(self) -> frozenset:
        return frozenset(self.settings.stop_token_ids)

    @property
    def min_tokens(self) -> int:
        """Tokens that must come out before EOS, a stop token or a stop string may end the request:
        the settings' own ``min_tokens``, else (a sequence) its SamplingParams'."""
        v = getattr(self.settings, "min_tokens", None)
        if v is None:
            v = getattr(getattr(self.settings, "sampling_params", None), "min_tokens", 0)
        return int(v or 0)

    @property
    def text(self) -> str:
        """The answer so far, cut before a stop string."""
        return self._text

    def append(self, token_id: int) -> tuple[FinishReason | None, str]:
        if self.finish_reason is not None:
            raise RuntimeError("a token was appended to a finished request")
        self.num_output_tokens += 1
        token_id = int(token_id)
        reason = None
        cut = False
        rule = self.settings
        min_tokens = self.min_tokens
        if self.num_output_tokens >= min_tokens and (
                (token_id in rule.eos_token_ids and not rule.ignore_eos) or token_id in rule.stop_token_ids):
            reason = FinishReason.STOP  # the stop token itself adds no text
        elif self.detok is not None:
            piece = self.detok.append(token_id)
            if piece:
                self._text += piece
                if self.stop and self.num_output_tokens > min_tokens:
                    # only the tail can hold a stop string that was not there before
                    lo = max(0, len(self._text) - len(piece) - self._hold)
                    hits = [i for i in (self._text.find(s, lo) for s in self.stop) if i >= 0]
                    if hits:
                        self._text = self._text[: min(hits)]
                        reason, cut = FinishReason.STOP, True
        if reason is None and self.num_output_tokens >= rule.max_tokens:
            reason = FinishReason.LENGTH
        if reason is None and self.max_model_len is not None and rule.num_prompt_tokens + self.num_output_tokens >= self.max_model_len:
            reason = FinishReason.LENGTH
        self.finish_reason = reason
        if reason is not None and self.detok is not None and not cut:
            self._text += self.detok.flush()
        return reason, self._take_delta()

    def finish(self, reason: FinishReason) -> str:
        """The request ends for another reason (abort, error): release the text held back so far."""
        if self.finish_reason is None:
            self.finish_reason = reason
        return self._take_delta()

    def pop_delta(self) -> str:
        """All text released since the last call (what a streaming client is sent next)."""
        delta, self._unread = self._unread, ""
        return delta

    def _take_delta(self) -> str:
        end = len(self._text) if self.finish_reason is not None else max(self._emitted, len(self._text) - self._hold)
        delta = self._text[self._emitted : end]
        self._emitted = end
        self._unread += delta
        return delta


__all__ = ["IncrementalDetokenizer", "StopChecker"]
