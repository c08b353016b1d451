"""Structured outputs: what the grammar's token mask costs per step, and how often the output parses.

Two measurements, written to docs/figures/structured.json:

- **mask time**: a batch of 1, 16 and 64 requests decoding the same number of tokens, free and
  under a regex that cannot end before them (so both runs decode exactly ``--tokens`` steps). It
  reports each run's time per step and the time the masks took (filling each row's bitmask,
  applying it to the batch's logits), read from the engine's StructuredOutputs.
- **parse rate**: every request of the shipped set (minipaged/bench/structured_set.json: JSON
  schemas and regexes), greedy; of the outputs that finish with ``stop``, the share whose text
  parses (json.loads and the schema's required keys, or a full regex match). It must be 100%.
"""
from __future__ import annotations

import argparse
import json
import re
import time
from importlib import resources

from . import save_run


def shipped_set() -> list[dict]:
    return json.loads(resources.files("minipaged.bench").joinpath("structured_set.json").read_text(encoding="utf-8"))["items"]


def _params(item: dict, max_tokens: int):
    from ..sampling import SamplingParams
    from ..sampling_params import StructuredOutputsParams

    so = StructuredOutputsParams(json=item["json"]) if "json" in item else StructuredOutputsParams(regex=item["regex"])
    return SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=so)


def valid(item: dict, text: str) -> bool:
    """Whether ``text`` is what ``item``'s form allows."""
    if "regex" in item:
        return re.fullmatch(item["regex"], text) is not None
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    schema = item["json"]
    if schema.get("type") == "object":
        return isinstance(value, dict) and set(schema.get("required", ())) <= set(value)
    if schema.get("type") == "array":
        return isinstance(value, list) and schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", 10**9)
    return True


def parse_rate(llm, max_tokens: int = 96) -> dict:
    items = shipped_set()
    outs = llm.chat([[{"role": "user", "content": it["prompt"]}] for it in items], [_params(it, max_tokens) for it in items])
    rows = []
    for it, o in zip(items, outs):
        c = o.outputs[0]
        rows.append({"name": it["name"], "finish_reason": c.finish_reason, "text": c.text,
                     "valid": valid(it, c.text) if c.finish_reason == "stop" else None})
    stopped = [r for r in rows if r["finish_reason"] == "stop"]
    return {"requests": len(rows), "finished_with_stop": len(stopped),
            "parse_rate": sum(r["valid"] for r in stopped) / len(stopped) if stopped else None, "rows": rows}


def mask_cost(llm, batches=(1, 16, 64), tokens: int = 16) -> list[dict]:
    from ..sampling import SamplingParams
    from ..sampling_params import StructuredOutputsParams

    eng = llm.llm_engine
    rows = []
    for b in batches:
        prompts = [f"Write a long sentence about the number {i}." for i in range(b)]
        free = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        tight = SamplingParams(temperature=0, max_tokens=tokens,
                               structured_outputs=StructuredOutputsParams(regex=r"[a-zA-Z ,.]{400,}"))  # cannot end early
        out = {"batch": b, "tokens": tokens}
        # the grammar is compiled (and cached) before the timing: each step's mask is measured, not the compile
        llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=1, structured_outputs=tight.structured_outputs))
        for name, p in (("free", free), ("structured", tight)):
            steps0 = eng.num_steps
            mask0 = eng.structured.mask_seconds if eng.structured is not None else 0.0
            t = time.perf_counter()
            llm.generate(prompts, p)
            wall = time.perf_counter() - t
            steps = eng.num_steps - steps0
            out[f"{name}_ms_per_step"] = 1e3 * wall / steps
            if name == "structured":
                out["mask_ms_per_step"] = 1e3 * (eng.structured.mask_seconds - mask0) / steps
        out["mask_share"] = out["mask_ms_per_step"] / out["structured_ms_per_step"]
        rows.append(out)
    return rows


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default=None, help="a GGUF file or Hugging Face folder (default: SmolLM2)")
    ap.add_argument("--tokens", type=int, default=16, help="tokens each request decodes in the mask-time runs")
    ap.add_argument("--out", default="docs/figures/structured.json", help="where the JSON goes")


def run(args: argparse.Namespace, ap: argparse.ArgumentParser | None = None) -> int:
    from ..llm import LLM

    llm = LLM(args.model, max_num_seqs=64)
    rate = parse_rate(llm)
    cost = mask_cost(llm, tokens=args.tokens)
    print(f"{'batch':>6} {'free ms/step':>13} {'structured ms/step':>19} {'mask ms/step':>13} {'mask share':>11}")
    for r in cost:
        print(f"{r['batch']:>6} {r['free_ms_per_step']:>13.1f} {r['structured_ms_per_step']:>19.1f} "
              f"{r['mask_ms_per_step']:>13.2f} {100 * r['mask_share']:>10.1f}%")
    print(f"parse rate: {rate['parse_rate']:.0%} of {rate['finished_with_stop']} outputs that finished with stop "
          f"({rate['requests']} requests)")
    result = {"backend": "xgrammar", "mask_cost": cost, "parse": rate}
    save_run(result, args, path=args.out)
    return 0 if rate["parse_rate"] == 1.0 else 1
