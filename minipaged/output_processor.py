"""Output processing (vLLM's ``OutputProcessor``): a request's sequences -> the RequestOutput the
caller gets, with each sample's text, its delta since the last output, its stop reason and its
logprobs, and the request's metrics.

Owns how text and stop reasons are reported. It does not decide when a sequence finishes (the
stop checker in detokenizer.py does) nor keep the requests (the engine does); outputs.py holds
the types.
"""
from __future__ import annotations

from typing import Any

from .data import FinishReason, Sequence
from .outputs import CompletionOutput, RequestMetrics, RequestOutput
from .sampling import SamplingParams


class _KeepSpecialTokens:
    """A tokenizer whose ``decode`` keeps special tokens (``SamplingParams(skip_special_tokens=False)``)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tok, name)


def text_tokenizer(tokenizer: Any, params: SamplingParams) -> Any:
    """The tokenizer a sample's text is decoded with: ``tokenizer``, keeping special tokens when
    ``params.skip_special_tokens`` is False."""
    return tokenizer if params.skip_special_tokens or tokenizer is None else _KeepSpecialTokens(tokenizer)


def stop_reason(q: Sequence) -> int | str | None:
    """vLLM's stop_reason: the stop token id or stop string that ended ``q`` (None for EOS,
    the length limit, or while it runs)."""
    if q.finish_reason is not FinishReason.STOP or not q.is_finished:
        return None
    params = q.sampling_params
    last = q.output_token_ids[-1] if q.output_token_ids else None
    if last is not None and last in params.stop_token_ids:
        return last
    checker = q.stop_checker
    detok = getattr(checker, "detok", None)
    if params.stop and detok is not None:
        rest = detok.text[len(checker.text):]
        hits = [s for s in params.stop if rest.startswith(s)]
        if hits:
            return max(hits, key=len)
    return None


def completion_output(index: int, q: Sequence, sampler: Any) -> CompletionOutput:
    """Sample ``index`` of a request (sequence ``q``) as vLLM's CompletionOutput; its ``delta_text``
    is what it adds to the last output (the stop checker's pending text is taken)."""
    checker = q.stop_checker
    reason = q.finish_reason.value if q.finish_reason is not None and q.is_finished else None
    text = checker.text if checker is not None else ""
    delta = checker.pop_delta() if checker is not None else ""
    stop = stop_reason(q)
    params = q.sampling_params
    if isinstance(stop, str) and params is not None and params.include_stop_str_in_output:
        text += stop
        if not getattr(q, "stop_str_sent", False):  # once, with the delta that ends the stream
            delta += stop
            q.stop_str_sent = True
    logprobs = sampler.logprobs(q.seq_id)
    if logprobs is None:  # retired already (aborted, failed): the last ones it had
        logprobs = getattr(q, "last_logprobs", None)
    else:
        q.last_logprobs = logprobs
    cumulative = sum(next(iter(e.values())).logprob for e in logprobs) if logprobs is not None else None
    return CompletionOutput(index, text, list(q.output_token_ids), reason, q.is_finished, delta, q.num_preemptions,
                            cumulative_logprob=cumulative, logprobs=logprobs, stop_reason=stop)


def request_output(req: Any, sampler: Any, spec: Any = None) -> RequestOutput:
    """The RequestOutput of ``req`` (the engine's record of a request: ``seq``, ``samples``,
    ``prompt``, ``prompt_logprobs``) now; ``sampler`` holds its logprobs, ``spec`` (the
    speculative decoder, or None) its draft counts."""
    seq = req.seq
    outs = [completion_output(i, q, sampler) for i, q in enumerate(req.samples)]
    done = all(o.finished for o in outs)
    firsts = [q.first_token_time for q in req.samples if q.first_token_time is not None]
    lasts = [getattr(q, "last_token_time", None) for q in req.samples]
    ends = [q.finish_time for q in req.samples if q.finish_time is not None]
    metrics = RequestMetrics(
        arrival_time=seq.arrival_time, first_scheduled_time=getattr(seq, "first_scheduled_time", None),
        first_token_time=min(firsts) if firsts else None,
        last_token_time=max((t for t in lasts if t is not None), default=None),
        finished_time=max(ends) if done and ends else None,
        num_generation_tokens=sum(len(o.token_ids) for o in outs),
        spec_decode=spec.request_metrics([q.seq_id for q in req.samples]) if spec is not None else None,
    )
    return RequestOutput(
        request_id=seq.seq_id,
        prompt=req.prompt,
        prompt_token_ids=list(seq.prompt_token_ids),
        text=outs[0].text,
        token_ids=outs[0].token_ids,
        finish_reason=outs[0].finish_reason if done else None,
        finished=done,
        error=seq.reject_reason,
        num_preemptions=sum(o.num_preemptions for o in outs),
        metrics=metrics,
        delta_text=outs[0].delta_text,
        outputs=outs,
        prompt_logprobs=req.prompt_logprobs,
        num_cached_tokens=getattr(seq, "num_cached_tokens", None),
    )


def rejected_output(request_id: str, prompt_text: str | None, error: str) -> RequestOutput:
    """The output of a request refused before it was queued (``LLM.generate`` reports it in place)."""
    return RequestOutput(request_id, prompt_text, [], "", [], "rejected", True, error=error)
