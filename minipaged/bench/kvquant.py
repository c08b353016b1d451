"""What 8-bit KV pages cost in quality and speed, and what they buy in room: each kv_cache_dtype against auto.

Owns this one measurement, on SmolLM2-135M (fp32 on a CPU):

- greedy agreement: the same fixed prompts continued 64 tokens greedily; the share of positions
  whose token equals auto's, and the tokens until the first difference;
- mean KL(auto || dtype) of the next-token distributions and the perplexity, teacher-forced over a
  held-out text shipped with the package (``kvquant_heldout.txt``): one pass writes every token's
  K/V into the pages and attends over them, so every position reads quantized K/V;
- decode tok/s at batch 1 and 64 (quantizing and dequantizing cost compute on a CPU, and the C
  paged decode kernel is refused for 8-bit pages: the plan says why);
- the largest batch of 1024-token sequences a fixed KV budget holds.

It prints and returns figures (``--json``, ``--figure``, ``--readme``); it asserts nothing.

    minipaged bench kvquant [--max-tokens 64] [--budget-mib 64] [--quick] [--json F] [--figure F] [--readme]
"""
from __future__ import annotations

import argparse
import math
import time
from importlib import resources
from typing import Any

import torch

from . import save_run

DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2", "int8")
PROMPTS = [
    "The three most important ideas in computer science are",
    "Once upon a time, in a village by the sea,",
    "To make bread at home, you need",
    "def quicksort(xs):",
    "The French Revolution began in",
    "A paged KV cache stores keys and values in",
    "Water boils at a lower temperature on a mountain because",
    "My favourite thing about winter is",
]
SEQ_LEN = 1024  # the sequence length of the capacity column


def heldout_text() -> str:
    """The held-out text (package data, so a lesson on Colab reads it too)."""
    return resources.files("minipaged.bench").joinpath("kvquant_heldout.txt").read_text(encoding="utf-8")


@torch.no_grad()
def teacher_forced_logits(model: Any, token_ids: list[int], kv_cache_dtype: str, block_size: int = 16) -> torch.Tensor:
    """(T, vocab) fp32 logits of every position of ``token_ids`` in one pass whose K/V go through
    pages of ``kv_cache_dtype`` (written, then read by the torch backend)."""
    from ..attention import TORCH, AttentionMetadata
    from ..kv_cache import KVCache

    n = len(token_ids)
    c = model.config
    nblocks = -(-n // block_size)
    cache = KVCache(c.num_layers, nblocks, block_size, c.num_kv_heads, c.head_dim, torch.float32,
                    kv_cache_dtype=kv_cache_dtype)
    meta = AttentionMetadata(slot_mapping=torch.arange(n), block_tables=torch.arange(nblocks, dtype=torch.int32)[None],
                             context_lens=torch.tensor([n], dtype=torch.int32),
                             query_start_loc=torch.tensor([0, n], dtype=torch.int32))
    hidden = model(torch.tensor(token_ids), torch.arange(n), cache, meta, TORCH)
    return model.compute_logits(hidden)


def quality(model: Any, tok: Any) -> dict[str, dict]:
    """Per dtype: perplexity over the held-out text and mean KL(auto || dtype) per position."""
    ids = tok.encode(heldout_text())
    base = torch.log_softmax(teacher_forced_logits(model, ids, "auto"), -1)
    out = {}
    for name in DTYPES:
        lp = base if name == "auto" else torch.log_softmax(teacher_forced_logits(model, ids, name), -1)
        nll = -lp[:-1].gather(1, torch.tensor(ids[1:])[:, None]).mean()
        kl = (base.exp() * (base - lp)).sum(-1).mean()
        out[name] = {"perplexity": math.exp(float(nll)), "mean_kl": float(kl), "tokens": len(ids)}
    return out


def _generate(model: Any, tok: Any, name: str, prompts: list[str], max_tokens: int) -> tuple[list[list[int]], float, Any]:
    from ..llm import LLM
    from ..sampling import SamplingParams

    llm = LLM(model, tok, kv_cache_dtype=name, max_num_seqs=max(len(prompts), 1), kv_cache_bytes=256 * 2**20)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t
    return [o.outputs[0].token_ids for o in outs], dt, llm.llm_engine


def bench_kvquant(max_tokens: int = 64, budget_mib: int = 64, batch: int = 64, speed_tokens: int = 32) -> dict:
    from ..kv_cache import num_blocks_for_budget
    from ..model import load_model

    model, tok = load_model()
    c = model.config
    res: dict[str, Any] = {"model": c.name, "max_tokens": max_tokens, "prompts": PROMPTS, "budget_mib": budget_mib,
                           "seq_len": SEQ_LEN, "batch": batch, "speed_tokens": speed_tokens, "threads": torch.get_num_threads(),
                           "dtypes": {}}
    q = quality(model, tok)
    greedy = {}
    for name in DTYPES:
        greedy[name], _, eng = _generate(model, tok, name, PROMPTS, max_tokens)
        same = sum(a == b for g, w in zip(greedy[name], greedy["auto"]) for a, b in zip(g, w))
        first = [next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), len(w)) for g, w in zip(greedy[name], greedy["auto"])]
        speeds = {}
        for b in (1, batch):  # decode tok/s: (b prompts x speed_tokens) tokens over the generate's time
            prompts = [PROMPTS[i % len(PROMPTS)] for i in range(b)]
            _generate(model, tok, name, prompts[:1], 2)  # warm
            _, dt, _ = _generate(model, tok, name, prompts, speed_tokens)
            speeds[f"batch_{b}_tok_s"] = b * speed_tokens / dt
        blocks = num_blocks_for_budget(budget_mib * 2**20, c.num_layers, c.num_kv_heads, c.head_dim, 16,
                                       torch.float32, name)
        res["dtypes"][name] = {
            "greedy_agreement": same / sum(len(w) for w in greedy["auto"]),
            "tokens_until_first_difference": first,
            **q[name], **speeds,
            "kv_bytes_per_token": eng.kv_bytes_per_token,
            "blocks_in_budget": blocks,
            "max_batch_in_budget": blocks // -(-SEQ_LEN // 16),
            "plan_kv_cache": eng.plan.routes["kv_cache"],
            "refused_c_attention": eng.plan.refused.get("c_attention"),
        }
    return res


def format_table(r: dict) -> str:
    """The figures as a Markdown table (what the README quotes)."""
    auto = r["dtypes"]["auto"]
    lines = [f"| kv_cache_dtype | bytes/token | {r['seq_len']}-token seqs in {r['budget_mib']} MiB | greedy agreement "
             f"({r['max_tokens']} tokens x {len(r['prompts'])}) | mean KL | perplexity (change) | decode tok/s b=1 | "
             f"b={r['batch']} |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    big = f"batch_{r['batch']}_tok_s"
    for name, d in r["dtypes"].items():
        dp = d["perplexity"] - auto["perplexity"]
        lines.append(f"| {name} | {d['kv_bytes_per_token']:,} | {d['max_batch_in_budget']} | {d['greedy_agreement']:.1%} | "
                     f"{d['mean_kl']:.4f} | {d['perplexity']:.2f} ({dp:+.2f}) | {d['batch_1_tok_s']:.1f} | "
                     f"{d[big]:.1f} |")
    return "\n".join(lines)


def plot(r: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(r["dtypes"])
    d = r["dtypes"]
    fig, ax = plt.subplots(1, 3, figsize=(12, 3.4))
    ax[0].bar(names, [d[n]["max_batch_in_budget"] for n in names], color="tab:blue")
    ax[0].set_title(f"{r['seq_len']}-token sequences in {r['budget_mib']} MiB of KV")
    ax[1].bar(names, [d[n]["mean_kl"] for n in names], color="tab:red")
    ax[1].set_title("mean KL(auto || dtype), held-out text")
    ax[2].bar(names, [d[n]["greedy_agreement"] for n in names], color="tab:green")
    ax[2].set_ylim(0, 1.05)
    ax[2].set_title(f"greedy agreement with auto ({r['max_tokens']} tokens)")
    for a in ax:
        a.tick_params(axis="x", labelrotation=20)
    fig.suptitle(f"KV cache quantization on {r['model']} (CPU, fp32 model)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


README_START, README_END = "<!-- kvquant:start -->", "<!-- kvquant:end -->"


def update_readme(r: dict, path: str = "README.md") -> bool:
    """Replace the table between the kvquant markers of the README (False: no markers there)."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if README_START not in text or README_END not in text:
        return False
    head, rest = text.split(README_START, 1)
    _, tail = rest.split(README_END, 1)
    body = (f"\n_Measured by `minipaged bench kvquant` on {r['threads']} thread(s) of a shared CPU; "
            "tok/s are comparable only within this table._\n\n" + format_table(r) + "\n")
    with open(path, "w", encoding="utf-8") as f:
        f.write(head + README_START + body + README_END + tail)
    return True


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=64, help="greedy continuation length (default 64)")
    p.add_argument("--budget-mib", type=int, default=64, help="the KV budget of the capacity column (default 64)")
    p.add_argument("--batch", type=int, default=64, help="the large decode batch (default 64)")
    p.add_argument("--speed-tokens", type=int, default=32, help="tokens a sequence for the tok/s columns")
    p.add_argument("--quick", action="store_true", help="16 tokens, batch 8: a smoke run")
    p.add_argument("--json", help="write the figures to this file")
    p.add_argument("--figure", help="write the figure (PNG) to this file")
    p.add_argument("--readme", action="store_true", help="write the table into README.md between its kvquant markers")


def run(a: argparse.Namespace, p: argparse.ArgumentParser | None = None) -> int:
    if a.quick:
        a.max_tokens, a.batch, a.speed_tokens = 16, 8, 8
    r = bench_kvquant(a.max_tokens, a.budget_mib, a.batch, a.speed_tokens)
    print(format_table(r))
    for name, d in r["dtypes"].items():
        if d["refused_c_attention"]:
            print(f"{name}: {d['refused_c_attention']}")
    save_run(r, a)
    if a.figure:
        plot(r, a.figure)
    if a.readme and not update_readme(r):
        print(f"README.md has no {README_START} ... {README_END} section: nothing written there")
    return 0
