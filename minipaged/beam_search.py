"""Beam search on shared blocks: vLLM's ``LLM.beam_search(prompts, BeamSearchParams(...))``.

Owns the beam search rule and its bookkeeping; the engine runs the beams and the scheduler gives
them blocks. The rule (the one vLLM's offline beam search follows, written here from its description):

- every live beam proposes its ``2 * beam_width`` most likely next tokens, scored by the beam's
  cumulative log-probability plus the token's (the log-softmax of the logits; with
  ``temperature > 0``, of the logits divided by it);
- a proposal that is EOS (unless ``ignore_eos``) is a finished hypothesis and is kept aside;
- of the other proposals of all beams the ``beam_width`` best become the next live beams;
- after ``max_tokens`` tokens (or at the end of the model's context), the live beams join the
  finished ones, and the ``beam_width`` best of them all, by ``beam_score`` (the cumulative
  log-probability over the length to the power ``length_penalty``; a final EOS is not counted),
  are the answer.

How it uses memory (the paper's §4.4): the beams are sequences of one request. A beam with several
children is forked: each child's block table shares all its parent's blocks (their reference
counts go up), and the scheduler copies only the last, partly filled block when a child writes
into it (copy-on-write). A beam with no child is freed at once. ``sharing_saving`` is the paper's
measure of what this saves.

``reference_beam_search`` is the same rule over any function that gives next-token logits (a
``transformers`` model, say), with no paging at all: the oracle the engine is tested against.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch

__all__ = ["BeamSearchParams", "BeamSearchSequence", "BeamSearchOutput", "beam_score", "beam_candidates",
           "select_beams", "reference_beam_search", "sharing_saving", "worst_case_blocks", "SharingCounter"]


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass
class BeamSearchParams:
    """vLLM's BeamSearchParams: ``beam_width`` hypotheses kept, each up to ``max_tokens`` tokens.

    ``ignore_eos``: EOS is an ordinary token (no hypothesis ends early). ``temperature``: 0 scores
    by the model's log-probabilities; T > 0 by those of logits / T (the search stays
    deterministic). ``length_penalty``: the score divides the cumulative log-probability by
    length ** length_penalty (1.0: the mean log-probability per token; 0: the sum)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False  # vLLM's field; a beam has no stop strings here

    def __post_init__(self) -> None:
        self.validate()

    def validate(self, max_num_seqs: int | None = None) -> None:
        """Raise ValueError, saying what to do, for a setting no beam search can run with."""
        if not _is_int(self.beam_width) or self.beam_width < 1:
            raise ValueError(f"BeamSearchParams(beam_width={self.beam_width!r}): beam_width must be an int >= 1 "
                             "(1 is greedy search)")
        if max_num_seqs is not None and self.beam_width > max_num_seqs:
            raise ValueError(f"BeamSearchParams(beam_width={self.beam_width}): the beams of one request run at once, "
                             f"and max_num_seqs={max_num_seqs}: lower beam_width to at most {max_num_seqs}, or raise max_num_seqs")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"BeamSearchParams(max_tokens={self.max_tokens!r}): max_tokens must be an int >= 1")
        if isinstance(self.length_penalty, bool) or not isinstance(self.length_penalty, (int, float)) \
                or not math.isfinite(self.length_penalty):
            raise ValueError(f"BeamSearchParams(length_penalty={self.length_penalty!r}): length_penalty must be a "
                             "finite number (1.0 is the usual choice)")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"BeamSearchParams(temperature={self.temperature!r}): temperature must be a finite "
                             "number >= 0 (0 scores by the model's own log-probabilities)")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"BeamSearchParams(ignore_eos={self.ignore_eos!r}) must be True or False")


@dataclass
class BeamSearchSequence:
    """One hypothesis (vLLM's shape): ``tokens`` include the prompt's; ``text`` is their text
    (prompt included); ``cum_logprob`` the sum of the generated tokens' log-probabilities;
    ``logprobs`` per generated token ``{token_id: Logprob}``. minipaged adds ``output_token_ids``
    and ``output_text`` (the generated part alone) and ``score`` (what the beams were ranked by)."""

    tokens: list[int]
    logprobs: list = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    output_text: str | None = None
    score: float | None = None


@dataclass
class BeamSearchOutput:
    """One prompt's answer: its ``beam_width`` best hypotheses, best first."""

    sequences: list[BeamSearchSequence]
    request_id: str | None = None
    error: str | None = None  # why the request was rejected (then ``sequences`` is empty)


def beam_score(num_tokens: int, cum_logprob: float, last_is_eos: bool, length_penalty: float) -> float:
    """The rank of a hypothesis of ``num_tokens`` tokens (prompt included, as vLLM counts): its
    cumulative log-probability over its length ** length_penalty, a final EOS not counted."""
    n = num_tokens - (1 if last_is_eos else 0)
    return cum_logprob / (max(n, 1) ** length_penalty)


def beam_candidates(logits: torch.Tensor, beam_width: int, temperature: float) -> list[tuple[int, float]]:
    """The ``2 * beam_width`` most likely next tokens of one row of logits, as (token, logprob), best first."""
    row = logits.float()
    if temperature > 0:
        row = row / temperature
    lp = torch.log_softmax(row, dim=-1)
    vals, ids = torch.topk(lp, min(2 * beam_width, lp.numel()))
    return list(zip(ids.tolist(), vals.tolist()))


def select_beams(beams: list[tuple[Any, float, list[tuple[int, float]]]], beam_width: int, eos: Iterable[int],
                 ignore_eos: bool) -> tuple[list[tuple[Any, int, float]], list[tuple[Any, int, float]]]:
    """One step of the rule. ``beams``: (beam, its cumulative logprob, its candidates); returns
    (the next live beams as (parent, token, new cumulative logprob), best first; the finished
    hypotheses, as the same triples). Ties keep the order of the beams, then of their candidates."""
    eos = frozenset(() if ignore_eos else eos)
    live, done = [], []
    for beam, cum, cands in beams:
        for tok, lp in cands:
            (done if tok in eos else live).append((beam, tok, cum + lp))
    live.sort(key=lambda c: c[2], reverse=True)  # stable: ties keep their order
    return live[:beam_width], done


def reference_beam_search(next_logits: Callable[[list[int]], torch.Tensor], prompt_ids: list[int],
                          params: BeamSearchParams, eos: Iterable[int] = (),
                          max_model_len: int | None = None) -> list[BeamSearchSequence]:
    """The rule with no paging: ``next_logits(token_ids)`` gives the next token's logits (a 1-D
    tensor) of a whole sequence. Returns the ``beam_width`` best hypotheses, best first."""
    eos = tuple(eos)
    prompt = list(prompt_ids)
    live: list[tuple[list[int], float]] = [([], 0.0)]
    finished: list[tuple[list[int], float, str]] = []
    for step in range(params.max_tokens):
        beams = [(i, cum, beam_candidates(next_logits(prompt + out), params.beam_width, params.temperature))
                 for i, (out, cum) in enumerate(live)]
        nxt, done = select_beams(beams, params.beam_width, eos, params.ignore_eos)
        finished += [(live[i][0] + [tok], cum, "stop") for i, tok, cum in done]
        live = [(live[i][0] + [tok], cum) for i, tok, cum in nxt]
        full = max_model_len is not None and len(prompt) + step + 1 >= max_model_len
        if not live or full:
            break
    finished += [(out, cum, "length") for out, cum in live]
    return rank_hypotheses(prompt, finished, params, eos)


def rank_hypotheses(prompt: list[int], finished: list[tuple], params: BeamSearchParams,
                    eos: Iterable[int]) -> list[BeamSearchSequence]:
    """The ``beam_width`` best of ``finished`` (output tokens, cumulative logprob, finish reason and,
    optionally, the per-token logprobs), best first."""
    eos = frozenset(() if params.ignore_eos else eos)
    ranked = []
    for out, cum, reason, *rest in finished:
        s = beam_score(len(prompt) + len(out), cum, bool(out) and out[-1] in eos, params.length_penalty)
        ranked.append(BeamSearchSequence(tokens=prompt + list(out), logprobs=list(rest[0]) if rest else [],
                                         cum_logprob=cum, finish_reason=reason, output_token_ids=list(out), score=s))
    ranked.sort(key=lambda b: b.score, reverse=True)
    return ranked[: params.beam_width]


def worst_case_blocks(num_prompt_tokens: int, max_tokens: int, beam_width: int, block_size: int,
                      max_model_len: int | None = None) -> int:
    """The blocks a beam search may need at once with no sharing at all: every beam holding a
    whole copy (what a beam recomputed after a preemption holds). A search that needs more than
    the pool can never be sure to finish, so it is rejected."""
    total = num_prompt_tokens + max_tokens - 1
    if max_model_len is not None:
        total = min(total, max_model_len)
    return beam_width * (-(-total // block_size))


def sharing_saving(tables: Iterable[Iterable[int]]) -> tuple[int, int, float]:
    """The paper's memory saving for one moment: (blocks the tables would need without sharing,
    physical blocks they hold, blocks saved by sharing / blocks needed without it)."""
    tables = [list(t) for t in tables]
    logical = sum(len(t) for t in tables)
    physical = len({b for t in tables for b in t})
    return logical, physical, (logical - physical) / logical if logical else 0.0


class SharingCounter:
    """The saving over a run: each step adds the blocks its running tables would need without
    sharing and the blocks they hold; ``saving`` is (sum of the first - sum of the second) / sum of
    the first (each step weighs the same)."""

    def __init__(self) -> None:
        self.logical = 0
        self.physical = 0

    def add(self, tables: Iterable[Iterable[int]]) -> None:
        logical, physical, _ = sharing_saving(tables)
        self.logical += logical
        self.physical += physical

    @property
    def saving(self) -> float:
        return (self.logical - self.physical) / self.logical if self.logical else 0.0

    def as_dict(self) -> dict:
        return {"logical_blocks": self.logical, "physical_blocks": self.physical, "saving": self.saving}


class BeamGroup:
    """The engine's record of one beam search request: its live beams are the request's samples
    (``req.samples``), each a Sequence with its own block table. ``observe`` stores a beam's
    candidates when the step that computed its last token ends; once every live beam has them
    (and runs), ``advance`` applies the rule: finished hypotheses are kept aside, beams with no
    child are freed at once, a beam with k children keeps the first and forks k - 1 copies of its
    block table (blocks shared, ref counts raised; the scheduler copies the last partial block
    when a child writes into it). ``counts`` says how many forks and drops it did;
    ``sharing`` is the memory its beams saved by sharing (see ``SharingCounter``)."""

    def __init__(self, req: Any, params: BeamSearchParams, eos: Iterable[int], max_model_len: int | None) -> None:
        import itertools

        self.req, self.params, self.eos, self.max_model_len = req, params, tuple(eos), max_model_len
        first = req.seq.seq_id
        self.cum: dict = {first: 0.0}
        self.lps: dict = {first: []}
        self.pending: dict = {}
        self.finished: list[tuple] = []
        self._ids = itertools.count(1)
        self.counts = {"forked": 0, "dropped": 0, "steps": 0}
        self.sharing = SharingCounter()

    def worst_case_blocks(self, block_size: int) -> int:
        seq = self.req.seq
        return worst_case_blocks(seq.num_prompt_tokens, seq.max_tokens, self.params.beam_width, block_size,
                                 self.max_model_len)

    @property
    def beams(self) -> list:
        return [q for q in self.req.samples if not q.is_finished]

    @property
    def done(self) -> bool:
        return not self.beams

    def observe(self, seq: Any, logits: torch.Tensor) -> None:
        self.pending[seq.seq_id] = beam_candidates(logits, self.params.beam_width, self.params.temperature)

    def ready(self) -> bool:
        from .data import SequenceStatus

        beams = self.beams
        return bool(beams) and all(q.status is SequenceStatus.RUNNING and q.seq_id in self.pending for q in beams)

    def advance(self, scheduler: Any) -> tuple[list, list]:
        """One step of the rule on the scheduler's tables; returns (new sequences, sequences that left)."""
        from .data import FinishReason, Sequence, SequenceStatus
        from .detokenizer import StopChecker
        from .sampling import Logprob
        from .parts import fork_table, free_table

        beams = self.beams
        self.req.seq.forks = []  # the seats held for the first step are the beams' own now
        trip = [(q, self.cum[q.seq_id], self.pending.pop(q.seq_id)) for q in beams]
        nxt, done = select_beams(trip, self.params.beam_width, self.eos, self.params.ignore_eos)
        for q, tok, cum in done:
            lp = self.lps[q.seq_id] + [{tok: Logprob(cum - self.cum[q.seq_id])}]
            self.finished.append((q.output_token_ids + [tok], cum, "stop", lp))
        kids: dict = {}
        for q, tok, cum in nxt:
            kids.setdefault(q.seq_id, []).append((tok, cum))
        new, gone, moves = [], [], []
        for q in beams:
            mine = kids.get(q.seq_id)
            if not mine:  # no child: its blocks go back now
                table, q.block_table = q.block_table, None
                if table is not None:
                    getattr(scheduler, "free_table", free_table)(table)
                scheduler.finish(q, FinishReason.ABORT)
                gone.append(q)
                self.counts["dropped"] += 1
                continue
            for tok, cum in mine[1:]:  # forks first: they copy the parent's state before its token
                c = Sequence(f"{self.req.seq.seq_id}#b{next(self._ids)}", q.prompt_token_ids, max_tokens=q.max_tokens,
                             eos_token_ids=q.eos_token_ids, ignore_eos=True, sampling_params=q.sampling_params)
                c.output_token_ids = list(q.output_token_ids)
                c.block_table = getattr(scheduler, "fork_table", fork_table)(q.block_table)
                c.num_computed_tokens = q.num_computed_tokens
                c.stop_checker = StopChecker.for_sequence(c, max_model_len=self.max_model_len)
                c.stop_checker.num_output_tokens = len(c.output_token_ids)
                c.arrival_time, c.beam = q.arrival_time, self
                c.first_scheduled_time = getattr(q, "first_scheduled_time", None)
                c.first_token_time = q.first_token_time
                c.status = SequenceStatus.RUNNING
                scheduler.running.append(c)
                self.lps[c.seq_id] = list(self.lps[q.seq_id])
                self.cum[c.seq_id] = self.cum[q.seq_id]
                new.append(c)
                moves.append((c, tok, cum))
                self.counts["forked"] += 1
            moves.append((q, *mine[0]))
        for q, tok, cum in moves:
            self.lps[q.seq_id].append({tok: Logprob(cum - self.cum[q.seq_id])})
            self.cum[q.seq_id] = cum
            q.append_token(tok)
            if q.finish_reason is not None:  # max_tokens or the model's context
                self.finished.append((list(q.output_token_ids), cum, "length", self.lps[q.seq_id]))
                scheduler.finish(q, q.finish_reason)
                gone.append(q)
        self.req.samples = [q for q in self.req.samples if not q.is_finished] + [c for c in new if not c.is_finished]
        self.counts["steps"] += 1
        return new, gone

    def result(self, tokenizer: Any = None) -> list[BeamSearchSequence]:
        """The ``beam_width`` best hypotheses, best first, with their text when there is a tokenizer."""
        best = rank_hypotheses(list(self.req.seq.prompt_token_ids), self.finished, self.params, self.eos)
        if tokenizer is not None:
            for b in best:
                b.text = tokenizer.decode(b.tokens, skip_special_tokens=True)
                b.output_text = tokenizer.decode(b.output_token_ids, skip_special_tokens=True)
        return best


# -- the engine's side: queueing a search, handing it its logits, one step of the rule --------
def queue_beam_search(engine: Any, prompt: Any, params: BeamSearchParams, request_id: Any = None) -> str:
    """``LLMEngine.add_beam_request`` (inside its guard): the request's first beam, holding seats for
    the others from admission on, handed to the scheduler (which rejects it, saying why, when it
    can never fit)."""
    from .data import Sequence
    from .inputs import check_request_id, fit_max_tokens
    from .parts import require_support
    from .sampling import SamplingParams

    if not isinstance(params, BeamSearchParams):
        raise TypeError(f"params must be a minipaged.BeamSearchParams, got {type(params).__name__}")
    params.validate(engine.config.max_num_seqs)
    require_support(type(engine.scheduler), "schedule", "beam_search", "beam search", "scheduler")
    request_id = engine.new_request_id() if request_id is None else check_request_id(request_id)
    if request_id in engine.requests:
        raise ValueError(f"request id {request_id!r} is already in use by an unfinished request")
    token_ids = engine.encode_prompt(prompt)
    sp = fit_max_tokens(SamplingParams(max_tokens=params.max_tokens, temperature=0.0, ignore_eos=True), True,
                        len(token_ids), engine.config.max_model_len)
    req = engine._new_request(request_id, prompt, token_ids, sp)
    source = engine.tokenizer if engine.tokenizer is not None else engine.model.config
    group = BeamGroup(req, params, tuple(getattr(source, "eos_token_ids", ()) or ()), engine.config.max_model_len)
    seq = req.seq
    seq.beam = group
    # seats for the other beams from admission on (the scheduler counts a sequence's forks)
    seq.forks = [Sequence(f"{request_id}#seat{i}", token_ids, max_tokens=seq.max_tokens) for i in range(1, params.beam_width)]
    engine._queue(req)
    if request_id in engine.requests:
        engine._beams[request_id] = group
    return request_id


def observe_beams(engine: Any, inputs: Any, hidden: torch.Tensor, live: list[int]) -> list[int]:
    """Hand each beam's row of logits (of the step's live rows ``live``) to its group; return the other rows."""
    beams = [k for k in live if getattr(inputs.samplers[k].seq, "beam", None) is not None]
    if not beams:
        return live
    seqs = [inputs.samplers[k].seq for k in beams]
    logits = engine.executor.compute_logits(hidden[[inputs.sample_rows[k] for k in beams]])
    from .step_faults import fail_nonfinite

    bad = fail_nonfinite(engine, logits, seqs.__getitem__, "logits")
    for r, q in enumerate(seqs):
        if r not in bad and not q.is_finished:
            q.beam.observe(q, logits[r])
    taken = set(beams)
    return [k for k in live if k not in taken]


def advance_beams(engine: Any) -> list:
    """After update(): each beam search whose live beams all have their candidates takes one step
    of the rule (forks, drops, finished hypotheses); a search with no live beam left ends, and its
    output is returned."""
    import time

    outputs = []
    for rid, group in list(engine._beams.items()):
        if rid not in engine.requests:
            engine._beams.pop(rid, None)
            continue
        if not group.ready():
            continue
        new, gone = group.advance(engine.scheduler)
        if group.req.seq.first_token_time is None:
            group.req.seq.first_token_time = time.perf_counter() - engine.t0
        for q in new:
            engine._request_of[q.seq_id] = rid
        for q in gone:
            if q is not group.req.seq:
                engine._request_of.pop(q.seq_id, None)
            engine.totals.preemptions += q.num_preemptions
        if group.done:
            outputs.append(beam_output(engine, group))
    return outputs


def beam_output(engine: Any, group: BeamGroup) -> Any:
    """The final RequestOutput of a finished search: its hypotheses as samples, best first;
    ``beam_sequences`` holds them in vLLM's BeamSearchSequence form, ``beam_counts`` the forks,
    drops and the memory its beams saved by sharing."""
    import time

    from .outputs import CompletionOutput, RequestMetrics, RequestOutput

    req = group.req
    best = group.result(engine.tokenizer)
    engine._retire(req)
    engine.totals.generated_tokens += sum(len(b.output_token_ids) for b in best)
    now = time.perf_counter() - engine.t0
    outs = [CompletionOutput(i, b.output_text or "", list(b.output_token_ids), b.finish_reason, True,
                             cumulative_logprob=b.cum_logprob, logprobs=b.logprobs) for i, b in enumerate(best)]
    seq = req.seq
    metrics = RequestMetrics(arrival_time=seq.arrival_time, first_scheduled_time=getattr(seq, "first_scheduled_time", None),
                             first_token_time=seq.first_token_time, last_token_time=now, finished_time=now,
                             num_generation_tokens=sum(len(o.token_ids) for o in outs))
    first = outs[0] if outs else CompletionOutput(0, "", [], "length", True)
    out = RequestOutput(seq.seq_id, req.prompt, list(seq.prompt_token_ids), first.text, list(first.token_ids),
                        first.finish_reason, True, metrics=metrics, outputs=outs,
                        num_cached_tokens=getattr(seq, "num_cached_tokens", None))
    out.beam_sequences = best
    out.beam_counts = dict(group.counts, **group.sharing.as_dict())
    return out
