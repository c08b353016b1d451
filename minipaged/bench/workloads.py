"""Seeded request sets for benchmarks: prompt and output lengths from chosen distributions.

Owns only the numbers (lengths, token ids, the real chat prompts); running them is
serving.py's job. Output lengths are enforced (EOS ignored) so every system does the same work.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

# ShareGPT conversations are long-tailed (the PagedAttention paper: mean input 161, output
# 338 tokens); Alpaca's are short (19 / 58). On a 2-core CPU we keep the *shape* of each
# distribution and scale the lengths down, so a run takes a minute rather than an hour.
DISTRIBUTIONS = {
    # name: (prompt median, prompt sigma, output median, output sigma) of a log-normal
    "sharegpt": (96, 0.8, 96, 0.9),
    "alpaca": (20, 0.5, 48, 0.5),
}


@dataclass
class Request:
    prompt_token_ids: list[int]
    max_tokens: int


@dataclass
class Workload:
    name: str
    requests: list[Request]
    seed: int
    description: str

    @property
    def max_len(self) -> int:
        """Longest prompt + output: what a contiguous cache must reserve per sequence."""
        return max(len(r.prompt_token_ids) + r.max_tokens for r in self.requests)

    def summary(self) -> dict:
        p = [len(r.prompt_token_ids) for r in self.requests]
        o = [r.max_tokens for r in self.requests]
        return {
            "name": self.name,
            "description": self.description,
            "seed": self.seed,
            "num_requests": len(self.requests),
            "prompt_len": {"mean": float(np.mean(p)), "p50": float(np.median(p)), "max": int(max(p))},
            "output_len": {"mean": float(np.mean(o)), "p50": float(np.median(o)), "max": int(max(o))},
            "max_len": self.max_len,
        }


def _lognormal(rng: np.random.Generator, median: float, sigma: float, n: int, lo: int, hi: int) -> list[int]:
    return [int(x) for x in np.clip(np.round(rng.lognormal(np.log(median), sigma, n)), lo, hi)]


def synthetic(
    name: str = "sharegpt",
    num_requests: int = 64,
    seed: int = 0,
    vocab_size: int = 49152,
    max_prompt: int = 256,
    max_output: int = 256,
    fixed: tuple[int, int] | None = None,
    real_prompts: list[list[int]] | None = None,
    scale: float = 1.0,
    prompt_scale: float | None = None,
    output_scale: float | None = None,
) -> Workload:
    """``name`` is "sharegpt", "alpaca" or "fixed" (then ``fixed=(prompt_len, output_len)``).

    With ``real_prompts`` (token ids of real chat prompts), prompts are taken from them in
    turn instead of random tokens; the output lengths still follow the distribution.
    ``scale`` multiplies every median (a quick run keeps the shape with shorter requests);
    ``prompt_scale`` / ``output_scale`` set the two separately (default: ``scale``). The sigmas,
    and so the long tail, stay as they are.
    """
    p_scale = scale if prompt_scale is None else prompt_scale
    o_scale = scale if output_scale is None else output_scale
    for name_, v in (("scale", scale), ("prompt_scale", p_scale), ("output_scale", o_scale)):
        if not v > 0:
            raise ValueError(f"{name_} must be > 0, got {v!r}")
    rng = np.random.default_rng(seed)
    if name == "fixed":
        if fixed is None:
            raise ValueError("the 'fixed' workload needs fixed=(prompt_len, output_len)")
        plens, olens = [fixed[0]] * num_requests, [fixed[1]] * num_requests
        desc = f"{num_requests} requests, prompt {fixed[0]} and output {fixed[1]} tokens each"
    elif name in DISTRIBUTIONS:
        pm, ps, om, os_ = DISTRIBUTIONS[name]
        pm, om = max(4, round(pm * p_scale)), max(4, round(om * o_scale))
        plens = _lognormal(rng, pm, ps, num_requests, 4, max_prompt)
        olens = _lognormal(rng, om, os_, num_requests, 4, max_output)
        desc = (
            f"{num_requests} requests, {name}-like log-normal lengths scaled for a CPU "
            f"(prompt median {pm} = {DISTRIBUTIONS[name][0]} x {p_scale:g}, output median {om} = {DISTRIBUTIONS[name][2]} x {o_scale:g}, "
            f"prompt capped at {max_prompt}, output at {max_output}); EOS ignored"
        )
    else:
        raise ValueError(f"unknown workload {name!r}: use one of {sorted(DISTRIBUTIONS) + ['fixed']}")
    reqs = []
    for i, (pl, ol) in enumerate(zip(plens, olens)):
        if real_prompts:
            ids = list(real_prompts[i % len(real_prompts)])
        else:
            ids = rng.integers(100, vocab_size - 100, pl).tolist()
        reqs.append(Request(ids, ol))
    if real_prompts:
        desc += "; prompts are real chat prompts"
    return Workload(name, reqs, seed, desc)


CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a short poem about autumn leaves.",
    "Explain recursion with a simple example.",
    "What are the health benefits of green tea?",
    "How do I reverse a list in Python?",
    "Describe the water cycle in a few sentences.",
    "What is the difference between a virus and a bacterium?",
    "Give me a recipe for pancakes.",
    "Why do cats purr?",
    "Summarise the plot of Romeo and Juliet.",
    "What is machine learning?",
    "How far is the Moon from the Earth?",
    "Tell me a joke about computers.",
    "What causes the seasons on Earth?",
    "How can I improve my sleep?",
    "What is photosynthesis?",
]


def chat_prompt_ids(tokenizer, prompts: list[str] | None = None) -> list[list[int]]:
    """Token ids of real chat prompts, with the model's own chat template."""
    prompts = prompts or CHAT_PROMPTS
    return [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": p}])) for p in prompts]


def as_dict(w: Workload) -> dict:
    return {"summary": w.summary(), "requests": [asdict(r) for r in w.requests]}
