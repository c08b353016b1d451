"""The host-memory tier, measured: a multi-turn, shared-prefix workload whose prefixes do not fit the device pool.

Owns this one measurement. ``conversations`` users each have a long document of their own (the
shared prefix of all their turns); turn ``t`` of a conversation is its document, the questions and
answers so far, and a new question. Turns go round-robin over the conversations, so by the time a
conversation comes back, the other conversations' blocks have pushed its prefix out of a device
pool sized for about one and a half of them (LRU). Two engines that differ only in
``kv_offloading_size`` serve the same requests, one at a time and alternately (request i on the
engine without the tier, then on the engine with it), so both see the same machine load; TTFT and
the prompt tokens each computed are reported per engine, with the host store's copy costs. It
prints and returns figures; it asserts nothing about speed.

    minipaged bench offload [--conversations 4] [--turns 3] [--num-blocks 48] [--json docs/figures/offload.json]
"""
from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

from . import off_on_rows, save_run, text_table

SENTENCES = [
    "The key-value cache holds one key and one value vector per token and layer.",
    "A block table maps a sequence's logical blocks to physical blocks in the pool.",
    "Continuous batching admits a new request as soon as a running one finishes.",
    "A prefix cache finds full blocks by a chained hash of their tokens.",
    "Preemption frees a sequence's blocks and recomputes its tokens later.",
    "Copy-on-write gives a sequence its own copy of a shared block before it writes.",
    "The token budget bounds how many tokens one step computes.",
    "Chunked prefill splits a long prompt over several steps.",
    "Host memory is larger than device memory, and slower to reach.",
    "An evicted block can be loaded back instead of computed again.",
    "The scheduler decides who runs; the model computes; the sampler picks tokens.",
    "Time to first token is dominated by the prompt's prefill.",
]
QUESTIONS = ["Summarize the document.", "Which sentence is about memory?", "What does the block table do?",
             "Why is prefill slow?", "What is evicted first?", "Give one number from the text."]
ANSWER = "Here is a short answer that the user read before asking again."


def conversation_prompts(tokenizer, conversations: int = 4, turns: int = 3, doc_sentences: int = 24,
                         seed: int = 0) -> list[tuple[int, int, list[int]]]:
    """(conversation, turn, prompt token ids) in serving order: turn 0 of every conversation, then
    turn 1 of every conversation, ... Each prompt extends the previous turn's prompt of its conversation."""
    rng = random.Random(seed)
    docs = []
    for c in range(conversations):
        doc = [rng.choice(SENTENCES) for _ in range(doc_sentences)]
        docs.append(f"Document {c} of the course notes. " + " ".join(doc))
    out = []
    for t in range(turns):
        for c in range(conversations):
            history = "".join(f"\nUser: {QUESTIONS[(c + i) % len(QUESTIONS)]}\nAssistant: {ANSWER}" for i in range(t))
            text = f"{docs[c]}{history}\nUser: {QUESTIONS[(c + t) % len(QUESTIONS)]}\nAssistant:"
            out.append((c, t, tokenizer.encode(text)))
    return out


def _serve_one(eng: Any, prompt: list[int], params: Any) -> tuple[list[int], float, int]:
    """(tokens, TTFT in s, prompt tokens computed) of one request alone on ``eng``."""
    before = sum(s.prefill_tokens for s in eng.trace.steps)
    rid = eng.add_request({"prompt_token_ids": prompt}, params)
    out = eng.run()[rid]
    computed = sum(s.prefill_tokens for s in eng.trace.steps) - before
    return list(out.outputs[0].token_ids), out.metrics["first_token_time"] - out.metrics["arrival_time"], computed


def bench_offload(model=None, tokenizer=None, conversations: int = 4, turns: int = 3, doc_sentences: int = 24,
                  max_tokens: int = 4, block_size: int = 16, num_blocks: int | None = None,
                  offload_gib: float = 0.25, requests: list | None = None, **engine_kw: Any) -> dict:
    """Serve the workload on two engines, alternately, one request at a time; return both runs' figures.

    ``num_blocks`` (default: enough for one and a half of the longest conversation) sizes each
    engine's device pool; the second engine has a host tier of ``offload_gib`` GiB. Greedy, so
    both engines must give the same tokens (``same_tokens``). ``requests``: (conversation, turn,
    token ids) in serving order instead of :func:`conversation_prompts`'s."""
    from ..engine import LLMEngine
    from ..sampling import SamplingParams

    if model is None:
        from ..model import load_model

        model, tokenizer = load_model(None)
    reqs = requests or conversation_prompts(tokenizer, conversations, turns, doc_sentences)
    conversations, turns = len({c for c, _, _ in reqs}), len({t for _, t, _ in reqs})
    longest = max(len(p) for _, _, p in reqs) + max_tokens
    if num_blocks is None:
        num_blocks = (3 * -(-longest // block_size)) // 2
    kw = dict(block_size=block_size, num_blocks=num_blocks, max_num_seqs=4, enable_prefix_caching=True, **engine_kw)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    engines = {"off": LLMEngine(model, tokenizer, **kw),
               "on": LLMEngine(model, tokenizer, kv_offloading_size=offload_gib, **kw)}
    for eng in engines.values():  # warm-up on a prompt of its own, not measured
        eng.add_request({"prompt_token_ids": tokenizer.encode("warm up")}, SamplingParams(max_tokens=2, temperature=0))
        eng.run()
    rows = []
    t0 = time.perf_counter()
    for c, t, prompt in reqs:
        row = {"conversation": c, "turn": t, "prompt_tokens": len(prompt)}
        for name, eng in engines.items():
            toks, ttft, computed = _serve_one(eng, prompt, params)
            row[name] = {"ttft_s": ttft, "computed": computed, "tokens": toks}
        rows.append(row)
    wall = time.perf_counter() - t0
    later = [r for r in rows if r["turn"] > 0]

    def summary(name: str) -> dict:
        eng = engines[name]
        st = eng.stats()
        return {"ttft_mean_s": statistics.mean(r[name]["ttft_s"] for r in rows),
                "ttft_mean_later_turns_s": statistics.mean(r[name]["ttft_s"] for r in later) if later else None,
                "prompt_tokens_computed": sum(r[name]["computed"] for r in rows),
                "prefix_hit_tokens": st.get("prefix_hit_tokens"), "device_evictions": st.get("evictions"),
                "kv_connector": st.get("kv_connector")}

    ratios = [r["off"]["ttft_s"] / r["on"]["ttft_s"] for r in later if r["on"]["ttft_s"] > 0]
    on_eng = engines["on"]
    return {"workload": {"conversations": conversations, "turns": turns, "requests": len(reqs), "max_tokens": max_tokens,
                         "prompt_tokens": [r["prompt_tokens"] for r in rows], "block_size": block_size,
                         "device_blocks": num_blocks, "device_tokens": num_blocks * block_size,
                         "host_gib": offload_gib, "bytes_per_block": on_eng.kv_cache.nbytes // num_blocks,
                         "model": getattr(model.config, "name", "")},
            "off": summary("off"), "on": summary("on"),
            "ttft_speedup_later_turns_median": statistics.median(ratios) if ratios else None,
            "same_tokens": all(r["off"]["tokens"] == r["on"]["tokens"] for r in rows),
            "per_request": [{k: (v if not isinstance(v, dict) else {kk: vv for kk, vv in v.items() if kk != "tokens"})
                             for k, v in r.items()} for r in rows],
            "seconds": wall}


def format_offload(r: dict) -> str:
    w, off, on = r["workload"], r["off"], r["on"]
    kc = on["kv_connector"] or {}
    rows = [("", "device only", "+ host tier"), *off_on_rows(off, on, [
                ("mean TTFT, all turns (s)", "ttft_mean_s", ".3f"), ("mean TTFT, turns 2+ (s)", "ttft_mean_later_turns_s", ".3f"),
                ("prompt tokens computed", "prompt_tokens_computed", "")]),
            ("prefix hits, device pool (tokens)", f"{off['prefix_hit_tokens']}", f"{kc.get('device_hit_tokens', '-')}"),
            ("prefix hits, host store (tokens)", "-", f"{kc.get('host_hit_tokens', '-')}"),
            ("blocks loaded / saved", "-", f"{kc.get('loaded_blocks', '-')} / {kc.get('saved_blocks', '-')}"),
            ("copy time load / save (s)", "-", f"{kc.get('load_seconds', 0):.3f} / {kc.get('save_seconds', 0):.3f}")]
    head = (f"multi-turn shared-prefix workload: {w['conversations']} conversations x {w['turns']} turns, prompts of "
            f"{min(w['prompt_tokens'])}-{max(w['prompt_tokens'])} tokens, a device pool of {w['device_blocks']} blocks "
            f"({w['device_tokens']} tokens), a host store of {w['host_gib']} GiB; same greedy tokens: {r['same_tokens']}; "
            f"median TTFT ratio (turns 2+, without / with the tier): {r['ttft_speedup_later_turns_median']:.2f}x")
    return "\n".join([head, *text_table(rows, min_width=12)])


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--conversations", type=int, default=4)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--doc-sentences", type=int, default=24, help="the length of each conversation's document")
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=None, help="the device pool (default: 1.5 conversations)")
    p.add_argument("--offload-gib", type=float, default=0.25, help="the host store's size (kv_offloading_size)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", help="also write the figures to this file (e.g. docs/figures/offload.json)")


def run(a: argparse.Namespace) -> int:
    if a.threads:
        import torch

        torch.set_num_threads(a.threads)
    r = bench_offload(conversations=a.conversations, turns=a.turns, doc_sentences=a.doc_sentences,
                      max_tokens=a.max_tokens, block_size=a.block_size, num_blocks=a.num_blocks, offload_gib=a.offload_gib)
    print(format_offload(r))
    save_run(r, a)
    return 0
