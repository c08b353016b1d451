"""How the next token is chosen: SamplingParams (vLLM's names) and the Sampler.

Owns per-request randomness: each request draws from its own seeded generator, so a seeded
answer is the same whether the request runs alone or inside a busy batch.

What the Sampler does to one row of logits, in vLLM's order (vllm/v1/sample/sampler.py):

1. ``logprobs``: the log-softmax of the raw logits, before anything below changes them
   (vLLM's default ``logprobs_mode="raw_logprobs"``);
2. ``allowed_token_ids`` (every other token gets -inf), ``min_tokens`` (EOS and the stop token
   ids get -inf until that many tokens are out), ``logit_bias`` (added to the logits);
3. the penalties, as vLLM defines them (vllm/model_executor/layers/utils.py ``apply_penalties``):
   ``repetition_penalty`` r, for every token seen in the prompt or the output so far:
   ``logit / r`` where the logit is > 0, else ``logit * r`` (the CTRL paper's rule);
   ``frequency_penalty`` f: ``logit -= f * (times the token is in the output)``;
   ``presence_penalty`` p: ``logit -= p`` once the token is in the output (the last two, as
   OpenAI defines them, count only generated tokens);
4. greedy (``temperature=0``): the argmax. Otherwise ``logits / temperature``, then ``min_p``
   (drop tokens whose probability is below ``min_p`` times the top one's), ``top_k``, ``top_p``,
   and a draw from the request's own generator.
"""
from __future__ import annotations

import copy
import difflib
import math
from dataclasses import KW_ONLY, dataclass, field, fields
from typing import Any

import torch


MIN_TEMPERATURE = 1e-2  # below this, softmax(logits / T) under/overflows in fp32: use 0 (greedy) instead
MAX_SEED = 2**63 - 1
MAX_LOGPROBS = 20  # vLLM's default max_logprobs (and OpenAI's top_logprobs limit)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


class UnsupportedSamplingParam(ValueError):
    """A field vLLM's SamplingParams has and minipaged does not implement, set to a value that matters."""


# vLLM's SamplingParams fields that minipaged does not implement, and the values that mean
# "not used" (which are accepted, so code that spells out vLLM's defaults still runs).
UNSUPPORTED: dict[str, tuple] = {
    "best_of": (None,),  # also accepted when equal to n
    "logits_processors": (None, []),
    "truncate_prompt_tokens": (None,),
    "guided_decoding": (None,),
    "bad_words": (None, []),
    "output_kind": (None,),
    "extra_args": (None, {}),
    "use_beam_search": (False,),
    "length_penalty": (1.0,),
    "early_stopping": (False,),
    "output_text_buffer_length": (0,),
    "flat_logprobs": (False,),
}


def _unsupported(name: str, value) -> UnsupportedSamplingParam:
    return UnsupportedSamplingParam(
        f"SamplingParams({name}={value!r}): {name} is a vLLM sampling parameter that minipaged does not "
        f"support (unsupported); leave it out or use its default {UNSUPPORTED[name][0]!r}"
    )


@dataclass
class SamplingParams:
    """vLLM's sampling parameters (the ones minipaged implements; see ``UNSUPPORTED`` for the rest).

    ``temperature=0`` is greedy. ``top_k<=0`` and ``top_p=1`` switch those filters off.
    ``max_tokens=None`` generates until the model's context is full (or a stop rule ends it).

    ``validate()`` checks every field, and it runs twice: when the params are made, and again
    when a request is added (``LLMEngine.add_request``). So a field set after construction
    (``sp.repetition_penalty = 1.2``, as vLLM scripts do) takes effect for every request added
    afterwards, and a bad value set that way is refused there with the message construction would
    have given. ``temperature`` is 0 or a finite number >= MIN_TEMPERATURE (0.01); ``seed`` is None
    or an int in 0..2**63-1; ``bool`` is never taken for an int. A misspelt keyword is a TypeError
    and a name that is no field an AttributeError, each naming the nearest field.
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)  # stop strings: the text is cut before them
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False  # benchmarks set it, so every system generates exactly max_tokens
    # n > 1: n samples of one prompt, computed once and sharing its KV blocks (copy-on-write).
    # With a seed, sample i draws from seed + i, so it equals a single request with that seed.
    n: int = 1
    # vLLM's other fields (after minipaged's first nine, so positional calls keep their meaning)
    min_p: float = 0.0
    min_tokens: int = 0  # EOS and stop token ids are masked until this many tokens are out
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # per generated token: the sampled token's logprob and the top-k
    prompt_logprobs: int | None = None  # per prompt token (the first gets None): its logprob and the top-k
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (clamped to [-100, 100])
    allowed_token_ids: list[int] | None = None
    # vLLM's fields minipaged does not implement (UNSUPPORTED): only the values that mean "not
    # used" are taken, so code that spells out vLLM's defaults still runs
    _: KW_ONLY
    best_of: int | None = field(default=None, repr=False)  # also taken when equal to n
    logits_processors: Any = field(default=None, repr=False)
    truncate_prompt_tokens: int | None = field(default=None, repr=False)
    guided_decoding: Any = field(default=None, repr=False)
    # a StructuredOutputsParams (minipaged.structured_params): the grammar the output must follow
    structured_outputs: Any = field(default=None, repr=False)
    bad_words: list[str] | None = field(default=None, repr=False)
    output_kind: Any = field(default=None, repr=False)
    extra_args: dict | None = field(default=None, repr=False)
    use_beam_search: bool = field(default=False, repr=False)
    length_penalty: float = field(default=1.0, repr=False)
    early_stopping: bool = field(default=False, repr=False)
    output_text_buffer_length: int = field(default=0, repr=False)
    flat_logprobs: bool = field(default=False, repr=False)

    def __new__(cls, *args: Any, **kwargs: Any) -> "SamplingParams":
        # the generated __init__ would say only "unexpected keyword argument": name the nearest field
        for name in kwargs:
            if name not in _FIELD_NAMES:
                raise TypeError(f"SamplingParams got an unknown field {name!r}{_nearest_field(name)}")
        return object.__new__(cls)

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        self.validate()

    def __setattr__(self, name: str, value: Any) -> None:
        """A name that is no field is refused (a typo would otherwise change nothing, silently); a
        value is not checked here but by ``validate()``, when the next request is added."""
        if name not in _FIELD_NAMES:
            raise AttributeError(f"SamplingParams has no field {name!r}{_nearest_field(name)}")
        if name == "stop" and isinstance(value, str):
            value = [value]
        object.__setattr__(self, name, value)

    def validate(self) -> None:
        """Raise ValueError (TypeError for a wrong type) naming the bad field and what it takes."""
        self._refuse_unsupported()
        self._check_choice()
        self._check_counts_and_logits()
        self._check_structured()

    def _check_structured(self) -> None:
        """``structured_outputs``: None or a StructuredOutputsParams (a dict is taken as its fields)."""
        if self.structured_outputs is None:
            return
        from .structured_params import StructuredOutputsParams

        if isinstance(self.structured_outputs, dict):
            object.__setattr__(self, "structured_outputs", StructuredOutputsParams.from_dict(self.structured_outputs))
        if not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError("structured_outputs must be a minipaged.sampling_params.StructuredOutputsParams, got "
                             f"{type(self.structured_outputs).__name__}")
        if self.ignore_eos:
            raise ValueError("structured_outputs with ignore_eos=True: a satisfied grammar ends the text with EOS, "
                             "which ignore_eos would skip; leave ignore_eos False (max_tokens still bounds the length)")

    def _check_choice(self) -> None:
        """How a token is chosen and when the text stops: max_tokens, temperature, the filters,
        the seed, the stop rules and the flags."""
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an int >= 1 or None (to the end of the context), got {self.max_tokens!r}")
        t = self.temperature
        if not _is_real(t) or not math.isfinite(t) or t < 0 or 0 < t < MIN_TEMPERATURE:
            raise ValueError(
                f"temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE}, got {t!r}: "
                "smaller temperatures overflow the softmax; use 0 for the most likely token"
            )
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be a number in (0, 1] (1 keeps every token), got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be an int >= 0 (0 or -1 keeps every token), got {self.top_k!r}")
        if not _is_real(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be a number in [0, 1] (0 keeps every token), got {self.min_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= MAX_SEED):
            raise ValueError(f"seed must be None or an int in 0..2**63-1, got {self.seed!r}")
        if not isinstance(self.stop, (list, tuple)) or any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be a string or a list of non-empty strings, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, (list, tuple)) or any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be a list of token ids (ints >= 0), got {self.stop_token_ids!r}")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens", "detokenize"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if not self.spaces_between_special_tokens:
            raise UnsupportedSamplingParam("SamplingParams(spaces_between_special_tokens=False) is unsupported by minipaged: "
                                           "its tokenizer decodes special tokens without added spaces; leave it True")
        if not self.detokenize:
            raise UnsupportedSamplingParam("SamplingParams(detokenize=False) is unsupported by minipaged: the text is always "
                                           "made (read token_ids if you only need ids); leave it True")

    def _check_counts_and_logits(self) -> None:
        """The samples (n, min_tokens) and what changes or reports the logits: penalties,
        logprobs, logit_bias, allowed_token_ids."""
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n (samples of the prompt) must be an int >= 1, got {self.n!r}")
        if self.seed is not None and self.seed + self.n - 1 > MAX_SEED:
            raise ValueError(f"sample i uses seed + i: seed={self.seed} with n={self.n} passes 2**63-1; use a smaller seed")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an int >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_real(v) or not -2 <= v <= 2:
                raise ValueError(f"{name} must be a number in [-2, 2] (0 is off), got {v!r}")
        r = self.repetition_penalty
        if not _is_real(r) or not math.isfinite(r) or r <= 0:
            raise ValueError(f"repetition_penalty must be a finite number > 0 (1 is off), got {r!r}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or not 0 <= v <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be None or an int in 0..{MAX_LOGPROBS} (top tokens per position), got {v!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or any(
                    not (_is_int(k) or isinstance(k, str) and k.lstrip("-").isdigit()) or not _is_real(v) or not math.isfinite(v)
                    for k, v in self.logit_bias.items()):
                raise ValueError(f"logit_bias must be a dict of token id -> finite number, got {self.logit_bias!r}")
            if any(int(k) < 0 for k in self.logit_bias):
                raise ValueError(f"logit_bias keys must be token ids (ints >= 0), got {sorted(self.logit_bias)[:5]}")
        if self.allowed_token_ids is not None and (
                not isinstance(self.allowed_token_ids, (list, tuple)) or not self.allowed_token_ids
                or any(not _is_int(t) or t < 0 for t in self.allowed_token_ids)):
            raise ValueError(f"allowed_token_ids must be None or a non-empty list of token ids, got {self.allowed_token_ids!r}")

    def _refuse_unsupported(self) -> None:
        """UnsupportedSamplingParam for one of vLLM's fields that minipaged lacks, set to a value that matters."""
        for name, unused in UNSUPPORTED.items():
            value = getattr(self, name)
            if name == "best_of" and value in (None, self.n):
                continue
            if name == "best_of":
                raise UnsupportedSamplingParam(
                    f"SamplingParams(best_of={value!r}) is unsupported: best_of was removed in vLLM V1, and minipaged follows V1. "
                    f"To keep the best of {value} samples, ask for n={value} (with logprobs=0) and pick the output "
                    "with the highest cumulative_logprob yourself, or use beam search")
            if not any(value == ok and type(value) is type(ok) for ok in unused):
                raise _unsupported(name, value)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def all_stop_token_ids(self) -> set[int]:
        return set(self.stop_token_ids)

    @property
    def needs_logits(self) -> bool:
        """True when the next token cannot be taken as the plain argmax of the model's head
        (logprobs are wanted, or something changes the logits first)."""
        return (not self.greedy or self.logprobs is not None or self.min_tokens > 0 or bool(self.logit_bias)
                or self.structured_outputs is not None
                or self.allowed_token_ids is not None or self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)

    @property
    def changes_logits(self) -> bool:
        """True when something is applied to the logits before the choice (penalties, bias, masks)."""
        return (self.min_tokens > 0 or bool(self.logit_bias) or self.allowed_token_ids is not None
                or self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1)

    def max_tokens_for(self, num_prompt_tokens: int, max_model_len: int) -> int:
        """``max_tokens``, with None resolved to the room left in the context (at least 1)."""
        if self.max_tokens is not None:
            return self.max_tokens
        return max(1, max_model_len - num_prompt_tokens)

    def clone(self) -> "SamplingParams":
        return copy.deepcopy(self)


_FIELD_NAMES = frozenset(f.name for f in fields(SamplingParams))


def _nearest_field(name: str) -> str:
    near = difflib.get_close_matches(name, sorted(_FIELD_NAMES), n=1)
    return f"; did you mean {near[0]!r}?" if near else ""


@dataclass
class Logprob:
    """vLLM's Logprob: one token's log-probability, its rank in the distribution (1 = the most
    likely), and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


def _filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits: (V,). Tokens outside top-k / the top-p nucleus get -inf."""
    if top_k > 0 and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        # keep a token while the mass before it is < top_p (so the first is always kept)
        drop_sorted = (cum - torch.softmax(sorted_logits, dim=-1)) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def apply_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """logits: (V,) after temperature. Tokens whose probability is below ``min_p`` times the most
    likely token's get -inf (the most likely token always stays)."""
    if min_p <= 0:
        return logits
    probs = torch.softmax(logits, dim=-1)
    return logits.masked_fill(probs < min_p * probs.max(), float("-inf"))


def apply_penalties(logits: torch.Tensor, prompt_ids, output_ids, presence: float, frequency: float,
                    repetition: float) -> torch.Tensor:
    """logits: (V,). vLLM's penalties (see the module docstring); returns a new tensor."""
    V = logits.shape[-1]
    logits = logits.clone()
    out = torch.as_tensor(list(output_ids), dtype=torch.long, device=logits.device)
    out = out[(out >= 0) & (out < V)]
    counts = torch.bincount(out, minlength=V).to(logits.dtype) if out.numel() else torch.zeros(V, dtype=logits.dtype, device=logits.device)
    if repetition != 1.0:
        seen = counts > 0
        pr = torch.as_tensor(list(prompt_ids), dtype=torch.long, device=logits.device)
        pr = pr[(pr >= 0) & (pr < V)]
        if pr.numel():
            seen[pr] = True
        penalised = torch.where(logits > 0, logits / repetition, logits * repetition)
        logits = torch.where(seen, penalised, logits)
    if frequency != 0.0:
        logits -= frequency * counts
    if presence != 0.0:
        logits -= presence * (counts > 0).to(logits.dtype)
    return logits


def top_logprobs(logprobs: torch.Tensor, chosen: int, k: int, decode=None) -> dict[int, Logprob]:
    """logprobs: (V,) log-softmax. vLLM's shape: the chosen token first (with its rank), then the
    top ``k`` by rank (the chosen one again only once)."""
    lp = float(logprobs[chosen])
    rank = int((logprobs > logprobs[chosen]).sum().item()) + 1
    entries = {chosen: Logprob(lp, rank, decode(chosen) if decode else None)}
    if k > 0:
        vals, ids = torch.topk(logprobs, min(k, logprobs.numel()))
        for r, (v, t) in enumerate(zip(vals.tolist(), ids.tolist()), start=1):
            if t not in entries:
                entries[t] = Logprob(float(v), r, decode(t) if decode else None)
    return entries


def prompt_logprobs_of(logits: torch.Tensor, token_ids: list[int], k: int, decode=None) -> list:
    """logits: (L, V), row i predicting token i + 1. vLLM's prompt_logprobs: None for the first
    prompt token, then for each later one a dict like ``top_logprobs`` (that token first)."""
    lps = torch.log_softmax(logits.float(), dim=-1)
    out: list = [None]
    for i in range(1, len(token_ids)):
        out.append(top_logprobs(lps[i - 1], token_ids[i], k, decode))
    return out


class _State:
    __slots__ = ("params", "seq", "prompt", "output", "eos", "logprobs", "cumulative")

    def __init__(self, params, seq, prompt, eos) -> None:
        self.params, self.seq, self.prompt, self.eos = params, seq, list(prompt or ()), tuple(eos or ())
        self.output: list[int] = []  # tokens this sampler chose (used when no sequence is given)
        self.logprobs: list | None = [] if params.logprobs is not None else None
        self.cumulative = 0.0


class Sampler:
    """One next token per row of logits.

    ``add(seq_id, params, seq=None, eos_token_ids=())`` before a sequence's first token: with
    ``seq`` (its Sequence) the penalties read its prompt and output tokens; without one they
    read the tokens this sampler chose for it. ``logprobs(seq_id)`` / ``cumulative_logprob(seq_id)``:
    what a request with ``SamplingParams(logprobs=k)`` has been given so far. ``decode`` (a
    function of one token id, or None) fills ``Logprob.decoded_token``.
    """

    def __init__(self) -> None:
        self._generators: dict = {}
        self._states: dict = {}
        self.decode = None

    def add(self, seq_id, params: SamplingParams, seq=None, eos_token_ids=(), prompt_token_ids=None) -> None:
        if not params.greedy:
            g = torch.Generator()
            g.manual_seed(params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,)).item()))
            self._generators[seq_id] = g
        if params.changes_logits or params.logprobs is not None:
            if prompt_token_ids is None and seq is not None:
                prompt_token_ids = getattr(seq, "prompt_token_ids", None)
            if not eos_token_ids and seq is not None:
                eos_token_ids = getattr(seq, "eos_token_ids", ())
            self._states[seq_id] = _State(params, seq, prompt_token_ids, eos_token_ids)

    def remove(self, seq_id) -> None:
        self._generators.pop(seq_id, None)
        self._states.pop(seq_id, None)

    def logprobs(self, seq_id) -> list | None:
        st = self._states.get(seq_id)
        return None if st is None or st.logprobs is None else list(st.logprobs)

    def cumulative_logprob(self, seq_id) -> float | None:
        st = self._states.get(seq_id)
        return None if st is None or st.logprobs is None else st.cumulative

    def _history(self, st: _State) -> tuple[list[int], list[int]]:
        if st.seq is not None:
            return list(st.seq.prompt_token_ids), list(st.seq.output_token_ids)
        return st.prompt, st.output

    def _process(self, row: torch.Tensor, p: SamplingParams, st: _State | None) -> torch.Tensor:
        """Step 2 and 3 of the module docstring on one row (float32, a new tensor)."""
        row = row.float().clone()
        prompt, output = self._history(st) if st is not None else ([], [])
        if p.allowed_token_ids is not None:
            keep = torch.zeros_like(row, dtype=torch.bool)
            ids = torch.tensor([t for t in p.allowed_token_ids if t < row.numel()], dtype=torch.long)
            keep[ids] = True
            row = row.masked_fill(~keep, float("-inf"))
        if p.min_tokens > 0 and len(output) < p.min_tokens:
            banned = [t for t in set(p.stop_token_ids) | set(() if p.ignore_eos or st is None else st.eos) if t < row.numel()]
            if banned:
                row[torch.tensor(banned, dtype=torch.long)] = float("-inf")
        if p.logit_bias:
            for t, b in p.logit_bias.items():
                if 0 <= int(t) < row.numel():
                    row[int(t)] += max(-100.0, min(100.0, float(b)))
        if p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0:
            row = apply_penalties(row, prompt, output, p.presence_penalty, p.frequency_penalty, p.repetition_penalty)
        return row

    def __call__(self, logits: torch.Tensor, seq_ids: list, params: list[SamplingParams]) -> list[int]:
        """logits: (M, V) float32, row i for sequence seq_ids[i]."""
        plain_greedy = [i for i, p in enumerate(params) if p.greedy and not p.changes_logits]
        out = [0] * len(params)
        if plain_greedy:
            # One pass over every row: no softmax, and no copy of the greedy rows' logits (at batch
            # 64 that copy is 12 MiB a step). max(dim).indices is argmax (the first maximum, as
            # documented) at about a third of argmax's time on a CPU. Other rows are overwritten below.
            out = logits.max(dim=-1).indices.tolist()
        for i, p in enumerate(params):
            st = self._states.get(seq_ids[i])
            if not (p.greedy and not p.changes_logits):
                row = self._process(logits[i], p, st) if p.changes_logits else logits[i].float()
                if p.greedy:
                    out[i] = int(row.argmax().item())
                else:
                    row = apply_min_p(row / p.temperature, p.min_p)
                    row = _filter_top_k_top_p(row, p.top_k, p.top_p)
                    probs = torch.softmax(row, dim=-1)
                    out[i] = int(torch.multinomial(probs, 1, generator=self._generators[seq_ids[i]]).item())
            if st is not None:
                if st.logprobs is not None:
                    raw = torch.log_softmax(logits[i].float(), dim=-1)
                    entry = top_logprobs(raw, out[i], p.logprobs, self.decode)
                    st.logprobs.append(entry)
                    st.cumulative += entry[out[i]].logprob
                st.output.append(out[i])
        return out
