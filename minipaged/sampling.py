"""How the next token is chosen: SamplingParams (vLLM's names) and the Sampler.

Owns per-request randomness: each request draws from its own seeded generator, so a seeded
answer is the same whether the request runs alone or inside a busy batch.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    """``temperature=0`` is greedy. ``top_k<=0`` and ``top_p=1`` switch those filters off."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)  # stop strings: the text is cut before them
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False  # benchmarks set it, so every system generates exactly max_tokens
    # n > 1: n samples of one prompt, computed once and sharing its KV blocks (copy-on-write).
    # With a seed, sample i draws from seed + i: it equals a single request with that seed.
    n: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 keeps every token), got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be an int >= 0 (0 or -1 keeps every token), got {self.top_k!r}")
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            raise ValueError(f"n (samples per prompt) must be an int >= 1, got {self.n!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")

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
            picks = logits[greedy_rows].argmax(dim=-1).tolist()
            for i, t in zip(greedy_rows, picks):
                out[i] = t
        for i, p in enumerate(params):
            if p.greedy:
                continue
            row = _filter_top_k_top_p(logits[i].float() / p.temperature, p.top_k, p.top_p)
            probs = torch.softmax(row, dim=-1)
            out[i] = int(torch.multinomial(probs, 1, generator=self._generators[seq_ids[i]]).item())
        return out
