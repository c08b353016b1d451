"""``python -m minipaged.bench detok``: what detokenizing costs per token, at short and long outputs.

Prints microseconds per token for the incremental detokenizer (what the engine does) against a
full re-decode of the output at every token (what it did before), at 10, 100 and 1,000 tokens.
The incremental cost stays flat; the full re-decode grows with the output length.
"""
from __future__ import annotations

import argparse
import random
import time


def measure(tokenizer, lengths=(10, 100, 1000), seed: int = 0) -> list[dict]:
    from ..detokenizer import IncrementalDetokenizer

    rng = random.Random(seed)
    vocab = tokenizer.vocab_size
    rows = []
    for n in lengths:
        ids = [rng.randrange(100, vocab) for _ in range(n)]
        d = IncrementalDetokenizer(tokenizer)
        t = time.perf_counter()
        for tok in ids:
            d.append(tok)
        d.flush()
        inc = (time.perf_counter() - t) / n
        t = time.perf_counter()
        for k in range(1, n + 1):
            tokenizer.decode(ids[:k])
        full = (time.perf_counter() - t) / n
        rows.append({"tokens": n, "incremental_us_per_token": inc * 1e6, "full_redecode_us_per_token": full * 1e6})
    return rows


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default=None, help="a GGUF file or Hugging Face folder (default: SmolLM2)")


def run(args: argparse.Namespace, ap: argparse.ArgumentParser | None = None) -> int:
    ap = ap or getattr(args, "_parser", None) or argparse.ArgumentParser()
    from ..model import load_model

    _, tok = load_model(args.model)
    print(f"{'tokens':>7} {'incremental us/token':>22} {'full re-decode us/token':>25}")
    for r in measure(tok):
        print(f"{r['tokens']:>7} {r['incremental_us_per_token']:>22.1f} {r['full_redecode_us_per_token']:>25.1f}")
    return 0
