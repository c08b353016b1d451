"""What the engine hands back: vLLM's RequestOutput, CompletionOutput and request metrics.

Field names are vLLM's (``vllm/outputs.py``), so code written for vLLM reads them unchanged:
``out.prompt`` (the prompt's text), ``out.prompt_token_ids``, ``out.prompt_logprobs``,
``out.num_cached_tokens``, ``out.outputs[i].text`` / ``.token_ids`` / ``.cumulative_logprob`` /
``.logprobs`` / ``.finish_reason`` / ``.stop_reason`` / ``.finished()``, ``out.finished`` and
``out.metrics.first_token_time``. minipaged adds a few of its own: ``text``, ``token_ids``,
``finish_reason`` and ``delta_text`` (sample 0's, for code written for one sample), ``error``
(why a request was rejected or failed) and ``num_preemptions``.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from .sampling import Logprob

__all__ = ["CompletionOutput", "Logprob", "RequestMetrics", "RequestOutput"]


class _Finished:
    """``finished`` of a CompletionOutput: vLLM calls it (``o.finished()``), older minipaged code
    reads it as a bool (``if o.finished``); this value does both."""

    __slots__ = ("value",)

    def __init__(self, value: bool) -> None:
        self.value = bool(value)

    def __call__(self) -> bool:
        return self.value

    def __bool__(self) -> bool:
        return self.value

    def __eq__(self, other: Any) -> bool:
        return self.value == bool(other)

    def __hash__(self) -> int:
        return hash(self.value)

    def __repr__(self) -> str:
        return repr(self.value)


@dataclass
class CompletionOutput:
    """One sample of a request (vLLM's CompletionOutput): with ``SamplingParams(n=k)``, k of them.

    ``logprobs``: with ``SamplingParams(logprobs=k)``, per generated token a dict token id ->
    Logprob (the sampled token first, then the top k); else None. ``cumulative_logprob``: the sum
    of the sampled tokens' logprobs (None without ``logprobs``). ``stop_reason``: the stop string
    or stop token id that ended the sample (None for EOS, the length limit, or while running).
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    finished: Any = False  # call it (vLLM) or read it as a bool (minipaged)
    delta_text: str = ""
    num_preemptions: int = 0
    cumulative_logprob: float | None = None
    logprobs: list | None = None
    stop_reason: int | str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.finished, _Finished):
            self.finished = _Finished(self.finished)


@dataclass
class RequestMetrics:
    """When things happened to one request, in seconds on the engine's clock (vLLM's names).

    ``arrival_time``: added; ``first_scheduled_time``: first given a seat in a step;
    ``first_token_time`` / ``last_token_time``: its first and latest generated token;
    ``finished_time``: done (None while running). Derived: ``time_in_queue``,
    ``first_token_latency``. vLLM v1's ``queued_ts`` / ``scheduled_ts`` / ``first_token_ts`` /
    ``last_token_ts`` read the same numbers. Reading it as a dict (``metrics["finish_time"]``)
    still works, for code written when it was one.
    """

    arrival_time: float | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_generation_tokens: int = 0
    # speculative decoding: this request's drafts, kept tokens, acceptance rate (None: it verified none)
    spec_decode: dict | None = None

    @property
    def time_in_queue(self) -> float | None:
        if self.first_scheduled_time is None or self.arrival_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def first_token_latency(self) -> float | None:
        if self.first_token_time is None or self.arrival_time is None:
            return None
        return self.first_token_time - self.arrival_time

    queued_ts = property(lambda self: self.arrival_time)
    scheduled_ts = property(lambda self: self.first_scheduled_time)
    first_token_ts = property(lambda self: self.first_token_time)
    last_token_ts = property(lambda self: self.last_token_time)
    finish_time = property(lambda self: self.finished_time)  # minipaged's old name

    _KEYS = ("arrival_time", "first_scheduled_time", "first_token_time", "last_token_time", "finish_time",
             "finished_time", "time_in_queue", "first_token_latency", "num_generation_tokens", "spec_decode")

    def __getitem__(self, key: str) -> Any:
        if key not in self._KEYS:
            raise KeyError(key)
        return getattr(self, key)

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key) if key in self._KEYS else default

    def keys(self):
        return list(self._KEYS)


@dataclass
class RequestOutput:
    """What a caller gets back for one request (vLLM's RequestOutput, plus minipaged's shortcuts).

    ``prompt`` is the prompt's text (a chat's rendered template; None for a token-id prompt, as
    in vLLM). ``text`` is sample 0's whole answer so far (cut before a stop string);
    ``delta_text`` is what this output adds to the previous one of the same request (what a
    stream sends next). ``outputs`` holds every sample (one, unless ``SamplingParams.n > 1``), in
    sample order; ``text``, ``token_ids``, ``delta_text`` and ``finish_reason`` are sample 0's, so
    code written for one sample keeps working, and ``finished`` is True once every sample is done.
    ``num_cached_tokens``: prompt tokens found in the prefix cache (not computed again).
    """

    request_id: str
    prompt: Any
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length", "abort", "rejected", "error", or None while running
    finished: bool
    error: str | None = None  # why a request was rejected, or what raised in its step
    num_preemptions: int = 0
    metrics: Any = field(default_factory=RequestMetrics)
    delta_text: str = ""
    outputs: list = field(default_factory=list)  # a CompletionOutput per sample, sample 0 first
    prompt_logprobs: list | None = None
    num_cached_tokens: int | None = None
    encoder_prompt: str | None = None
    encoder_prompt_token_ids: list[int] | None = None
    lora_request: Any = None

    def __post_init__(self) -> None:
        if isinstance(self.metrics, dict):  # the old form: {"arrival_time", "first_token_time", "finish_time"}
            m = dict(self.metrics)
            if "finish_time" in m:
                m["finished_time"] = m.pop("finish_time")
            names = {f.name for f in fields(RequestMetrics)}
            self.metrics = RequestMetrics(**{k: v for k, v in m.items() if k in names})
        if not self.outputs and self.finished:
            # a request refused before it ran still has vLLM's shape: one empty sample
            self.outputs = [CompletionOutput(0, self.text, list(self.token_ids), self.finish_reason, True)]

    def __repr__(self) -> str:
        text = self.text if len(self.text) < 60 else self.text[:57] + "..."
        return f"RequestOutput(id={self.request_id!r}, finish={self.finish_reason}, tokens={len(self.token_ids)}, text={text!r})"
