"""The engine: one ``step()`` = schedule, run the model on the paged cache, sample, update.

Owns the loop and the glue (inputs for the model, outputs for the caller) and the promise
that one bad request cannot break it: every request is validated before it is queued, and
when anything raises inside a step, that step's requests finish with ``finish_reason="error"``,
their blocks are freed and the engine goes on serving the others. The memory policy lives in
the scheduler, the maths in the model and attention backends. Every part is injected (see
interfaces.py for the contracts), so a learner's allocator, block table, scheduler or attention
can replace ours.

    InputProcessor        -> (add_request) the prompt as token ids, the request checked (inputs.py)
    Scheduler.schedule()  -> who runs, how many new tokens each
    ModelRunner.prepare() -> flat input_ids, positions, slot_mapping, block_tables, context_lens
    model.forward()       -> per layer: write K/V through slot_mapping, paged attention
    Sampler               -> a token for each sequence whose prompt is fully computed
    Scheduler.update()    -> append tokens (the stop checker decides who is done), free blocks
    request_output()      -> a RequestOutput per changed request: text, delta, stop reason (output_processor.py)

The ``LLM`` facade over it is in llm.py. The engine is single-threaded by design: a second thread
that enters it while another is inside gets a RuntimeError (``minipaged serve`` runs one engine
loop that owns it).
"""
from __future__ import annotations

import bisect
import collections
import importlib
import itertools
import threading
import time
import warnings
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from .executor import make_executor
from .plan import Plan
from .config import CONFIG_FIELDS, PARTS_FIELDS, EngineConfig, Parts, split_kwargs
from .block_allocator import BlockAllocator
from .block_table import BlockTable
from .data import FinishReason, Sequence, SequenceStatus
from .detokenizer import StopChecker
from .inputs import InputProcessor, check_parallel_sampling, check_request_id, fit_max_tokens, request_args
from .interfaces import BlockPool, BlockTableProtocol, PrefixCacheProtocol, SchedulerProtocol
from .kv_cache import KVCache, available_memory_bytes, kv_bytes_per_token, plan_num_blocks
from .parts import check_part, declared_support, require_support
from .runner import ModelRunner
from .output_processor import request_output, text_tokenizer
from .prefix_cache import PrefixCache
from .engine_stats import EngineTotals, engine_stats
from .outputs import CompletionOutput, RequestMetrics, RequestOutput  # noqa: F401 - vLLM's output types, importable from here too
from .sampling import Sampler, SamplingParams, prompt_logprobs_of
from .scheduler import Scheduler
from .spec_decode import SpecDecoder, SpeculativeConfig
from .step_faults import fail_nonfinite, fail_nonfinite_rows, fail_step, mask_batch
from .disagg import build_driver
from .beam_search import BeamSearchParams, SharingCounter, advance_beams, observe_beams, queue_beam_search


@dataclass
class _Request:
    """The engine's record of one request: its sequence (sample 0, whose id is the request's),
    every sample, the prompt's text for its outputs, and its prompt logprobs."""

    seq: Sequence
    prompt: Any
    samples: list = field(default_factory=list)  # every sequence of the request (n), sample 0 first
    prompt_logprobs: Any = None  # with SamplingParams(prompt_logprobs=k): vLLM's list, None first

    def __post_init__(self) -> None:
        if not self.samples:
            self.samples = [self.seq] + list(self.seq.forks)

    @property
    def params(self) -> SamplingParams:
        """The request's SamplingParams, as its sequence holds them (their one owner in the engine)."""
        return self.seq.sampling_params

    @classmethod
    def for_prompt(cls, request_id: str, prompt: str | None, token_ids: list[int], params: SamplingParams, eos: tuple,
                   tokenizer: Any, max_model_len: int, arrival: float) -> "_Request":
        """A new request: sample 0 is its sequence; with n > 1, samples 1..n-1 wait in its forks
        until the prompt is computed once. Each has its stop checker (``tokenizer`` makes its text)."""
        samples = []
        for i in range(params.n):
            q = Sequence.for_request(request_id if i == 0 else f"{request_id}#{i}", token_ids, params, eos)
            q.stop_checker = StopChecker.for_sequence(q, params.stop, max_model_len, tokenizer)
            q.arrival_time = arrival
            samples.append(q)
        samples[0].forks = samples[1:]
        return cls(samples[0], prompt, samples)

    def force_finish(self, scheduler: Any, reason: FinishReason, error: str | None, t0: float) -> None:
        """Finish every sample still going (and sample 0) outside the normal stop rule: abort or
        error. Its blocks are freed even when the scheduler's finish() raises (the error says so)."""
        seq = self.seq
        for q in self.samples:
            if q.is_finished and q is not seq:
                continue
            try:
                scheduler.finish(q, reason)
            except Exception as e:  # a learner's finish() that raises must not lose the request
                error = f"{error + '; ' if error else ''}finish() raised {type(e).__name__}: {e}"
            if q.block_table is not None:  # a finish() that forgot the blocks: give them back here
                try:
                    q.block_table.free()
                except Exception:
                    pass
                q.block_table = None
            q.status = SequenceStatus.FINISHED
            q.finish_reason = reason
            if error is not None:
                q.reject_reason = error
            q.stop_checker.finish(reason)
            q.finish_time = time.perf_counter() - t0

    def unshared_blocks(self, prefix_cache: Any) -> set[int]:
        """The blocks of its samples that no other request can read (no block the prefix cache holds)."""
        pc = prefix_cache
        is_cached = getattr(pc, "is_cached", lambda b: True) if pc is not None else (lambda b: False)
        return {b for q in self.samples if q.block_table is not None for b in q.block_table.blocks if not is_cached(b)}


def resolve_parts(parts: Parts) -> Parts:
    """``parts`` with every part left at None replaced by minipaged's own (the config names no implementation)."""
    return replace(
        parts,
        allocator_cls=parts.allocator_cls or BlockAllocator,
        block_table_cls=parts.block_table_cls or BlockTable,
        scheduler_cls=parts.scheduler_cls or Scheduler,
        prefix_cache_cls=parts.prefix_cache_cls or PrefixCache,
    )


def resolve_prefix_caching(setting: bool | None, scheduler_cls: type) -> bool:
    """None (the default): on when the scheduler's ``schedule`` declares ``prefix_caching``
    (minipaged's does); True: on, refused for a scheduler that does not declare it; False: off."""
    if setting is None:
        return "prefix_caching" in declared_support(scheduler_cls, "schedule")
    if not isinstance(setting, bool):
        raise ValueError(f"enable_prefix_caching must be True, False or None (on when the scheduler supports it), got {setting!r}")
    if setting:
        require_support(scheduler_cls, "schedule", "prefix_caching", "enable_prefix_caching=True", "scheduler")
    return setting


class _Guard:
    """Refuses a second thread while one is inside the engine, and a re-entry from inside it (a
    step() or add_request() called from an attention function would run a step inside a step)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: int | None = None

    def __enter__(self) -> None:
        if not self._lock.acquire(blocking=False):
            if self._owner == threading.get_ident():
                raise RuntimeError(
                    "the engine was re-entered from inside itself: step(), add_request() or abort_request() was "
                    "called while a step (or another of these calls) was running, e.g. from an attention function. "
                    "A step cannot run inside a step: return from your function and call the engine after step() returns."
                )
            raise RuntimeError(
                "LLMEngine is single-threaded: another thread is inside it right now. Call it from one "
                "thread (an engine loop that owns it, as `minipaged serve` does), or give each thread its own engine."
            )
        self._owner = threading.get_ident()

    def __exit__(self, *exc: Any) -> None:
        self._owner = None
        self._lock.release()


# -- building an engine: its settings and its parts, checked ---------------------------------
def _settings(config: EngineConfig | None, parts: Parts | None, kwargs: dict) -> tuple[EngineConfig, Parts]:
    """The engine's (config, parts): plain keywords split between the two, every part left at None resolved."""
    if config is not None and not isinstance(config, EngineConfig):
        raise TypeError(f"config must be a minipaged.config.EngineConfig, got {type(config).__name__}")
    if kwargs:
        split_kwargs(kwargs)  # raises on an unknown key, naming the nearest
        config = (config or EngineConfig()).replace(**{k: v for k, v in kwargs.items() if k in CONFIG_FIELDS})
        parts = replace(parts or Parts(), **{k: v for k, v in kwargs.items() if k in PARTS_FIELDS})
    return config or EngineConfig(), resolve_parts(parts or Parts())


def _fit_config(config: EngineConfig, parts: Parts, mcfg: Any) -> EngineConfig:
    """``config`` with max_model_len (default: the model's positions) and prefix caching decided."""
    positions = mcfg.max_position_embeddings
    if config.max_model_len is not None and config.max_model_len > positions:
        raise ValueError(
            f"max_model_len={config.max_model_len} is past the model's {positions} positions "
            f"({mcfg.name}): use max_model_len <= {positions}"
        )
    return config.replace(max_model_len=config.max_model_len or positions,
                          enable_prefix_caching=resolve_prefix_caching(config.enable_prefix_caching, parts.scheduler_cls))


def _kv_heads(mcfg: Any, config: EngineConfig) -> int:
    """The KV heads this process caches: each rank's share of them, with tensor parallelism."""
    if config.tensor_parallel_size <= 1:
        return mcfg.num_kv_heads
    from .distributed import kv_heads_per_rank

    return kv_heads_per_rank(mcfg.num_heads, mcfg.num_kv_heads, mcfg.intermediate_size, config.tensor_parallel_size)


def check_parts(parts: Parts, config: EngineConfig) -> SpeculativeConfig | None:
    """The part classes against their Protocols, and every setting a part must declare it supports;
    returns the speculative config (None: off), a bad value a clear error here."""
    check_part(parts.allocator_cls, BlockPool, "allocator")
    check_part(parts.block_table_cls, BlockTableProtocol, "block table")
    check_part(parts.scheduler_cls, SchedulerProtocol, "scheduler")
    if not config.enable_chunked_prefill:
        require_support(parts.scheduler_cls, "schedule", "chunked_prefill_off", "enable_chunked_prefill=False", "scheduler")
    spec = SpeculativeConfig.from_dict(config.speculative_config)
    if spec is not None:
        require_support(parts.scheduler_cls, "schedule", "speculative_decoding", "speculative_config", "scheduler")
        trunc = getattr(parts.block_table_cls, "truncate", None)
        if trunc is not None and not callable(trunc):  # the contract's optional member (interfaces.OPTIONAL_MEMBERS)
            raise TypeError(f"{parts.block_table_cls.__name__}.truncate is {type(trunc).__name__}, not a method: "
                            "speculative_config rolls rejected drafts back with truncate(num_tokens); define it "
                            "as a method, or remove it to let minipaged cut the table through its public members")
    return spec


def build_block_pool(parts: Parts, config: EngineConfig, num_blocks: int) -> tuple[Any, Any]:
    """(the pool the scheduler and block tables see, the prefix cache or None), each part checked.

    With prefix caching the pool is the cache (its free count includes cached blocks nobody
    holds), and the allocator it wraps stays at ``prefix_cache.pool``."""
    allocator = parts.allocator_cls(num_blocks, config.block_size)
    check_part(allocator, BlockPool, "allocator")
    if allocator.num_blocks != num_blocks or allocator.block_size != config.block_size:
        raise ValueError(
            f"your allocator {type(allocator).__name__}(num_blocks={num_blocks}, block_size={config.block_size}) "
            f"reports num_blocks={allocator.num_blocks}, block_size={allocator.block_size}: keep the ones it is given"
        )
    prefix_cache = None
    if config.enable_prefix_caching:
        check_part(parts.prefix_cache_cls, PrefixCacheProtocol, "prefix cache")
        prefix_cache = parts.prefix_cache_cls(allocator)
        check_part(prefix_cache, PrefixCacheProtocol, "prefix cache")
        allocator = prefix_cache
    check_part(parts.block_table_cls(allocator), BlockTableProtocol, "block table")
    return allocator, prefix_cache


def plug_sharing_fns(scheduler: Any, parts: Parts) -> None:
    """The parts ``fork_table``, ``copy_on_write`` and ``free_table`` given (interfaces.SharingFns), on the
    scheduler that calls them: refused, naming the part, when one is not callable or the scheduler's
    schedule() does not declare it calls them."""
    given = {n: getattr(parts, n) for n in ("fork_table", "copy_on_write", "free_table") if getattr(parts, n) is not None}
    if not given:
        return
    for name, fn in given.items():
        if not callable(fn):
            raise TypeError(f"{name} must be a function (see minipaged.interfaces.SharingFns), got {type(fn).__name__}")
    require_support(type(scheduler), "schedule", "sharing_fns", ", ".join(given), "scheduler")
    for name, fn in given.items():
        setattr(scheduler, name, fn)


class LLMEngine:
    """``add_request`` / ``step`` / ``abort_request`` / ``has_unfinished_requests``.

    ``config`` (EngineConfig) holds the settings and ``parts`` (Parts) the injected parts; plain
    keywords (``block_size=8``, ``scheduler_cls=MyScheduler``) are split between the two.
    Parts are checked against their Protocols here, and a setting a part does not declare it
    supports is refused here, not ignored later.
    """

    def __init__(self, model: torch.nn.Module, tokenizer: Any = None, config: EngineConfig | None = None,
                 parts: Parts | None = None, **kwargs: Any) -> None:
        config, parts = _settings(config, parts, kwargs)
        self.model = model.eval()
        mcfg = model.config
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        config = _fit_config(config, parts, mcfg)
        kv_heads = _kv_heads(mcfg, config)
        num_blocks = plan_num_blocks(config, mcfg.num_layers, kv_heads, mcfg.head_dim,
                                     config.max_model_len, self.dtype, self.device)
        self.config, self.parts = config, parts
        spec = check_parts(parts, config)
        self.allocator, self.prefix_cache = build_block_pool(parts, config, num_blocks)
        self.scheduler = parts.scheduler_cls(self.allocator, parts.block_table_cls, config)
        check_part(self.scheduler, SchedulerProtocol, "scheduler")
        plug_sharing_fns(self.scheduler, parts)
        self.kv_cache = KVCache(mcfg.num_layers, num_blocks, config.block_size, kv_heads, mcfg.head_dim, self.dtype,
                                self.device, kv_cache_dtype=config.kv_cache_dtype,
                                calculate_kv_scales=config.calculate_kv_scales)
        self.connector = build_driver(self)  # where KV lives besides this pool (None: nowhere)
        # the one decision about speed: which implementation runs each stage (engine.plan), made
        # here, once, from the config; the executor owns every copy a fast path needs
        self.executor = self._build_executor()
        self.runner = ModelRunner(self.device)
        self.sampler = Sampler()
        # speculative decoding: n-gram drafts, verified in the step's one forward pass (None: off)
        self.spec = (SpecDecoder(spec, config.max_model_len,
                                 disable_by_batch_size=self.executor.plan.speculative_batch_limit,
                                 proposer=parts.proposer)
                     if spec is not None else None)
        self.inputs = InputProcessor(tokenizer, mcfg.vocab_size)  # prompts -> token ids, requests checked
        self.sampler.decode = self._decode_token if tokenizer is not None else None  # Logprob.decoded_token
        # structured outputs (minipaged.structured_output): made with the first request that has a grammar
        self.structured = None
        self._init_books()

    def _init_books(self) -> None:
        """The request table, the counters ``stats()`` reads, the clock and the trace."""
        self.requests: dict[str, _Request] = {}  # unfinished requests (finished ones are pruned)
        self._request_of: dict[str, str] = {}  # seq id of sample i >= 1 -> its request id
        self._ids = itertools.count()
        self._pending: list[RequestOutput] = []  # rejected / aborted / failed: reported by the next step()
        self._guard = _Guard()
        self.totals = EngineTotals()  # what stats() reports
        self.t0 = time.perf_counter()
        self.num_steps = 0
        self.last_route: str | None = None  # what the last step ran (see Executor.last_route)
        self.route_counts: collections.Counter = collections.Counter()  # steps per route
        self._beams: dict = {}  # request id -> BeamGroup, for beam search requests (beam_search.py)
        self.sharing = SharingCounter()  # blocks the running tables would need without sharing, and hold
        self.trace = None
        if self.config.record_trace:
            from .trace import Trace

            self.trace = Trace()

    # -- speed: the plan ---------------------------------------------------------------------
    @property
    def plan(self) -> Plan:
        """Which implementation runs each stage, and why each refused fast path was refused
        (``print(engine.plan)`` shows a table). Made once, when the engine was built."""
        return self.executor.plan

    @property
    def backend(self):
        """The attention backend every layer of every step calls (its name is what runs)."""
        return self.executor.backend

    def shutdown(self) -> None:
        """Stop what the engine started outside this process (tensor-parallel workers); idempotent."""
        close = getattr(self.executor, "close", None)
        if close is not None:
            close()
        if getattr(self, "connector", None) is not None:  # a KV transfer link
            self.connector.close()

    def rebuild_executor(self) -> Plan:
        """After changing the model's weights or modules: plan again and drop every copy the old
        plan made (GGUF blocks that no longer match are refused, packs remade). The KV cache and
        the requests stay; cached prefixes computed with the old weights are not reused wrongly
        only if you also reset the prefix cache."""
        with self._guard:
            self.shutdown()  # tensor-parallel workers hold the old shards: they are replaced too
            self.executor = self._build_executor()
            return self.executor.plan

    def _build_executor(self):
        if self.config.tensor_parallel_size > 1:  # one scheduler here, the model's shards in N processes
            from .distributed import TensorParallelExecutor

            return TensorParallelExecutor(self.config, self.model, self.device, self.parts.attention, self.kv_cache)
        executor = make_executor(self.config, self.model, self.device, self.parts.attention, self.kv_cache)
        if self.connector is not None:  # the plan names the connector too
            from .kv_connector import plan_with_connector

            executor.plan = plan_with_connector(executor.plan, self.connector.connector)
        return executor

    # -- sizes -----------------------------------------------------------------------------
    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    @property
    def kv_bytes_per_token(self) -> int:
        cfg = self.model.config
        return kv_bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, self.dtype, self.config.kv_cache_dtype)

    # -- requests --------------------------------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        """The tokenizer (None: the engine takes token ids only); the input processor holds it."""
        return self.inputs.tokenizer

    def encode_prompt(self, prompt: Any) -> list[int]:
        """One prompt -> token ids: a string, ``{"prompt": ...}``, ``{"prompt_token_ids": [...]}``,
        a list of token ids, chat messages or a chat request (see ``InputProcessor.encode_prompt``)."""
        return self.inputs.encode_prompt(prompt)

    def render_chat(self, messages: Any, add_generation_prompt: bool = True, continue_final_message: bool = False,
                    chat_template: str | None = None, chat_template_kwargs: dict | None = None) -> str:
        """A conversation as prompt text, with vLLM's chat options (see ``InputProcessor.render_chat``)."""
        return self.inputs.render_chat(messages, add_generation_prompt, continue_final_message, chat_template,
                                       chat_template_kwargs)

    def _decode_token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    @torch.inference_mode()
    def _prompt_logprobs(self, token_ids: list[int], k: int) -> list:
        """vLLM's prompt_logprobs, from one extra pass of the prompt into a scratch cache of its own
        (the request's own KV is computed as usual by the steps), as the plan's prompt_logprobs route says."""
        logits = self.executor.prompt_logits(token_ids, self.block_size).float().cpu()
        return prompt_logprobs_of(logits, token_ids, k, self._decode_token if self.tokenizer is not None else None)

    @classmethod
    def from_engine_args(cls, engine_args: Any) -> "LLMEngine":
        """vLLM's constructor: an engine from an ``EngineArgs`` (see minipaged.engine_args)."""
        model, tokenizer = engine_args.load()
        return cls(model, tokenizer, **engine_args.engine_settings)

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block (vLLM's ``reset_prefix_cache``). False, and nothing
        forgotten, while a request still holds cached blocks, or when the prefix cache cannot reset."""
        with self._guard:
            if self.prefix_cache is None:
                return True
            reset = getattr(self.prefix_cache, "reset", None)
            return bool(reset()) if reset is not None else False

    def new_request_id(self) -> str:
        rid = str(next(self._ids))
        while rid in self.requests:
            rid = str(next(self._ids))
        return rid

    def add_request(self, *args: Any, request_id: Any = None, prompt: Any = None, params: SamplingParams | None = None,
                    sampling_params: SamplingParams | None = None, arrival_time: float | None = None) -> str:
        """Queue a request and return its id: ``add_request(request_id, prompt, params)``, vLLM's order.

        minipaged's older order, ``add_request(prompt, params, request_id=None)``, is still taken:
        the second argument tells them apart (a SamplingParams or None there means the old order;
        a prompt means vLLM's). ``prompt`` is any form ``encode_prompt`` takes.

        Everything is checked here, before anything is queued: bad input raises ValueError or
        TypeError and leaves the engine as it was. The SamplingParams are validated again (a field
        set since they were made is checked now). A request that can never fit in the KV pool is
        rejected instead (its output, from the next ``step()``, says why) and the engine goes on.
        """
        request_id, prompt, sampling_params = request_args(args, request_id, prompt, params, sampling_params)
        with self._guard:
            params = self.inputs.check_params(sampling_params, self.config.max_num_seqs)
            request_id = self.new_request_id() if request_id is None else check_request_id(request_id)
            if request_id in self.requests:
                raise ValueError(f"request id {request_id!r} is already in use by an unfinished request")
            token_ids = self.encode_prompt(prompt)
            params = fit_max_tokens(params, sampling_params is not None, len(token_ids), self.config.max_model_len)
            check_parallel_sampling(params, self.scheduler)
            if params.structured_outputs is not None:  # compiled now: a bad grammar is refused before any work
                self._grammar().compile(params.structured_outputs)
            self._queue(self._new_request(request_id, prompt, token_ids, params))
            return request_id

    def _grammar(self):
        """The engine's structured-output state (made on first use: xgrammar is imported then)."""
        if self.structured is None:
            from .structured_output import StructuredOutputs

            self.structured = StructuredOutputs(self.tokenizer, self.model.config.vocab_size)
        return self.structured

    def add_beam_request(self, prompt: Any, params: BeamSearchParams, request_id: Any = None) -> str:
        """Queue a beam search (``LLM.beam_search`` uses it) and return its request id. Its beams are
        sequences of this one request; its one output, when every beam is done, holds the
        ``beam_width`` best hypotheses (best first) as samples. Bad params are a ValueError; a search
        that can never fit the pool is rejected, saying why (its output comes from the next step)."""
        with self._guard:
            return queue_beam_search(self, prompt, params, request_id)

    def _new_request(self, request_id: str, prompt: Any, token_ids: list[int], params: SamplingParams) -> _Request:
        """The request's sequences (sample 0, and with n > 1 samples 1..n-1 waiting in its forks
        until the prompt is computed once), each with its stop checker; and its prompt logprobs."""
        source = self.tokenizer if self.tokenizer is not None else self.model.config
        eos = tuple(getattr(source, "eos_token_ids", ()) or ())
        arrival = time.perf_counter() - self.t0
        req = _Request.for_prompt(request_id, self.inputs.prompt_text(prompt), token_ids, params, eos,
                                  text_tokenizer(self.tokenizer, params), self.config.max_model_len, arrival)
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = self._prompt_logprobs(token_ids, params.prompt_logprobs)
        return req

    def _queue(self, req: _Request) -> None:
        """Hand ``req`` to the scheduler; one it rejects (it can never fit) is reported by the next step."""
        seq, params = req.seq, req.params
        self.totals.added(seq)
        if not self.scheduler.add_request(seq):
            if seq.status is not SequenceStatus.REJECTED or seq.seq_id in {s.seq_id for s in self.scheduler.waiting}:
                raise RuntimeError(f"{type(self.scheduler).__name__}.add_request returned False but queued {seq}")
            seq.finish_time = seq.arrival_time
            self.totals.rejected += 1
            for f in req.samples[1:]:
                f.finish_time = seq.finish_time
            seq.forks = []
            self._pending.append(self._output(req))
            return
        self.requests[seq.seq_id] = req
        for i, q in enumerate(req.samples):  # sample i draws from seed + i: reproducible alone or in a batch
            self.sampler.add(q.seq_id, params if params.seed is None or i == 0 else replace(params, seed=params.seed + i), seq=q)
            if i:
                self._request_of[q.seq_id] = seq.seq_id

    def abort_request(self, request_id: str) -> bool:
        """Stop a request now and free its blocks; its output (finish_reason "abort") comes from
        the next ``step()``. Returns False when no unfinished request has that id."""
        with self._guard:
            req = self.requests.get(str(request_id))
            if req is None:
                return False
            self._end(req, FinishReason.ABORT)
            return True

    def _end(self, req: _Request, reason: FinishReason, error: str | None = None) -> None:
        """Finish ``req`` outside the normal stop rule (abort, error): free it, report it next step."""
        req.force_finish(self.scheduler, reason, error, self.t0)
        self.totals.ended(aborted=reason is FinishReason.ABORT)
        self._retire(req)
        self._pending.append(self._output(req))

    def _retire(self, req: _Request) -> None:
        self.requests.pop(req.seq.seq_id, None)
        self._beams.pop(req.seq.seq_id, None)
        for q in req.samples:
            self._request_of.pop(q.seq_id, None)
            self.sampler.remove(q.seq_id)
            if self.structured is not None:
                self.structured.remove(q.seq_id)
            if self.connector is not None:
                self.connector.finished(q)
            if self.spec is not None:
                self.spec.forget(q.seq_id)
            self.totals.retired(q)

    def _request(self, seq: Sequence) -> "_Request | None":
        return self.requests.get(self._request_of.get(seq.seq_id, seq.seq_id))

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self._pending)

    # -- one step --------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Run one engine step; return an output for every request that changed.

        If anything raises inside the step (the scheduler, the model, attention, sampling), the
        requests of this step finish with ``finish_reason="error"`` and the message, their blocks
        are freed, and the engine keeps serving the others. A NaN or inf in a request's hidden
        states or logits ends that request alone, the same way. No block a failed request wrote in
        this step is cached (update() caches full blocks, and it runs for the others only).
        """
        with self._guard:
            outputs, self._pending = self._pending, []
            if not self.requests:
                return outputs
            out = None
            try:
                if self.spec is not None:  # drafts for every sequence about to decode
                    self.spec.propose(self.scheduler.running)
                    if self.structured is not None:  # a draft the grammar refuses is cut before it is verified
                        self.structured.trim_drafts(self.scheduler.running)
                if self.connector is not None:  # blocks another tier holds, loaded for waiting requests
                    self.connector.before_schedule(self.kv_cache)
                out = self.scheduler.schedule()
                self.last_step_tokens = out.num_batched_tokens  # vllm:iteration_tokens_total
                if self.connector is not None:
                    self.connector.admitted(out)
                if out.is_empty:
                    if not outputs:
                        raise RuntimeError(
                            "the scheduler scheduled nothing although requests are waiting: "
                            f"{len(self.scheduler.waiting)} waiting, {len(self.scheduler.running)} running, "
                            f"{self.allocator.num_free_blocks} free blocks. A scheduler must make progress every step."
                        )
                    return outputs
                inputs, hidden = self._run_model(out)
                if self.connector is not None:  # what this step computed, saved by the connector
                    self.connector.save(self.kv_cache, out)
                sampled = self._sample(inputs, hidden)
                self.route_counts[self.last_route] += 1
                now = time.perf_counter() - self.t0
                self.scheduler.update(out, sampled)
                beam_outputs = advance_beams(self) if self._beams else []
                if self.spec is not None:  # drafts of sequences the budget left out this step go too
                    self.spec.clear(self.scheduler.running)
            except Exception as e:
                return outputs + fail_step(self, out, e)
            finally:
                if self.connector is not None:  # the blocks held while loads were in flight go back
                    self.connector.release()
            outputs += self._pending  # requests a non-finite value ended in this step
            self._pending = []
            return outputs + self._step_outputs(out, inputs, sampled, now) + beam_outputs

    def _run_model(self, out: Any) -> tuple[Any, torch.Tensor]:
        """The model's forward pass over the scheduled tokens: (the runner's inputs, hidden states).
        A NaN or inf ends the requests whose rows hold it (prefill chunks too), before update()
        could cache a block they wrote; the others go on."""
        for sch in out.scheduled:  # vLLM's metrics: first scheduled, and what the prefix cache gave
            if getattr(sch.seq, "first_scheduled_time", None) is None:
                sch.seq.first_scheduled_time = time.perf_counter() - self.t0
                sch.seq.num_cached_tokens = sch.seq.num_computed_tokens
        if out.blocks_to_copy:  # copy-on-write, before this step writes K/V
            self.executor.copy_blocks(out.blocks_to_copy)
        inputs = self.runner.prepare(out)
        hidden = self.executor.forward(inputs.input_ids, inputs.positions, inputs.meta)
        fail_nonfinite_rows(self, hidden, inputs)
        return inputs, hidden

    def _sample(self, inputs: Any, hidden: torch.Tensor) -> dict:
        """The next token of every live sequence whose prompt is computed, by seq id (with
        speculative decoding: each verifying sequence's accepted run); sets ``last_route``."""
        live = [k for k, s in enumerate(inputs.samplers) if not s.seq.is_finished]
        if self._beams:  # beams: their candidates go to their group, which chooses after update()
            live = observe_beams(self, inputs, hidden, live)
        samplers = [inputs.samplers[k] for k in live]
        if not samplers:
            self.last_route = f"{self.executor.last_route}+none"
            return {}
        h = hidden[[inputs.sample_rows[k] for k in live]]
        # a prompt computed for n samples: its one row of logits gives every sample's first token
        who = [(i, q) for i, s in enumerate(samplers) for q in [s.seq] + list(s.seq.forks)]
        seqs, tokens, route = self._next_tokens(h, who)
        sampled = {s.seq_id: t for s, t in zip(seqs, tokens)}
        if self.spec is not None:  # each verifying sequence's accepted run
            sampled = self.spec.verify(inputs, hidden, sampled, self.executor.compute_logits, self.sampler,
                                       structured=self.structured)
        self.last_route = f"{self.executor.last_route}+{route}"
        return sampled

    def _next_tokens(self, h: torch.Tensor, who: list) -> tuple[list[Sequence], list[int], str]:
        """(the sequences sampled, their tokens, the route) from ``h`` (one row per computed prompt
        or decode); ``who``: (row of h, sequence), one per sequence, n of them for an n-sample prompt."""
        seqs = [q for _, q in who]
        if (len(who) == h.shape[0] and type(self.sampler) is Sampler
                and all(not q.sampling_params.needs_logits for q in seqs)):
            # (a row that wants logprobs, penalties, a bias or min_tokens needs the logits)
            # every row greedy: the argmax straight from the head, where the plan allows
            tokens = self.executor.greedy_tokens(h)
            if tokens is not None:
                return seqs, tokens, "head_argmax"
        logits = self.executor.compute_logits(h)
        if len(who) > h.shape[0]:
            logits = logits[torch.tensor([i for i, _ in who], device=logits.device)]
        bad = fail_nonfinite(self, logits, seqs.__getitem__, "logits")
        if bad:  # those requests are ended: sample the others only
            keep = [r for r in range(len(seqs)) if r not in bad]
            logits, seqs = logits[keep], [seqs[r] for r in keep]
        if self.structured is not None and seqs:  # the grammars' token masks, the whole batch at once
            logits, seqs = mask_batch(self, logits, seqs)
        tokens = self.sampler(logits, [s.seq_id for s in seqs], [s.sampling_params for s in seqs]) if seqs else []
        return seqs, tokens, "sampler"

    def _step_outputs(self, out: Any, inputs: Any, sampled: dict, now: float) -> list[RequestOutput]:
        """After update(): each sampled sequence's token times, the step counted and traced, and an
        output for every request that changed (a finished one retired)."""
        changed = _stamp_token_times([q for s in inputs.samplers for q in self._samples_of(s.seq)], sampled, now)
        self.num_steps += 1
        self.sharing.add(q.block_table.blocks for q in self.scheduler.running if q.block_table is not None)
        for group in self._beams.values():
            group.sharing.add(q.block_table.blocks for q in group.beams if q.block_table is not None)
        if self.trace is not None:
            self.trace.record(self.scheduler, out, now, route=self.last_route)
        outputs, seen = [], set()
        for seq in changed:
            req = self._request(seq)
            if req is None or req.seq.seq_id in seen:
                continue
            seen.add(req.seq.seq_id)
            outputs.append(self._output(req))
            if all(q.is_finished for q in req.samples):
                self._retire(req)
        return outputs

    def _samples_of(self, seq: Sequence) -> list:
        req = self._request(seq)
        return req.samples if req is not None and req.seq is seq else [seq]

    def _output(self, req: _Request) -> RequestOutput:
        return request_output(req, self.sampler, self.spec)

    def run(self, progress: bool = False, desc: str = "generating") -> dict[str, RequestOutput]:
        """Step until every request is done; return the final output of each, by request id."""
        done: dict[str, RequestOutput] = {}
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(self.requests) + len(self._pending), desc=desc, unit="req")
        while self.has_unfinished_requests():
            for o in self.step():
                if o.finished:
                    done[o.request_id] = o
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return done

    def stats(self) -> dict:
        """What the engine did so far, in numbers a person can read (see engine_stats.py)."""
        return engine_stats(self)


# -- inside a step: when tokens came -------------------------------





def _stamp_token_times(seqs: list[Sequence], sampled: dict, now: float) -> list[Sequence]:
    """The sequences of ``seqs`` that got tokens this step, with their token (and finish) times set."""
    changed = []
    for seq in seqs:
        if seq.seq_id not in sampled:
            continue
        if seq.first_token_time is None:
            seq.first_token_time = now
        seq.last_token_time = now
        if seq.is_finished and seq.finish_time is None:
            seq.finish_time = now
        changed.append(seq)
    return changed

def __getattr__(name: str) -> Any:
    """``from minipaged.engine import LLM``, as code written before the facade moved to llm.py
    does. Resolved when asked for: llm.py imports this module, so this one cannot import it."""
    if name == "LLM":
        return importlib.import_module(f"{__package__}.llm").LLM
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
