"""Speculative decoding with n-gram (prompt-lookup) drafts, on the paged KV cache.

Owns the three pieces speculation adds, each a pure function over the parts' public members,
and the per-engine state that ties them together (:class:`SpecDecoder`):

- **proposing** (:func:`propose_ngram`): the longest n-gram (``prompt_lookup_min`` ..
  ``prompt_lookup_max`` tokens) that ends the sequence and also occurs earlier in its own
  tokens, the most recent such occurrence, and up to ``k`` tokens that followed it there.
  No second model: the draft is a guess that the text repeats itself.
- **accepting** (:func:`accept_greedy`, :func:`verify_run`, :func:`accept_point_mass`): one
  forward pass scores the last real token and the ``d`` drafts, giving the target model's
  distribution at ``d + 1`` positions. The target's token is drawn at each position in turn
  (greedy: the argmax); a draft is kept while it equals that token, and the first token that
  differs (or the one after the last draft, the "bonus") ends the run. For a point-mass draft
  on ``x`` this *is* the standard rejection rule (Leviathan et al. 2023, Chen et al. 2023):
  accept with probability ``min(1, p(x) / q(x)) = p(x)``, else draw from
  ``norm(max(0, p - q))``, which is ``p`` with ``x`` removed and renormalised. Drawing
  ``t ~ p`` and accepting iff ``t == x`` accepts with probability ``p(x)`` and, when it
  rejects, leaves ``t`` distributed as ``p`` conditioned on ``t != x``: the same joint law, so
  the output distribution is the target's exactly (greedy: the same tokens exactly).
  ``accept_point_mass`` writes the rule out as the papers do; the tests check both forms
  against plain sampling.
- **rolling back** (:func:`truncate_table`, :func:`rollback`): the verifying step wrote K/V for
  every draft; the rejected ones' slots are cut off the block table, blocks left with no slot go
  back to the pool (last first), and ``num_computed_tokens`` follows. Written against
  ``BlockTableProtocol`` (``blocks``, ``num_tokens``, ``block_size``, ``allocator.free``), so it
  works on a learner's table too; a table class that defines ``truncate(num_tokens)`` (the
  optional member of the contract) is asked to do it itself.

- **backing off** (:class:`Backoff`): a draft costs a verifying step more than a plain decode (more
  rows, and never the whole-step decode route), so a sequence whose text does not repeat itself
  should stop proposing. After ``BACKOFF_AFTER`` drafts in a row with no token kept, the sequence
  proposes nothing for its next ``pause`` decode steps; the pause starts at ``PAUSE_FIRST`` steps
  and doubles each time it is served again without a kept token in between, up to ``PAUSE_MAX``;
  one kept draft token resets both. Proposing nothing changes no token (a step without drafts is
  plain decoding), so greedy exactness holds with the rule on or off (``SpecDecoder(backoff=False)``).

It never runs the model, never schedules, and never touches K/V data: a rejected slot is simply
no longer mapped, and the next step overwrites it.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence as Seq

from .parts import cdiv

SPEC_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size")
# Where the engine runs on a CPU and ``disable_by_batch_size`` is not given: a step of more running
# sequences proposes nothing. On a CPU a decode step turns compute-bound at a batch of about 4-8
# (lesson 07's knee), so past it every draft row costs nearly a full token's compute and a step of
# k + 1 rows a sequence runs slower than k + 1 plain steps would gain; on a GPU the knee is far
# higher and vLLM's default (never disabled) is kept.
CPU_DISABLE_BY_BATCH_SIZE = 8
METHODS = ("ngram",)


# -- the settings ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class SpeculativeConfig:
    """``speculative_config`` as vLLM spells it: ``{"method": "ngram", "num_speculative_tokens": k,
    "prompt_lookup_max": n, "prompt_lookup_min": m}``.

    As in vLLM: with neither lookup size given both are 5; with one given, the other equals it.
    """

    num_speculative_tokens: int
    prompt_lookup_max: int
    prompt_lookup_min: int
    method: str = "ngram"
    disable_by_batch_size: int | None = None  # no drafts in a step of more running sequences (None: never)

    @classmethod
    def from_dict(cls, spec: Any) -> "SpeculativeConfig | None":
        """None -> None; a dict (or a SpeculativeConfig) -> a checked SpeculativeConfig.
        Raises ValueError (TypeError for a non-dict) saying what is wrong and what is valid."""
        if spec is None or isinstance(spec, SpeculativeConfig):
            return spec
        if not isinstance(spec, dict):
            raise TypeError(
                f"speculative_config must be a dict like {{'method': 'ngram', 'num_speculative_tokens': 3, "
                f"'prompt_lookup_max': 4, 'prompt_lookup_min': 1}} or None, got {type(spec).__name__}"
            )
        for key in spec:
            if key not in SPEC_KEYS:
                near = difflib.get_close_matches(str(key), SPEC_KEYS, n=1)
                hint = f" Did you mean {near[0]!r}?" if near else ""
                raise ValueError(f"speculative_config has an unknown key {key!r}.{hint} Valid keys: {', '.join(SPEC_KEYS)}")
        method = spec.get("method", "ngram")
        if method not in METHODS:
            raise ValueError(
                f"speculative_config method {method!r} is not supported: minipaged proposes drafts by n-gram lookup "
                f"in the sequence's own tokens only (method 'ngram'; vLLM's draft-model, EAGLE and MTP methods need a "
                "second model)"
            )

        def count(name: str, value: Any) -> int:
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config {name} must be an int >= 1, got {value!r}")
            return value

        if "num_speculative_tokens" not in spec:
            raise ValueError("speculative_config needs num_speculative_tokens (k, the most drafts a step verifies), e.g. 3")
        k = count("num_speculative_tokens", spec["num_speculative_tokens"])
        hi, lo = spec.get("prompt_lookup_max"), spec.get("prompt_lookup_min")
        lo = None if lo is None else count("prompt_lookup_min", lo)
        hi = None if hi is None else count("prompt_lookup_max", hi)
        if hi is None and lo is None:
            hi = lo = 5
        elif hi is None:
            hi = lo
        elif lo is None:
            lo = hi
        if lo > hi:
            raise ValueError(
                f"speculative_config prompt_lookup_min={lo} > prompt_lookup_max={hi}: the shortest n-gram to look up "
                "must not be longer than the longest"
            )
        off_at = spec.get("disable_by_batch_size")
        off_at = None if off_at is None else count("disable_by_batch_size", off_at)
        return cls(num_speculative_tokens=k, prompt_lookup_max=hi, prompt_lookup_min=lo, method=method,
                   disable_by_batch_size=off_at)

    def as_dict(self) -> dict:
        return {"method": self.method, "num_speculative_tokens": self.num_speculative_tokens,
                "prompt_lookup_max": self.prompt_lookup_max, "prompt_lookup_min": self.prompt_lookup_min,
                "disable_by_batch_size": self.disable_by_batch_size}


# -- proposing ------------------------------------------------------------------------------------
def propose_ngram(token_ids: Seq[int], num_tokens: int, min_n: int, max_n: int) -> list[int]:
    """Up to ``num_tokens`` draft tokens for a sequence whose tokens so far are ``token_ids``.

    The suffix of ``token_ids`` of length ``n`` (the largest ``n`` in ``min_n..max_n`` that
    occurs earlier) is looked up; at its most recent earlier occurrence, the tokens that followed
    it are the draft. An earlier occurrence may overlap the suffix. ``[]`` when no suffix of at
    least ``min_n`` tokens occurs earlier.

    One pass from the end: every earlier position holding the last token is a candidate end of
    a match, extended backwards up to ``max_n`` tokens.
    """
    toks = token_ids if isinstance(token_ids, list) else list(token_ids)
    L = len(toks)
    if num_tokens < 1 or min_n < 1 or max_n < min_n or L < min_n + 1:
        return []
    rev = toks[::-1]  # rev[r] is toks[L - 1 - r]: the suffix reads forwards from rev[0]
    last = rev[0]
    best_len, best_r = 0, -1
    r = 0
    while True:
        try:  # the next earlier position holding the last token (list.index runs in C)
            r = rev.index(last, r + 1)
        except ValueError:
            break
        m = 1
        while m < max_n and r + m < L and rev[r + m] == rev[m]:
            m += 1
        if m > best_len:
            best_len, best_r = m, r
            if m == max_n:
                break
    if best_len < min_n:
        return []
    best_end = L - 1 - best_r
    return list(toks[best_end + 1 : best_end + 1 + num_tokens])


def draft_room(seq: Any, max_model_len: int | None = None) -> int:
    """How many drafts ``seq`` can verify without writing K/V past what it may ever hold: its
    ``max_total_tokens`` (prompt + max_tokens - 1, what the scheduler admitted it for) and the
    model's context. A verifying step writes slots up to ``num_tokens + d - 1``."""
    room = seq.max_total_tokens - seq.num_tokens
    if max_model_len is not None:
        room = min(room, max_model_len - seq.num_tokens)
    return max(0, room)


# -- accepting ------------------------------------------------------------------------------------
def verify_run(draft: Seq[int], target_at: Callable[[int], int]) -> list[int]:
    """The tokens a verifying step appends: ``target_at(j)`` draws the target's token at verified
    position ``j`` (0: after the last real token; ``j``: after ``draft[:j]``), called in order and
    only while the drafts before ``j`` were kept. The run ends at the first target token that
    differs from its draft, or at ``target_at(len(draft))``, the bonus token after every draft
    was kept: 1 to ``len(draft) + 1`` tokens, each one the target's own."""
    out: list[int] = []
    for j in range(len(draft) + 1):
        t = int(target_at(j))
        out.append(t)
        if j == len(draft) or t != draft[j]:
            break
    return out


def accept_greedy(draft: Seq[int], target: Seq[int]) -> list[int]:
    """Greedy acceptance: ``target`` holds the argmax at each of the ``len(draft) + 1`` verified
    positions. Keeps the longest prefix of ``draft`` equal to ``target``, then target's next token."""
    if len(target) != len(draft) + 1:
        raise ValueError(f"{len(draft)} draft token(s) need {len(draft) + 1} target tokens, got {len(target)}")
    return verify_run(draft, lambda j: target[j])


def accept_point_mass(draft_token: int, probs: Any, generator: Any = None) -> tuple[bool, int]:
    """The rejection rule of speculative sampling for a draft that is a point mass on ``x``,
    written out as the papers state it: accept ``x`` with probability ``min(1, p(x) / q(x)) =
    p(x)``; else draw from ``norm(max(0, p - q))``: ``p`` with ``x`` removed and renormalised.
    ``probs``: the target's distribution (a 1-D tensor summing to 1). Returns (accepted, token)."""
    import torch

    x = int(draft_token)
    u = float(torch.rand((), generator=generator))
    if u < float(probs[x]):
        return True, x
    residual = probs.double().clone()
    residual[x] = 0.0
    total = float(residual.sum())
    if total <= 0.0:  # p puts (numerically) all its mass on x
        return True, x
    return False, int(torch.multinomial((residual / total).float(), 1, generator=generator).item())


# -- rolling back ---------------------------------------------------------------------------------
def truncate_table(table: Any, num_tokens: int) -> list[int]:
    """Cut ``table`` back to its first ``num_tokens`` token slots; every block left holding no
    slot goes back to the pool, last block first. Returns the blocks given back.

    Any ``BlockTableProtocol`` table; one whose class defines ``truncate(num_tokens)`` does it
    itself (and must leave the same state). A block shared with another table (a fork, a cached
    prefix) only loses this table's reference."""
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or not 0 <= num_tokens <= table.num_tokens:
        raise ValueError(f"cannot truncate a table of {table.num_tokens} token slot(s) to {num_tokens!r}: "
                         "a rollback keeps 0..num_tokens slots, it never grows the table")
    keep = cdiv(num_tokens, table.block_size)
    dropped = list(table.blocks[keep:])
    own = getattr(type(table), "truncate", None)
    if own is not None:
        table.truncate(num_tokens)
        return dropped
    for b in reversed(dropped):
        table.allocator.free(b)
    table.blocks = list(table.blocks[:keep])
    table.num_tokens = num_tokens
    return dropped


def rollback(seq: Any, num_verified: int) -> list[int]:
    """``seq``'s K/V keeps positions ``0..num_verified-1`` (the verified tokens): the block table
    truncates there and ``num_computed_tokens`` follows. Returns the blocks given back."""
    dropped = truncate_table(seq.block_table, num_verified)
    seq.num_computed_tokens = min(seq.num_computed_tokens, num_verified)
    return dropped


# -- the engine's state ---------------------------------------------------------------------------
@dataclass
class SpecStats:
    """Counts in vLLM's spec-decode metric terms: a *draft* is one sequence's proposal verified
    in one step (``num_drafts``), of ``num_draft_tokens`` tokens in all, ``num_accepted_tokens``
    of them kept; ``accepted_per_pos[i]``: how often the draft token at position ``i`` was kept."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list = field(default_factory=list)

    def add(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        while len(self.accepted_per_pos) < num_draft_tokens:
            self.accepted_per_pos.append(0)
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float:
        """Kept draft tokens / proposed draft tokens."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verifying step gives a sequence, on average: 1 (the target's own) + the kept drafts."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def as_dict(self) -> dict:
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens, "acceptance_rate": self.acceptance_rate,
                "mean_acceptance_length": self.mean_acceptance_length, "accepted_per_pos": list(self.accepted_per_pos)}


def speculates(params: Any) -> bool:
    """Whether a request with these SamplingParams gets drafts: its token at each position must be
    the sampler's plain choice from that position's logits alone (greedy, or temperature / top-k /
    top-p / min-p sampling). Penalties, biases, masks, min_tokens and logprobs depend on, or are
    reported per, the tokens before: those requests decode one token a step."""
    if params is None:
        return True
    return not getattr(params, "changes_logits", False) and getattr(params, "logprobs", None) is None


BACKOFF_AFTER = 3  # drafts in a row with no token kept before a sequence pauses proposing
PAUSE_FIRST = 8  # decode steps of the first pause
PAUSE_MAX = 128  # the longest pause


@dataclass
class Backoff:
    """One sequence's back-off state (see the module's docstring): ``misses``, drafts in a row with
    no token kept; ``skip``, decode steps left to propose nothing; ``pause``, the next pause's length."""

    misses: int = 0
    skip: int = 0
    pause: int = PAUSE_FIRST

    def wants_draft(self) -> bool:
        """Asked once per decode step: False while a pause lasts (and counts that step off)."""
        if self.skip > 0:
            self.skip -= 1
            return False
        return True

    def record(self, num_accepted: int) -> bool:
        """After a verified draft; True when this one starts a pause."""
        if num_accepted > 0:
            self.misses, self.pause = 0, PAUSE_FIRST
            return False
        self.misses += 1
        if self.misses < BACKOFF_AFTER:
            return False
        self.misses, self.skip = 0, self.pause
        self.pause = min(2 * self.pause, PAUSE_MAX)
        return True


class SpecDecoder:
    """One per engine when ``speculative_config`` is set: proposes each step's drafts, verifies them
    after the forward pass, and counts. The scheduler budgets ``seq.spec_token_ids``; the update
    (``Scheduler.update``) rolls the rejected drafts back with :func:`rollback`. ``backoff``: pause a
    sequence's proposals while its drafts keep failing (:class:`Backoff`)."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int | None = None, backoff: bool = True,
                 disable_by_batch_size: int | None = None, proposer: Callable | None = None) -> None:
        self.config = config
        self.proposer = proposer  # propose_ngram's signature (interfaces.ProposerFn); None: propose_ngram
        self.max_model_len = max_model_len
        self.backoff = backoff
        # the config's value, else the engine's default for its device (CPU_DISABLE_BY_BATCH_SIZE on a CPU)
        self.disable_by_batch_size = (config.disable_by_batch_size if config.disable_by_batch_size is not None
                                      else disable_by_batch_size)
        self.num_batch_off_steps = 0  # steps that proposed nothing because the batch was too large
        self.stats = SpecStats()
        self.per_seq: dict[Any, SpecStats] = {}
        self._backoff: dict[Any, Backoff] = {}
        self.num_pauses = 0  # pauses started (all sequences)
        self.num_paused_steps = 0  # decode steps a sequence proposed nothing because it was paused

    # before the step
    def propose(self, running: Seq[Any]) -> None:
        """Give every running sequence that is about to decode its drafts (``seq.spec_token_ids``);
        every other one none."""
        c = self.config
        if self.disable_by_batch_size is not None and len(running) > self.disable_by_batch_size:
            for seq in running:  # a compute-bound step: drafts would cost more than they save
                seq.spec_token_ids = []
            self.num_batch_off_steps += 1
            return
        for seq in running:
            drafts: list[int] = []
            if (seq.output_token_ids and seq.num_computed_tokens == seq.num_tokens - 1 and not seq.forks
                    and speculates(seq.sampling_params)):
                k = min(c.num_speculative_tokens, draft_room(seq, self.max_model_len))
                if k > 0 and self.backoff and not self._backoff.setdefault(seq.seq_id, Backoff()).wants_draft():
                    self.num_paused_steps += 1
                    k = 0
                if k > 0:
                    drafts = (self.proposer or propose_ngram)(seq.token_ids, k, c.prompt_lookup_min, c.prompt_lookup_max)
            seq.spec_token_ids = drafts

    def clear(self, seqs: Seq[Any]) -> None:
        """After a step: no draft outlives the step it was proposed for."""
        for seq in seqs:
            if seq.spec_token_ids:
                seq.spec_token_ids = []

    # after the forward pass
    def verify(self, inputs: Any, hidden: Any, sampled: dict, compute_logits: Callable, sampler: Any,
               structured: Any = None) -> dict:
        """``sampled`` holds each sequence's token at its last real position (the engine's usual
        choice); for a sequence that verified ``d > 0`` drafts, it becomes the accepted run (a list:
        kept drafts, then the target's next token). ``inputs``: the runner's StepInputs
        (``sample_rows`` and ``num_drafts``); ``compute_logits(hidden_rows)``: the executor's.
        ``structured`` (the engine's StructuredOutputs, or None): a constrained sequence's target at
        each position is chosen from logits masked by its grammar after the drafts before it, so
        a draft the grammar refuses is never kept."""
        import torch

        spec = [(i, s, d) for i, (s, d) in enumerate(zip(inputs.samplers, inputs.num_drafts))
                if d > 0 and s.seq.seq_id in sampled]  # (a request a non-finite value ended has none)
        if not spec:
            return sampled
        rows = [inputs.sample_rows[i] + 1 + j for i, _, d in spec for j in range(d)]
        logits = compute_logits(hidden[torch.tensor(rows, dtype=torch.long, device=hidden.device)])
        argmax = logits.max(dim=-1).indices.tolist()  # the sampler's own greedy choice (first maximum)
        at = 0
        for i, s, d in spec:
            seq = s.seq
            draft = [int(t) for t in seq.spec_token_ids[:d]]
            if len(draft) != d:
                raise RuntimeError(f"sequence {seq.seq_id!r} verified {d} draft(s) but holds {len(draft)}")
            params = seq.sampling_params
            first = sampled[seq.seq_id]
            base = at

            def target_at(j: int, base=base, first=first, seq=seq, params=params, draft=draft) -> int:
                if j == 0:
                    return first
                if structured is not None and structured.wants(seq):
                    row = structured.mask_after(seq, draft[:j], logits[base + j - 1 : base + j])
                    return int(row.argmax()) if params.greedy else sampler(row, [seq.seq_id], [params])[0]
                if params is None or params.greedy:
                    return argmax[base + j - 1]
                return sampler(logits[base + j - 1 : base + j], [seq.seq_id], [params])[0]

            run = verify_run(draft, target_at)
            at += d
            sampled[seq.seq_id] = run
            self.stats.add(d, len(run) - 1)
            self.per_seq.setdefault(seq.seq_id, SpecStats()).add(d, len(run) - 1)
            if self.backoff and self._backoff.setdefault(seq.seq_id, Backoff()).record(len(run) - 1):
                self.num_pauses += 1
        return sampled

    def request_metrics(self, seq_ids: Seq[Any]) -> dict | None:
        """A request's counts over its samples (``RequestMetrics.spec_decode``), ``accepted_per_pos``
        included (a server's ``/metrics`` adds them up); None when none of them verified a draft."""
        mine = [self.per_seq[q] for q in seq_ids if q in self.per_seq]
        if not mine:
            return None
        total = SpecStats()
        for m in mine:
            total.num_drafts += m.num_drafts
            total.num_draft_tokens += m.num_draft_tokens
            total.num_accepted_tokens += m.num_accepted_tokens
            total.accepted_per_pos += [0] * (len(m.accepted_per_pos) - len(total.accepted_per_pos))
            for i, c in enumerate(m.accepted_per_pos):
                total.accepted_per_pos[i] += c
        return total.as_dict()

    def forget(self, seq_id: Any) -> None:
        self.per_seq.pop(seq_id, None)
        self._backoff.pop(seq_id, None)

    def as_dict(self) -> dict:
        return {**self.config.as_dict(), "disable_by_batch_size": self.disable_by_batch_size, **self.stats.as_dict(),
                "backoff": self.backoff, "num_pauses": self.num_pauses, "num_paused_steps": self.num_paused_steps,
                "num_batch_off_steps": self.num_batch_off_steps}


__all__ = [
    "SPEC_KEYS", "CPU_DISABLE_BY_BATCH_SIZE", "SpeculativeConfig", "propose_ngram", "draft_room", "verify_run", "accept_greedy",
    "accept_point_mass", "truncate_table", "rollback", "SpecStats", "speculates", "Backoff", "BACKOFF_AFTER",
    "PAUSE_FIRST", "PAUSE_MAX", "SpecDecoder",
]
