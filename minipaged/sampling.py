"""How the next token is chosen: SamplingParams (vLLM's names) and the Sampler.

Owns per-request randomness: each request draws from its own seeded generator, so a seeded
answer is the same whether the request runs alone or inside a busy batch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


MIN_TEMPERATURE = 1e-2  # below this, softmax(logits / T) under/overflows in fp32: use 0 (greedy) instead
MAX_SEED = 2**63 - 1


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass
class SamplingParams:
    """``temperature=0`` is greedy. ``top_k<=0`` and ``top_p=1`` switch those filters off.

    Every field is checked when the params are made and again when a request is added:
    ``temperature`` is 0 or a finite number >= MIN_TEMPERATURE (0.01); ``seed`` is None or an
    int in 0..2**63-1; ``bool`` is never taken for an int.
    """

    max_tokens: int = 16
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

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    def validate(self) -> None:
        """Raise ValueError (TypeError for a wrong type) naming the bad field and what it takes."""
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
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
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= MAX_SEED):
            raise ValueError(f"seed must be None or an int in 0..2**63-1, got {self.seed!r}")
        if not isinstance(self.stop, (list, tuple)) or any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be a string or a list of non-empty strings, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, (list, tuple)) or any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be a list of token ids (ints >= 0), got {self.stop_token_ids!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n (samples of the prompt) must be an int >= 1, got {self.n!r}")
        if self.seed is not None and self.seed + self.n - 1 > MAX_SEED:
            raise ValueError(f"sample i uses seed + i: seed={self.seed} with n={self.n} passes 2**63-1; use a smaller seed")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


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


class Sampler:
    """One next token per row of logits."""

    def __init__(self) -> None:
        self._generators: dict = {}

    def add(self, seq_id, params: SamplingParams) -> None:
        if not params.greedy:
            g = torch.Generator()
            g.manual_seed(params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,)).item()))
            self._generators[seq_id] = g

    def remove(self, seq_id) -> None:
        self._generators.pop(seq_id, None)

    def __call__(self, logits: torch.Tensor, seq_ids: list, params: list[SamplingParams]) -> list[int]:
        """logits: (M, V) float32, row i for sequence seq_ids[i]."""
        greedy_rows = [i for i, p in enumerate(params) if p.greedy]
        out = [0] * len(params)
        if greedy_rows:
            # One pass over every row: no softmax, and no copy of the greedy rows' logits (at batch
            # 64 that copy is 12 MiB a step). max(dim).indices is argmax (the first maximum, as
            # documented) at about a third of argmax's time on a CPU. Sampled rows are overwritten below.
            out = logits.max(dim=-1).indices.tolist()
        for i, p in enumerate(params):
            if p.greedy:
                continue
            row = _filter_top_k_top_p(logits[i].float() / p.temperature, p.top_k, p.top_p)
            probs = torch.softmax(row, dim=-1)
            out[i] = int(torch.multinomial(probs, 1, generator=self._generators[seq_ids[i]]).item())
        return out
