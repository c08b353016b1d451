"""The engine: one ``step()`` = schedule, run the model on the paged cache, sample, update.

Owns the loop and the glue (inputs for the model, outputs for the caller) and the promise
that one bad request cannot break it: every request is validated before it is queued, and
when anything raises inside a step, that step's requests finish with ``finish_reason="error"``,
their blocks are freed and the engine goes on serving the others. The memory policy lives in
the scheduler, the maths in the model and attention backends. Every part is injected (see
interfaces.py for the contracts), so a learner's allocator, block table, scheduler or attention
can replace ours.

    Scheduler.schedule()  -> who runs, how many new tokens each
    ModelRunner.prepare() -> flat input_ids, positions, slot_mapping, block_tables, context_lens
    model.forward()       -> per layer: write K/V through slot_mapping, paged attention
    Sampler               -> a token for each sequence whose prompt is fully computed
    Scheduler.update()    -> append tokens (the stop checker decides who is done), free blocks

The engine is single-threaded by design: a second thread that enters it while another is
inside gets a RuntimeError (``minipaged serve`` runs one engine loop that owns it).
"""
from __future__ import annotations

import collections
import itertools
import os
import threading
import time
import warnings
from dataclasses import dataclass, field, replace
from typing import Any, Iterator

import torch

from .cpu.executor import Plan, make_executor
from .config import CONFIG_FIELDS, PARTS_FIELDS, EngineConfig, Parts, split_kwargs
from .block_allocator import BlockAllocator
from .block_table import BlockTable
from .data import FinishReason, Sequence, SequenceStatus
from .detokenizer import StopChecker
from .interfaces import BlockPool, BlockTableProtocol, PrefixCacheProtocol, SchedulerProtocol
from .kv_cache import KVCache, available_memory_bytes, kv_bytes_per_token, plan_num_blocks
from .parts import check_part, declared_support, require_support
from .runner import ModelRunner
from .prefix_cache import PrefixCache
from .sampling import Sampler, SamplingParams
from .scheduler import Scheduler


@dataclass
class CompletionOutput:
    """One sample of a request (vLLM's CompletionOutput): with ``SamplingParams(n=k)``, k of them."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    finished: bool
    delta_text: str = ""
    num_preemptions: int = 0


@dataclass
class RequestOutput:
    """What a caller gets back for one request (vLLM's RequestOutput, flattened).

    ``text`` is the whole answer so far (cut before a stop string); ``delta_text`` is what this
    output adds to the previous one of the same request (what a stream sends next).
    ``outputs`` holds every sample (one, unless ``SamplingParams.n > 1``), in sample order;
    ``text``, ``token_ids``, ``delta_text`` and ``finish_reason`` are sample 0's, so code written
    for one sample keeps working, and ``finished`` is True once every sample is done.
    """

    request_id: str
    prompt: Any
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length", "abort", "rejected", "error", or None while running
    finished: bool
    error: str | None = None  # why a request was rejected, or what raised in its step
    num_preemptions: int = 0
    metrics: dict = field(default_factory=dict)  # arrival, first_token and finish times (s)
    delta_text: str = ""
    outputs: list = field(default_factory=list)  # a CompletionOutput per sample, sample 0 first

    def __repr__(self) -> str:
        text = self.text if len(self.text) < 60 else self.text[:57] + "..."
        return f"RequestOutput(id={self.request_id!r}, finish={self.finish_reason}, tokens={len(self.token_ids)}, text={text!r})"


@dataclass
class _Request:
    seq: Sequence
    prompt: Any
    samples: list = field(default_factory=list)  # every sequence of the request (n), sample 0 first

    def __post_init__(self) -> None:
        if not self.samples:
            self.samples = [self.seq] + list(self.seq.forks)

    @property
    def params(self) -> SamplingParams:
        """The request's SamplingParams, as its sequence holds them (their one owner in the engine)."""
        return self.seq.sampling_params


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
    from .parts import declared_support

    if setting is None:
        return "prefix_caching" in declared_support(scheduler_cls, "schedule")
    if not isinstance(setting, bool):
        raise ValueError(f"enable_prefix_caching must be True, False or None (on when the scheduler supports it), got {setting!r}")
    if setting:
        require_support(scheduler_cls, "schedule", "prefix_caching", "enable_prefix_caching=True", "scheduler")
    return setting


class _Guard:
    """Refuses a second thread while one is inside the engine (re-entry by the same thread is fine)."""

    def __init__(self) -> None:
        self._lock = threading.RLock()

    def __enter__(self) -> None:
        if not self._lock.acquire(blocking=False):
            raise RuntimeError(
                "LLMEngine is single-threaded: another thread is inside it right now. Call it from one "
                "thread (an engine loop that owns it, as `minipaged serve` does), or give each thread its own engine."
            )

    def __exit__(self, *exc: Any) -> None:
        self._lock.release()


def _is_token_list(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def _is_chat(x: Any) -> bool:
    return isinstance(x, list) and bool(x) and all(isinstance(m, dict) and "role" in m for m in x)


class LLMEngine:
    """``add_request`` / ``step`` / ``abort_request`` / ``has_unfinished_requests``.

    ``config`` (EngineConfig) holds the settings and ``parts`` (Parts) the injected parts; plain
    keywords (``block_size=8``, ``scheduler_cls=MyScheduler``) are split between the two.
    Parts are checked against their Protocols here, and a setting a part does not declare it
    supports is refused here, not ignored later.
    """

    def __init__(self, model: torch.nn.Module, tokenizer: Any = None, config: EngineConfig | None = None,
                 parts: Parts | None = None, **kwargs: Any) -> None:
        if config is not None and not isinstance(config, EngineConfig):
            raise TypeError(f"config must be a minipaged.config.EngineConfig, got {type(config).__name__}")
        if kwargs:
            split_kwargs(kwargs)  # raises on an unknown key, naming the nearest
            config = (config or EngineConfig()).replace(**{k: v for k, v in kwargs.items() if k in CONFIG_FIELDS})
            parts = replace(parts or Parts(), **{k: v for k, v in kwargs.items() if k in PARTS_FIELDS})
        config = config or EngineConfig()
        parts = resolve_parts(parts or Parts())
        self.model = model.eval()
        self.tokenizer = tokenizer
        mcfg = model.config
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        positions = mcfg.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > positions:
            raise ValueError(
                f"max_model_len={config.max_model_len} is past the model's {positions} positions "
                f"({mcfg.name}): use max_model_len <= {positions}"
            )
        config = config.replace(max_model_len=config.max_model_len or positions,
                                enable_prefix_caching=resolve_prefix_caching(config.enable_prefix_caching, parts.scheduler_cls))
        kv_heads = mcfg.num_kv_heads  # each rank's share of them, with tensor parallelism
        if config.tensor_parallel_size > 1:
            from .distributed import kv_heads_per_rank

            kv_heads = kv_heads_per_rank(mcfg.num_heads, mcfg.num_kv_heads, mcfg.intermediate_size,
                                         config.tensor_parallel_size)
        num_blocks = plan_num_blocks(config, mcfg.num_layers, kv_heads, mcfg.head_dim,
                                     config.max_model_len, self.dtype, self.device)
        self.config, self.parts = config, parts

        check_part(parts.allocator_cls, BlockPool, "allocator")
        check_part(parts.block_table_cls, BlockTableProtocol, "block table")
        check_part(parts.scheduler_cls, SchedulerProtocol, "scheduler")
        if not config.enable_chunked_prefill:
            require_support(parts.scheduler_cls, "schedule", "chunked_prefill_off", "enable_chunked_prefill=False", "scheduler")
        self.allocator = parts.allocator_cls(num_blocks, config.block_size)
        check_part(self.allocator, BlockPool, "allocator")
        if self.allocator.num_blocks != num_blocks or self.allocator.block_size != config.block_size:
            raise ValueError(
                f"your allocator {type(self.allocator).__name__}(num_blocks={num_blocks}, block_size={config.block_size}) "
                f"reports num_blocks={self.allocator.num_blocks}, block_size={self.allocator.block_size}: keep the ones it is given"
            )
        self.prefix_cache = None
        if config.enable_prefix_caching:
            # the cache is the pool the scheduler and block tables see (its free count includes cached
            # blocks nobody holds); the allocator it wraps stays at self.prefix_cache.pool
            check_part(parts.prefix_cache_cls, PrefixCacheProtocol, "prefix cache")
            self.prefix_cache = parts.prefix_cache_cls(self.allocator)
            check_part(self.prefix_cache, PrefixCacheProtocol, "prefix cache")
            self.allocator = self.prefix_cache
        check_part(parts.block_table_cls(self.allocator), BlockTableProtocol, "block table")
        self.scheduler = parts.scheduler_cls(self.allocator, parts.block_table_cls, config)
        check_part(self.scheduler, SchedulerProtocol, "scheduler")
        self.kv_cache = KVCache(mcfg.num_layers, num_blocks, config.block_size, kv_heads, mcfg.head_dim, self.dtype, self.device)
        # the one decision about speed: which implementation runs each stage (engine.plan), made
        # here, once, from the config; the executor owns every copy a fast path needs
        if config.tensor_parallel_size > 1:  # one scheduler here, the model's shards in N processes
            from .distributed import TensorParallelExecutor

            self.executor = TensorParallelExecutor(config, self.model, self.device, parts.attention, self.kv_cache)
        else:
            self.executor = make_executor(config, self.model, self.device, parts.attention, self.kv_cache)
        self.runner = ModelRunner(self.device)
        self.sampler = Sampler()
        self.requests: dict[str, _Request] = {}  # unfinished requests (finished ones are pruned)
        self._request_of: dict[str, str] = {}  # seq id of sample i >= 1 -> its request id
        self._ids = itertools.count()
        self._pending: list[RequestOutput] = []  # rejected / aborted / failed: reported by the next step()
        self._guard = _Guard()
        self._totals = dict(requests=0, rejected=0, errors=0, aborted=0, generated_tokens=0, prompt_tokens=0, preemptions=0)
        self._first_arrival: float | None = None
        self._last_finish = 0.0
        self.t0 = time.perf_counter()
        self.num_steps = 0
        self.last_route: str | None = None  # what the last step ran (see Executor.last_route)
        self.route_counts: collections.Counter = collections.Counter()  # steps per route
        self.trace = None
        if config.record_trace:
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

    def rebuild_executor(self) -> Plan:
        """After changing the model's weights or modules: plan again and drop every copy the old
        plan made (GGUF blocks that no longer match are refused, packs remade). The KV cache and
        the requests stay; cached prefixes computed with the old weights are not reused wrongly
        only if you also reset the prefix cache."""
        with self._guard:
            if self.config.tensor_parallel_size > 1:
                raise NotImplementedError("with tensor_parallel_size > 1, build a new engine after changing the weights")
            self.executor = make_executor(self.config, self.model, self.device, self.parts.attention, self.kv_cache)
            return self.executor.plan

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
        return kv_bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, self.dtype)

    # -- requests --------------------------------------------------------------------------
    def encode_prompt(self, prompt: Any) -> list[int]:
        """One prompt -> token ids. The forms (and nothing else):

        - a string: a text prompt, tokenized as it is;
        - ``{"prompt": "..."}``: the same, as a dict;
        - ``{"prompt_token_ids": [int, ...]}`` or a list of ints: token ids, used as they are;
        - a list of chat messages (``{"role": ..., "content": ...}`` dicts): rendered with the
          model's chat template, with the assistant's turn opened.
        """
        vocab = self.model.config.vocab_size
        if isinstance(prompt, str):
            self._need_tokenizer("a text prompt")
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            keys = set(prompt)
            if keys == {"prompt_token_ids"}:
                ids = prompt["prompt_token_ids"]
                if not _is_token_list(ids):
                    raise TypeError(f"prompt_token_ids must be a list of ints, got {type(ids).__name__}: {str(ids)[:60]}")
                return self._check_ids(ids, vocab)
            if keys == {"prompt"}:
                if not isinstance(prompt["prompt"], str):
                    raise TypeError(f"{{'prompt': ...}} takes a string, got {type(prompt['prompt']).__name__}")
                return self.encode_prompt(prompt["prompt"])
            if "role" in keys:
                raise TypeError("one chat message is not a prompt: give the conversation as a list of messages")
            raise TypeError(
                f"a prompt dict takes exactly one key, 'prompt' or 'prompt_token_ids'; got keys {sorted(map(str, keys))}"
            )
        if _is_token_list(prompt):
            return self._check_ids(prompt, vocab)
        if _is_chat(prompt):
            self._need_tokenizer("chat messages")
            for m in prompt:
                if set(m) - {"role", "content", "name"} or not isinstance(m.get("content"), str) or not isinstance(m.get("role"), str):
                    raise ValueError(f"a chat message is {{'role': str, 'content': str}}, got {m!r}")
            return self.tokenizer.encode(self.tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True))
        hint = ""
        if isinstance(prompt, (bytes, bytearray)):
            hint = ": decode bytes to a str first"
        elif isinstance(prompt, torch.Tensor):
            hint = ": pass tensor.tolist() for token ids"
        elif isinstance(prompt, tuple):
            hint = ": pass a list"
        raise TypeError(
            f"a prompt must be a string, {{'prompt_token_ids': [...]}}, a list of token ids or a list of chat "
            f"messages; got {type(prompt).__name__}{hint}"
        )

    @staticmethod
    def _check_ids(ids: list[int], vocab: int) -> list[int]:
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token ids must be in 0..{vocab - 1}; got {bad[:5]}")
        return list(ids)

    def _need_tokenizer(self, what: str) -> None:
        if self.tokenizer is None:
            raise ValueError(f"this engine has no tokenizer, so it cannot take {what}: pass token ids instead")

    def new_request_id(self) -> str:
        rid = str(next(self._ids))
        while rid in self.requests:
            rid = str(next(self._ids))
        return rid

    def add_request(self, prompt: Any, sampling_params: SamplingParams | None = None, request_id: str | None = None) -> str:
        """Queue a request and return its id.

        Everything is checked here, before anything is queued: bad input raises ValueError or
        TypeError and leaves the engine as it was. A request that can never fit in the KV pool is
        rejected instead (its output, from the next ``step()``, says why) and the engine goes on.
        """
        with self._guard:
            params = SamplingParams() if sampling_params is None else sampling_params
            if not isinstance(params, SamplingParams):
                raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
            params.validate()  # the fields may have been changed since it was made
            vocab = self.model.config.vocab_size
            bad = [t for t in params.stop_token_ids if t >= vocab]
            if bad:
                raise ValueError(f"stop_token_ids must be in 0..{vocab - 1}; got {bad[:5]}")
            if params.stop and self.tokenizer is None:
                raise ValueError("stop strings need a tokenizer, and this engine has none: use stop_token_ids")
            if request_id is None:
                request_id = self.new_request_id()
            elif isinstance(request_id, bool) or not isinstance(request_id, (str, int)) or str(request_id) == "":
                raise TypeError(f"request_id must be a non-empty string, got {request_id!r}")
            request_id = str(request_id)
            if request_id in self.requests:
                raise ValueError(f"request id {request_id!r} is already in use by an unfinished request")
            token_ids = self.encode_prompt(prompt)
            if params.n > 1 and "parallel_sampling" not in declared_support(type(self.scheduler), "schedule"):
                raise ValueError(
                    f"SamplingParams(n={params.n}) needs a scheduler whose schedule() gives every sample a seat, and "
                    f"{type(self.scheduler).__name__}.schedule does not declare it (supports = {{'parallel_sampling'}}): "
                    "send n separate requests instead (seeds seed, seed + 1, ...), or use minipaged's Scheduler"
                )
            source = self.tokenizer if self.tokenizer is not None else self.model.config
            eos = tuple(getattr(source, "eos_token_ids", ()) or ())
            arrival = time.perf_counter() - self.t0
            samples = []  # sample 0 is the request's sequence; n > 1: samples 1..n-1 are forked from it
            for i in range(params.n):
                q = Sequence.for_request(request_id if i == 0 else f"{request_id}#{i}", token_ids, params, eos)
                q.stop_checker = StopChecker.for_sequence(q, params.stop, self.config.max_model_len, self.tokenizer)
                q.arrival_time = arrival
                samples.append(q)
            # parallel sampling: samples 1..n-1 wait in seq.forks until the prompt is computed once
            seq = samples[0]
            seq.forks = samples[1:]
            req = _Request(seq, prompt)
            if self._first_arrival is None:
                self._first_arrival = seq.arrival_time
            self._totals["requests"] += 1
            self._totals["prompt_tokens"] += len(token_ids)
            if not self.scheduler.add_request(seq):
                if seq.status is not SequenceStatus.REJECTED or seq.seq_id in {s.seq_id for s in self.scheduler.waiting}:
                    raise RuntimeError(f"{type(self.scheduler).__name__}.add_request returned False but queued {seq}")
                seq.finish_time = seq.arrival_time
                self._totals["rejected"] += 1
                for f in req.samples[1:]:
                    f.finish_time = seq.finish_time
                seq.forks = []
                self._pending.append(self._output(seq, req))
                return request_id
            self.requests[request_id] = req
            for i, q in enumerate(req.samples):  # sample i draws from seed + i: reproducible alone or in a batch
                self.sampler.add(q.seq_id, params if params.seed is None or i == 0 else replace(params, seed=params.seed + i))
                if i:
                    self._request_of[q.seq_id] = request_id
            return request_id

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
        seq = req.seq
        for q in req.samples:  # every sample of the request that is still going
            if q.is_finished and q is not seq:
                continue
            try:
                self.scheduler.finish(q, reason)
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
            q.finish_time = time.perf_counter() - self.t0
        self._totals["aborted" if reason is FinishReason.ABORT else "errors"] += 1
        self._retire(req)
        self._pending.append(self._output(seq, req))

    def _retire(self, req: _Request) -> None:
        self.requests.pop(req.seq.seq_id, None)
        for q in req.samples:
            self._request_of.pop(q.seq_id, None)
            self.sampler.remove(q.seq_id)
            self._totals["generated_tokens"] += len(q.output_token_ids)
            self._totals["preemptions"] += q.num_preemptions
            self._last_finish = max(self._last_finish, q.finish_time or 0.0)

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
        are freed, and the engine keeps serving the others.
        """
        with self._guard:
            outputs, self._pending = self._pending, []
            if not self.requests:
                return outputs
            out = None
            try:
                out = self.scheduler.schedule()
                if out.is_empty:
                    if not outputs:
                        raise RuntimeError(
                            "the scheduler scheduled nothing although requests are waiting: "
                            f"{len(self.scheduler.waiting)} waiting, {len(self.scheduler.running)} running, "
                            f"{self.allocator.num_free_blocks} free blocks. A scheduler must make progress every step."
                        )
                    return outputs
                if out.blocks_to_copy:  # copy-on-write, before this step writes K/V
                    self.executor.copy_blocks(out.blocks_to_copy)
                inputs = self.runner.prepare(out)
                hidden = self.executor.forward(inputs.input_ids, inputs.positions, inputs.meta)
                sampled: dict = {}
                if inputs.samplers:
                    h = hidden[inputs.sample_rows]
                    # a prompt computed for n samples: its one row of logits gives every sample's first token
                    who = [(i, q) for i, s in enumerate(inputs.samplers) for q in [s.seq] + list(s.seq.forks)]
                    seqs = [q for _, q in who]
                    tokens = None
                    next_route = "sampler"
                    if (len(who) == len(inputs.samplers) and type(self.sampler) is Sampler
                            and all(q.sampling_params.greedy for q in seqs)):
                        # every row greedy: the argmax straight from the head, where the plan allows
                        tokens = self.executor.greedy_tokens(h)
                        next_route = "head_argmax" if tokens is not None else next_route
                    if tokens is None:
                        logits = self.executor.compute_logits(h)
                        if len(who) > len(inputs.samplers):
                            logits = logits[torch.tensor([i for i, _ in who], device=logits.device)]
                        tokens = self.sampler(logits, [s.seq_id for s in seqs], [s.sampling_params for s in seqs])
                    sampled = {s.seq_id: t for s, t in zip(seqs, tokens)}
                    self.last_route = f"{self.executor.last_route}+{next_route}"
                else:
                    self.last_route = f"{self.executor.last_route}+none"
                self.route_counts[self.last_route] += 1
                now = time.perf_counter() - self.t0
                self.scheduler.update(out, sampled)
            except Exception as e:
                return outputs + self._fail_step(out, e)
            changed = []
            for seq in [q for s in inputs.samplers for q in [s.seq] + [f for f in self._samples_of(s.seq)[1:]]]:
                if seq.seq_id not in sampled:
                    continue
                if seq.first_token_time is None:
                    seq.first_token_time = now
                if seq.is_finished and seq.finish_time is None:
                    seq.finish_time = now
                changed.append(seq)
            self.num_steps += 1
            if self.trace is not None:
                self.trace.record(self.scheduler, out, now, route=self.last_route)
            seen: set[str] = set()
            for seq in changed:
                req = self._request(seq)
                if req is None or req.seq.seq_id in seen:
                    continue
                seen.add(req.seq.seq_id)
                outputs.append(self._output(req.seq, req))
                if all(q.is_finished for q in req.samples):
                    self._retire(req)
            return outputs

    def _samples_of(self, seq: Sequence) -> list:
        req = self._request(seq)
        return req.samples if req is not None and req.seq is seq else [seq]

    def _fail_step(self, out: Any, error: Exception) -> list[RequestOutput]:
        """Finish the requests of a step that raised with finish_reason "error"; keep the rest."""
        where = "the scheduler" if out is None else "the step"
        msg = f"{where} raised {type(error).__name__}: {error}"
        if out is None:  # schedule() itself raised: the sequences it was working on are suspect
            seqs = list(self.scheduler.running) + [s for s in self.scheduler.waiting if s.block_table is not None]
        elif out.is_empty:  # no progress is possible: end everything rather than spin
            seqs = list(self.scheduler.running) + list(self.scheduler.waiting)
        else:
            seqs = [s.seq for s in out.scheduled]
        for seq in seqs:
            req = self._request(seq)
            if req is not None and req.seq.seq_id in self.requests:
                self._end(req, FinishReason.ERROR, msg)
        if not seqs:  # nothing to blame: surface the error rather than spin
            raise error
        warnings.warn(f"minipaged: {len(seqs)} request(s) failed: {msg}", stacklevel=3)
        failed, self._pending = self._pending, []
        return failed

    def _output(self, seq: Sequence, req: _Request) -> RequestOutput:
        outs = []
        for i, q in enumerate(req.samples):
            checker = q.stop_checker
            reason = q.finish_reason.value if q.finish_reason is not None and q.is_finished else None
            outs.append(CompletionOutput(i, checker.text if checker is not None else "", list(q.output_token_ids), reason,
                                         q.is_finished, checker.pop_delta() if checker is not None else "", q.num_preemptions))
        done = all(o.finished for o in outs)
        firsts = [q.first_token_time for q in req.samples if q.first_token_time is not None]
        ends = [q.finish_time for q in req.samples if q.finish_time is not None]
        return RequestOutput(
            request_id=seq.seq_id,
            prompt=req.prompt,
            prompt_token_ids=list(seq.prompt_token_ids),
            text=outs[0].text,
            token_ids=outs[0].token_ids,
            finish_reason=outs[0].finish_reason if done else None,
            finished=done,
            error=seq.reject_reason,
            num_preemptions=sum(o.num_preemptions for o in outs),
            metrics={"arrival_time": seq.arrival_time, "first_token_time": min(firsts) if firsts else None,
                     "finish_time": max(ends) if done and ends else None},
            delta_text=outs[0].delta_text,
            outputs=outs,
        )

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
        """What the engine did so far, in numbers a person can read."""
        t = self._totals
        gen = t["generated_tokens"] + sum(len(q.output_token_ids) for r in self.requests.values() for q in r.samples)
        wall = self._last_finish - self._first_arrival if self._first_arrival is not None else 0.0
        info = {
            "requests": t["requests"],
            "rejected": t["rejected"],
            "errors": t["errors"],
            "aborted": t["aborted"],
            "generated_tokens": gen,
            "prompt_tokens": t["prompt_tokens"],
            "seconds": wall,
            "output_tokens_per_s": t["generated_tokens"] / wall if wall > 0 else 0.0,
            "steps": self.num_steps,
            "num_blocks": self.allocator.num_blocks,
            "block_size": self.block_size,
            "kv_cache_mib": self.kv_cache.nbytes / 2**20,
            "plan": self.plan.as_dict(),
            "routes": dict(self.route_counts),  # steps per route ("whole_step+head_argmax", "layers+sampler", ...)
            "preemptions": t["preemptions"] + sum(q.num_preemptions for r in self.requests.values() for q in r.samples),
        }
        if self.prefix_cache is not None:
            ps = getattr(self.scheduler, "prefix_stats", None)
            info.update(prefix_hit_rate=ps.hit_rate if ps else None, prefix_hit_tokens=ps.hit_tokens if ps else None,
                        cached_blocks=self.prefix_cache.num_cached_blocks, evictions=self.prefix_cache.num_evictions)
        if self.trace is not None and self.trace.steps:
            info.update(
                peak_blocks_used=self.trace.peak_blocks_used,
                peak_concurrency=self.trace.peak_concurrency,
                kv_waste=self.trace.kv_waste(),
            )
        return info


class LLM:
    """The facade vLLM users know: ``LLM(model=...).generate(prompts, sampling_params)``.

    ``model`` is None (the default SmolLM2-135M-Instruct), a path (a GGUF file or a local
    Hugging Face folder), or an already built model (then pass ``tokenizer`` too). A loaded
    model goes to ``device`` (default: CUDA when present, else the CPU) in ``dtype``.
    Every other keyword is an EngineConfig setting (``block_size``, ``kv_cache_bytes``, ...) or
    a part (``allocator_cls``, ``block_table_cls``, ``scheduler_cls``, ``attention``); an unknown
    one is a TypeError naming the nearest valid one.
    """

    def __init__(self, model: Any = None, tokenizer: Any = None, device: str | torch.device | None = None,
                 dtype: torch.dtype = torch.float32, **kwargs: Any) -> None:
        config, parts = split_kwargs(kwargs)  # before loading anything: a typo costs no load time
        if model is None or isinstance(model, (str, os.PathLike)):
            from .model import load_model

            # A GPU when there is one (Colab's GPU runtime), else the CPU; fp32 unless asked.
            device = device or ("cuda" if torch.cuda.is_available() else "cpu")
            t = time.perf_counter()
            model, loaded_tok = load_model(model, dtype=dtype, device=device)
            self.load_seconds = time.perf_counter() - t
            tokenizer = tokenizer or loaded_tok
        self.engine = LLMEngine(model, tokenizer, config, parts)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @staticmethod
    def _as_prompt_list(prompts: Any) -> list:
        """``generate``'s input: one prompt (see LLMEngine.encode_prompt) or a list of prompts."""
        if isinstance(prompts, (str, dict)) or _is_token_list(prompts) and prompts or _is_chat(prompts):
            return [prompts]
        if isinstance(prompts, list):
            if not prompts:
                return []
            if any(isinstance(p, int) and not isinstance(p, bool) for p in prompts):
                raise TypeError(
                    "a list that mixes token ids with other things: give one prompt's token ids as a list of ints, "
                    "or many prompts as a list of prompts"
                )
            return list(prompts)
        hint = {bytes: "decode it to a str", bytearray: "decode it to a str", tuple: "pass a list"}.get(type(prompts), "")
        if isinstance(prompts, torch.Tensor):
            hint = "pass tensor.tolist() (one row of token ids per prompt)"
        raise TypeError(
            f"generate() takes a prompt (a string, {{'prompt_token_ids': [...]}}, token ids, chat messages) or a "
            f"list of prompts; got {type(prompts).__name__}{': ' + hint if hint else ''}"
        )

    def generate(self, prompts: Any, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Serve all ``prompts`` together (continuous batching); outputs in the prompts' order.

        A prompt that is invalid or can never fit is not fatal: its output has
        ``finish_reason="rejected"``, its own request id, and ``error`` says why; the others are served.
        """
        prompts = self._as_prompt_list(prompts)
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(prompts):
                raise ValueError(f"{len(sampling_params)} sampling params for {len(prompts)} prompts: give one, or one per prompt")
            params = list(sampling_params)
        else:
            params = [sampling_params or SamplingParams()] * len(prompts)
        eng = self.engine
        ids: list[str | RequestOutput] = []
        for prompt, p in zip(prompts, params):
            rid = eng.new_request_id()
            try:
                ids.append(eng.add_request(prompt, p, request_id=rid))
            except (ValueError, TypeError) as e:
                warnings.warn(f"request {rid} rejected: {e}", stacklevel=2)
                ids.append(RequestOutput(rid, prompt, [], "", [], "rejected", True, error=str(e)))
        done = eng.run(progress=use_tqdm)
        results = []
        for rid in ids:
            o = rid if isinstance(rid, RequestOutput) else done[rid]
            if o.finish_reason in ("rejected", "error") and not isinstance(rid, RequestOutput):
                warnings.warn(f"request {o.request_id} {o.finish_reason}: {o.error}", stacklevel=2)
            results.append(o)
        return results

    def chat(self, messages: Any, sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = False) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"} dicts) or a list of conversations."""
        if _is_chat(messages):
            messages = [messages]
        if not isinstance(messages, list) or not all(_is_chat(m) for m in messages):
            raise TypeError("chat() takes a conversation (a list of {'role', 'content'} dicts) or a list of conversations")
        return self.generate(messages, sampling_params, use_tqdm=use_tqdm)

    def stream(self, prompt: Any, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Yield the answer's text piece by piece as tokens come (other requests may run too).

        Closing the generator early (``break``, ``close()``, or dropping it) aborts the request
        and frees its blocks. A stop string never appears in the pieces.
        """
        eng = self.engine
        rid = eng.add_request(prompt, sampling_params)
        finished = False
        try:
            while True:
                outs = eng.step()
                for o in outs:
                    if o.request_id != rid:
                        continue
                    if o.finish_reason in ("rejected", "error"):
                        finished = True
                        raise ValueError(f"request {o.finish_reason}: {o.error}")
                    if o.delta_text:
                        yield o.delta_text
                    if o.finished:
                        finished = True
                        return
                if not eng.has_unfinished_requests():
                    return
        finally:
            if not finished:
                eng.abort_request(rid)


