"""What an engine did so far, in numbers a person can read: the running totals the engine keeps
as requests come and go (``EngineTotals``), and ``engine_stats``, the dict ``LLMEngine.stats()``
returns. It counts; it decides nothing (the per-step record is trace.py's).
"""
from __future__ import annotations

from typing import Any


class EngineTotals:
    """Counts over the requests the engine has seen; a retired request's tokens are added here,
    an unfinished one's are read from its sequences."""

    def __init__(self) -> None:
        self.requests = self.rejected = self.errors = self.aborted = 0  # added; of them refused, failed, aborted
        self.generated_tokens = self.prompt_tokens = self.preemptions = 0
        self.first_arrival: float | None = None
        self.last_finish = 0.0

    def added(self, seq: Any) -> None:
        """A request (its first sequence ``seq``) was handed to the scheduler."""
        if self.first_arrival is None:
            self.first_arrival = seq.arrival_time
        self.requests += 1
        self.prompt_tokens += len(seq.prompt_token_ids)

    def ended(self, aborted: bool) -> None:
        """A request was ended outside the stop rule: aborted, or failed with an error."""
        if aborted:
            self.aborted += 1
        else:
            self.errors += 1

    def retired(self, q: Any) -> None:
        """Sequence ``q`` (one sample of a finished request) left the engine."""
        self.generated_tokens += len(q.output_token_ids)
        self.preemptions += q.num_preemptions
        self.last_finish = max(self.last_finish, q.finish_time or 0.0)


def engine_stats(engine: Any) -> dict:
    """``engine.stats()``: its totals, its pool and plan, and what the prefix cache, speculative
    decoding and the trace add when they are on."""
    t = engine.totals
    live = [q for r in engine.requests.values() for q in r.samples]
    wall = t.last_finish - t.first_arrival if t.first_arrival is not None else 0.0
    info = {
        "requests": t.requests,
        "rejected": t.rejected,
        "errors": t.errors,
        "aborted": t.aborted,
        "generated_tokens": t.generated_tokens + sum(len(q.output_token_ids) for q in live),
        "prompt_tokens": t.prompt_tokens,
        "seconds": wall,
        "output_tokens_per_s": t.generated_tokens / wall if wall > 0 else 0.0,
        "steps": engine.num_steps,
        "num_blocks": engine.allocator.num_blocks,
        "block_size": engine.block_size,
        "kv_cache_mib": engine.kv_cache.nbytes / 2**20,
        "kv_cache_dtype": getattr(engine.config, "kv_cache_dtype", "auto"),
        "kv_bytes_per_token": engine.kv_bytes_per_token,
        "plan": engine.plan.as_dict(),
        "routes": dict(engine.route_counts),  # steps per route ("whole_step+head_argmax", "layers+sampler", ...)
        "preemptions": t.preemptions + sum(q.num_preemptions for q in live),
    }
    sharing = getattr(engine, "sharing", None)
    if sharing is not None:  # the paper's memory saving: blocks saved by sharing / blocks needed without it
        info["sharing"] = sharing.as_dict()
    if engine.spec is not None:  # acceptance rate, mean acceptance length (vLLM's spec-decode counts)
        info["spec_decode"] = engine.spec.as_dict()
    if engine.prefix_cache is not None:
        ps = getattr(engine.scheduler, "prefix_stats", None)
        info.update(prefix_hit_rate=ps.hit_rate if ps else None, prefix_hit_tokens=ps.hit_tokens if ps else None,
                    cached_blocks=engine.prefix_cache.num_cached_blocks, evictions=engine.prefix_cache.num_evictions)
    connector = getattr(engine, "connector", None)
    if connector is not None:  # prefix hits per tier, and what the connector moved (minipaged/kv_connector.py)
        info["kv_connector"] = connector.stats()
    trace = engine.trace
    if trace is not None and trace.steps:
        info.update(peak_blocks_used=trace.peak_blocks_used, peak_concurrency=trace.peak_concurrency,
                    kv_waste=trace.kv_waste())
    return info
