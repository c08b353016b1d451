"""``LLM.get_metrics()``: the engine's numbers as vLLM's metric records (vllm.v1.metrics.reader's shape).

Each record has a ``name`` (vLLM's ``vllm:`` name), ``labels`` (a dict) and ``value``; a
``Counter`` only grows, a ``Gauge`` is a level now, a ``Vector`` is one count per position
(speculative decoding's accepted tokens per draft position).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Metric:
    name: str
    labels: dict = field(default_factory=dict)


@dataclass
class Counter(Metric):
    value: int = 0


@dataclass
class Gauge(Metric):
    value: float = 0.0


@dataclass
class Vector(Metric):
    values: list = field(default_factory=list)


def engine_metrics(engine: Any) -> list[Metric]:
    """The engine's counters and gauges now (read from ``engine.stats()`` and its queues)."""
    s = engine.stats()
    sched = engine.scheduler
    used = 1.0 - engine.allocator.num_free_blocks / max(1, engine.allocator.num_blocks)
    out: list[Metric] = [
        Gauge("vllm:num_requests_running", value=len(getattr(sched, "running", ()))),
        Gauge("vllm:num_requests_waiting", value=len(getattr(sched, "waiting", ()))),
        Gauge("vllm:kv_cache_usage_perc", value=used),
        Counter("vllm:prompt_tokens", value=int(s["prompt_tokens"])),
        Counter("vllm:generation_tokens", value=int(s["generated_tokens"])),
        Counter("vllm:num_preemptions", value=int(s["preemptions"])),
        Counter("vllm:request_success", {"finished_reason": "error"}, int(s["errors"])),
        Counter("vllm:request_success", {"finished_reason": "abort"}, int(s["aborted"])),
    ]
    if s.get("prefix_hit_tokens") is not None:
        out.append(Counter("vllm:prefix_cache_hits", value=int(s["prefix_hit_tokens"])))
    spec = s.get("spec_decode")
    if spec:
        out += [Counter("vllm:spec_decode_num_drafts", value=int(spec["num_drafts"])),
                Counter("vllm:spec_decode_num_draft_tokens", value=int(spec["num_draft_tokens"])),
                Counter("vllm:spec_decode_num_accepted_tokens", value=int(spec["num_accepted_tokens"])),
                Vector("vllm:spec_decode_num_accepted_tokens_per_pos", values=list(spec["accepted_per_pos"]))]
    return out


__all__ = ["Metric", "Counter", "Gauge", "Vector", "engine_metrics"]
