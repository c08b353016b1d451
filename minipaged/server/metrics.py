"""Prometheus metrics for ``GET /metrics``, under vLLM's own names (``vllm:num_requests_running``, ...),
so dashboards and alerts built for a vLLM server read a minipaged one unchanged.

Owns one private ``CollectorRegistry`` per server (so two servers in one process never share a
series) and the update hooks the engine loop calls: after every step, at each request's first
token, at every later token, at each finish. It reads nothing from the engine itself.

Gauges: ``num_requests_running``, ``num_requests_waiting``, ``kv_cache_usage_perc`` and the block
counts. Counters: preemptions, prompt and generation tokens, finished requests by reason,
rejected requests by reason, prefix-cache queries and hits (tokens; present once the engine has
a prefix cache), and with a KV connector (the host tier) vLLM's ``external_prefix_cache_queries`` /
``external_prefix_cache_hits`` (tokens asked of it, and given by it). Histograms, per token: inter-token latency; per request (vLLM's request-level
ones): time to first token, end-to-end latency, queue time, prefill time, decode time,
inference time, prompt and generation token counts, ``n`` and ``max_tokens``.
Speculative decoding (present once a draft has been verified), vLLM's counters:
``spec_decode_num_drafts`` (verifying steps, one a sequence), ``spec_decode_num_draft_tokens``,
``spec_decode_num_accepted_tokens`` and ``spec_decode_num_accepted_tokens_per_pos`` (label
``position``: how often the draft token at that position was kept). They are fed from the
engine's totals (``engine.stats()["spec_decode"]``, which :func:`spec_decode_counts` reads) when
the loop puts them in ``LoopStats.extra["spec_decode"]``, else from each finished request's
``metrics.spec_decode``.
``vllm:request_rejected_total``, ``vllm:request_aborted_total`` and the block counts are
minipaged's own additions. ``parse_metrics`` also answers to the old ``minipaged:`` names.
"""
from __future__ import annotations

from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

try:  # "_created" timestamps double every counter's lines and say nothing a learner needs
    from prometheus_client import disable_created_metrics

    disable_created_metrics()
except ImportError:  # older prometheus-client
    pass

PREFIX = "vllm:"
OLD_PREFIX = "minipaged:"  # the names before they were vLLM's; parse_metrics still answers to them
# Seconds; a CPU serves slower than a GPU, so the buckets reach further than vLLM's.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)
PHASE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)
N_BUCKETS = (1, 2, 5, 10, 20)
ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
FINISHED_REASONS = ("stop", "length", "abort", "error")


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r, lab = self.registry, {"model_name": model_name, "engine": "0"}  # vLLM V1's labels: one engine, index 0
        self._labels = lab

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, list(lab), registry=r).labels(**lab)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            c = Counter(PREFIX + name, doc, list(lab) + list(extra), registry=r)
            return c if extra else c.labels(**lab)

        def hist(name: str, doc: str, buckets: tuple) -> Histogram:
            return Histogram(PREFIX + name, doc, list(lab), buckets=buckets, registry=r).labels(**lab)

        self.running = gauge("num_requests_running", "Requests in the engine's running queue (their KV is in the cache).")
        self.waiting = gauge("num_requests_waiting", "Requests waiting for admission (new, or preempted and to be recomputed).")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full).")
        self.blocks_used = gauge("num_kv_blocks_used", "KV blocks in use.")
        self.blocks_total = gauge("num_kv_blocks_total", "KV blocks in the pool.")
        self.preemptions = counter("num_preemptions", "Preemptions: a running request lost its blocks and will be recomputed.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.success = counter("request_success", "Finished requests, by finish reason.", ("finished_reason",))
        for reason in FINISHED_REASONS:  # every series from the start, so a rate() over them never misses one
            self.success.labels(finished_reason=reason, **lab)
        self.iteration_tokens = hist("iteration_tokens_total", "Tokens scheduled in one engine step (prefill and decode).",
                                     ITERATION_BUCKETS)
        self.cache_info: Any = None  # vllm:cache_config_info, set at the first step
        self._seen_steps = 0
        self.rejected = counter("request_rejected", "Requests refused (invalid, overloaded, engine error), by reason.", ("reason",))
        self.aborted = counter("request_aborted", "Requests aborted (the client went away, or shutdown).")
        self._counter = counter
        self.pc_queries: Any = None  # registered once the engine reports a prefix cache
        self.pc_hits: Any = None
        self.ext_queries: Any = None  # registered once the engine reports a KV connector
        self.ext_hits: Any = None
        self.ttft = hist("time_to_first_token_seconds", "From arrival at the server to the first generated token.", TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Between consecutive generated tokens of one request.", ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "From arrival at the server to the last token.", E2E_BUCKETS)
        self.queue_time = hist("request_queue_time_seconds", "From arrival at the engine to its first step (waiting).", PHASE_BUCKETS)
        self.prefill_time = hist("request_prefill_time_seconds", "From the first step to the first token (prefill).", PHASE_BUCKETS)
        self.decode_time = hist("request_decode_time_seconds", "From the first token to the last (decode).", PHASE_BUCKETS)
        self.inference_time = hist("request_inference_time_seconds", "From the first step to the last token (prefill + decode).", PHASE_BUCKETS)
        self.req_prompt_tokens = hist("request_prompt_tokens", "Prompt tokens per finished request.", TOKEN_BUCKETS)
        self.req_generation_tokens = hist("request_generation_tokens", "Generated tokens per finished request (all samples).", TOKEN_BUCKETS)
        self.req_n = hist("request_params_n", "The n (samples) of each finished request.", N_BUCKETS)
        self.req_max_tokens = hist("request_params_max_tokens", "The max_tokens of each finished request.", TOKEN_BUCKETS)
        self._seen_preemptions = 0
        self._seen_pc = {"queries": 0, "hits": 0, "external_queries": 0, "external_hits": 0}
        self.spec: dict[str, Any] | None = None  # the spec-decode counters, registered at the first draft
        self._seen_spec = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0}
        self._seen_spec_pos: list[int] = []
        self._spec_from_engine = False  # the loop feeds the engine's totals: requests' counts are in them

    # -- hooks (called on the engine thread) -----------------------------------------------
    def on_step(self, st: Any) -> None:
        cache = st.extra.get("cache_config")
        if cache and self.cache_info is None:
            self.cache_info = Gauge(PREFIX + "cache_config_info", "The KV cache's settings (labels); the value is 1.",
                                    list(self._labels) + sorted(cache), registry=self.registry)
            self.cache_info.labels(**self._labels, **{k: str(v) for k, v in cache.items()}).set(1)
        if st.extra.get("step_tokens") and st.num_steps > self._seen_steps:
            self.iteration_tokens.observe(st.extra["step_tokens"])
            self._seen_steps = st.num_steps
        self.running.set(st.num_running)
        self.waiting.set(st.num_waiting)
        self.blocks_used.set(st.num_used_blocks)
        self.blocks_total.set(st.num_blocks)
        self.kv_usage.set(st.num_used_blocks / st.num_blocks if st.num_blocks else 0.0)
        if st.num_preemptions > self._seen_preemptions:
            self.preemptions.inc(st.num_preemptions - self._seen_preemptions)
            self._seen_preemptions = st.num_preemptions
        if "queries" in st.extra and self.pc_queries is None:
            self.pc_queries = self._counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
            self.pc_hits = self._counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        if "external_queries" in st.extra and self.ext_queries is None:  # a KV connector (vLLM's names)
            self.ext_queries = self._counter("external_prefix_cache_queries",
                                             "Prompt tokens asked of the KV connector (the host tier, another engine).")
            self.ext_hits = self._counter("external_prefix_cache_hits", "Prompt tokens the KV connector provided.")
        for key, metric in (("queries", self.pc_queries), ("hits", self.pc_hits), ("external_queries", self.ext_queries),
                            ("external_hits", self.ext_hits)):
            if metric is not None and st.extra.get(key, 0) > self._seen_pc[key]:
                metric.inc(st.extra[key] - self._seen_pc[key])
                self._seen_pc[key] = st.extra[key]
        if st.extra.get("spec_decode"):
            self.on_spec_decode(st.extra["spec_decode"])

    # -- speculative decoding ------------------------------------------------------------
    def _spec_counters(self) -> dict[str, Any]:
        if self.spec is None:
            c = self._counter
            self.spec = {
                "num_drafts": c("spec_decode_num_drafts", "Drafts verified: one sequence's proposal in one step."),
                "num_draft_tokens": c("spec_decode_num_draft_tokens", "Draft tokens proposed and verified."),
                "num_accepted_tokens": c("spec_decode_num_accepted_tokens", "Draft tokens kept (equal to the target's)."),
                "per_pos": Counter(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                   "Draft tokens kept, by their position in the draft (0: the first).",
                                   list(self._labels) + ["position"], registry=self.registry),
            }
        return self.spec

    def _add_spec(self, counts: dict, totals: bool) -> None:
        """``counts``: spec-decode counts (SpecDecoder.as_dict's keys); ``totals``: they are the engine's
        running totals (count what is new since the last call), else one request's (count them all)."""
        if not counts or not counts.get("num_drafts"):
            return
        m = self._spec_counters()
        for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            v = int(counts.get(key, 0))
            add = v - self._seen_spec[key] if totals else v
            if add > 0:
                m[key].inc(add)
                self._seen_spec[key] += add
        pos = [int(x) for x in counts.get("accepted_per_pos") or []]
        seen = self._seen_spec_pos
        seen += [0] * (len(pos) - len(seen))
        for i, v in enumerate(pos):
            add = v - seen[i] if totals else v
            child = m["per_pos"].labels(position=str(i), **self._labels)  # every position drafted shows, 0 or not
            if add > 0:
                child.inc(add)
                seen[i] += add

    def on_spec_decode(self, totals: dict) -> None:
        """The engine's spec-decode totals so far (``engine.stats()["spec_decode"]``); from then on they
        alone feed the counters (each finished request's counts are already in them)."""
        self._spec_from_engine = True
        self._add_spec(totals, totals=True)

    def on_first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)
        self.generation_tokens.inc()

    def on_token(self, seconds_each: float, count: int) -> None:
        for _ in range(count):
            self.itl.observe(seconds_each)
        self.generation_tokens.inc(count)

    def on_finish(self, out: Any, e2e_s: float, params: Any = None) -> None:
        self.e2e.observe(e2e_s)
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        self.req_prompt_tokens.observe(len(out.prompt_token_ids))
        samples = getattr(out, "outputs", None) or [out]
        self.req_generation_tokens.observe(sum(len(s.token_ids) for s in samples))
        self.req_n.observe(len(samples))
        if params is not None and getattr(params, "max_tokens", None) is not None:
            self.req_max_tokens.observe(params.max_tokens)
        m = getattr(out, "metrics", None)
        get = (lambda k: getattr(m, k, None)) if m is not None and not isinstance(m, dict) else (lambda k: (m or {}).get(k))
        arrival, scheduled, first, last = get("arrival_time"), get("first_scheduled_time"), get("first_token_time"), get("last_token_time")
        if last is None:
            last = get("finished_time") if get("finished_time") is not None else get("finish_time")
        if scheduled is None:
            scheduled = arrival
        if arrival is not None and scheduled is not None:
            self.queue_time.observe(max(0.0, scheduled - arrival))
        if scheduled is not None and first is not None:
            self.prefill_time.observe(max(0.0, first - scheduled))
        if first is not None and last is not None:
            self.decode_time.observe(max(0.0, last - first))
        if scheduled is not None and last is not None:
            self.inference_time.observe(max(0.0, last - scheduled))
        self.success.labels(finished_reason=str(out.finish_reason), **self._labels).inc()
        if not self._spec_from_engine:  # a request's own drafts, when the loop does not give the engine's totals
            spec = get("spec_decode")
            if isinstance(spec, dict):
                self._add_spec(spec, totals=False)

    def on_rejected(self, reason: str) -> None:
        self.rejected.labels(reason=reason, **self._labels).inc()

    def on_aborted(self) -> None:
        self.aborted.inc()

    # -- exposition ------------------------------------------------------------------------
    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def spec_decode_counts(engine: Any) -> dict:
    """``{"spec_decode": engine.stats()["spec_decode"]}`` for an engine with speculation on, else {}:
    what an engine loop puts in ``LoopStats.extra`` for :meth:`ServerMetrics.on_step`."""
    spec = getattr(engine, "spec", None)
    if spec is not None and callable(getattr(spec, "as_dict", None)):
        return {"spec_decode": spec.as_dict()}  # what engine.stats()["spec_decode"] holds, without the rest
    return {}


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {"name{labels}": value}, plus each name summed over its labels (for lessons, tests).

    Every ``vllm:X`` key is also there as ``minipaged:X`` (the names of earlier versions)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        try:
            v = float(value)
        except ValueError:
            continue
        out[key] = v
        name = key.split("{", 1)[0]
        if "{" in key and "le=" not in key:
            out[name] = out.get(name, 0.0) + v
    for key in [k for k in out if k.startswith(PREFIX)]:
        out[OLD_PREFIX + key[len(PREFIX):]] = out[key]
    return out
