"""Request lengths for the paper's two workloads, synthesized: no dataset is downloaded.

Owns the length distributions (the arrivals are ``minipaged.bench.clock.poisson_arrivals``). The paper (Kwon et al., SOSP 2023,
Fig. 11) gives each dataset's mean input and output length in OPT tokens; ShareGPT has 8.4x
longer prompts and 5.8x longer outputs than Alpaca, with higher variance. We draw each length
from a log-normal distribution, cut to the model's context, whose *mean after the cut* is the
paper's (the ``mu`` is solved for; ``sigma`` is the stated assumption):

============  ===========  ==============  ============  ===============
dataset       input mean   input sigma     output mean   output sigma
============  ===========  ==============  ============  ===============
sharegpt      161.31       1.0             337.99        0.9
alpaca        19.31        0.5             58.45         0.7
============  ===========  ==============  ============  ===============

``sigma`` is the standard deviation of log(length). 1.0 and 0.9 give ShareGPT the long tails of
Fig. 11 (prompts from a few tokens to over a thousand; answers from tens to about two thousand);
Alpaca's short, similar-looking instructions and answers get the narrower 0.5 and 0.7. A request
whose prompt + output would pass ``max_len`` has its output cut to fit, as the paper's
OPT models cap a sequence at 2,048 tokens.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np


@dataclass(frozen=True)
class LengthDist:
    """A log-normal length with target ``mean`` (after clipping to 1..``cap``) and ``sigma``."""

    mean: float
    sigma: float

    def mu(self, cap: int) -> float:
        return _solve_mu(self.mean, self.sigma, cap)

    def sample(self, rng: np.random.Generator, n: int, cap: int) -> np.ndarray:
        x = rng.lognormal(self.mu(cap), self.sigma, n)
        return np.clip(np.rint(x), 1, cap).astype(np.int64)


@dataclass(frozen=True)
class Dataset:
    name: str
    input: LengthDist
    output: LengthDist
    fig13_rate: float  # the request rate of the paper's Fig. 13 for this dataset (req/s)
    source: str = "Kwon et al., SOSP 2023, Fig. 11 (means); sigma: this module's stated assumption"
    input_cap: int | None = None  # prompts cut to this many tokens (None: the model's context)
    output_cap: int | None = None  # outputs cut to this many tokens


# Two workloads of the paper's §6.4-6.5 whose lengths it does not give; each is this module's assumption:
# - wmt16: one English sentence to translate into German (the prompt without its shared few-shot prefix),
#   about 30 LLaMA tokens, its translation a little longer (German runs longer than English);
# - chatbot: the conversation so far as the prompt, cut to its last 1,024 tokens, and an answer of at most
#   1,024 (§6.5). The paper says most prompts reach the 1,024 cut: a mean of 900 after the cut (sigma 0.8)
#   puts about two prompts in three at it; the answers are ShareGPT's, cut at 1,024.
_WMT16 = "WMT16 En-De sentence lengths: this module's assumption (the paper gives none)"
_CHAT = "Kwon et al., SOSP 2023, §6.5 (1,024-token cuts); history length: this module's assumption"


DATASETS: dict[str, Dataset] = {
    "sharegpt": Dataset("sharegpt", LengthDist(161.31, 1.0), LengthDist(337.99, 0.9), fig13_rate=2.0),
    "alpaca": Dataset("alpaca", LengthDist(19.31, 0.5), LengthDist(58.45, 0.7), fig13_rate=30.0),
    "wmt16": Dataset("wmt16", LengthDist(30.0, 0.5), LengthDist(36.0, 0.5), fig13_rate=10.0, source=_WMT16),
    "chatbot": Dataset("chatbot", LengthDist(900.0, 0.8), LengthDist(337.99, 0.9), fig13_rate=1.0, source=_CHAT,
                       input_cap=1024, output_cap=1024),
}


def get_dataset(name: str | Dataset) -> Dataset:
    if isinstance(name, Dataset):
        return name
    key = name.strip().lower()
    if key not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}. Known: {', '.join(DATASETS)}")
    return DATASETS[key]


def _clipped_mean(mu: float, sigma: float, cap: int) -> float:
    """The mean of clip(round(lognormal(mu, sigma)), 1, cap), to within a token (continuous
    approximation of the rounding)."""
    from math import erf, exp, log, sqrt

    def cdf(z: float) -> float:
        return 0.5 * (1 + erf(z / sqrt(2)))

    lo, hi = log(1.0), log(cap)
    a, b = (lo - mu) / sigma, (hi - mu) / sigma
    mid = exp(mu + sigma * sigma / 2) * (cdf(b - sigma) - cdf(a - sigma))
    return 1.0 * cdf(a) + mid + cap * (1 - cdf(b))


@lru_cache(maxsize=None)
def _solve_mu(mean: float, sigma: float, cap: int) -> float:
    lo, hi = -5.0, math.log(cap) + 5 * sigma
    if _clipped_mean(hi, sigma, cap) < mean:
        raise ValueError(f"a mean length of {mean} cannot be reached with lengths capped at {cap}")
    for _ in range(100):
        mid = (lo + hi) / 2
        if _clipped_mean(mid, sigma, cap) < mean:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def sample_lengths(dataset: str | Dataset, n: int, max_len: int = 2048, seed: int = 0) -> list[tuple[int, int]]:
    """``n`` (prompt_len, output_len) pairs for ``dataset``, with prompt + output <= ``max_len``."""
    d = get_dataset(dataset)
    rng = np.random.default_rng(seed)
    p = d.input.sample(rng, n, min(max_len - 1, d.input_cap or max_len))
    o = d.output.sample(rng, n, min(max_len - 1, d.output_cap or max_len))
    o = np.minimum(o, max_len - p)
    return [(int(a), int(b)) for a, b in zip(p, o)]
