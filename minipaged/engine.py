"""The engine: one ``step()`` = schedule, run the model on the paged cache, sample, update.

Owns the loop and the glue (inputs for the model, outputs for the caller). The memory
policy lives in the scheduler, the maths in the model and attention backends. Every part
is injected, so a learner's allocator, block table, scheduler or attention can replace ours.

    Scheduler.schedule()  -> who runs, how many new tokens each
    ModelRunner.prepare() -> flat input_ids, positions, slot_mapping, block_tables, context_lens
    model.forward()       -> per layer: write K/V through slot_mapping, paged attention
    Sampler               -> a token for each sequence whose prompt is fully computed
    Scheduler.update()    -> append tokens, stop checks, free finished sequences' blocks
"""
from __future__ import annotations

import itertools
import os
import time
import warnings
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Iterator

import torch

from .attention import AttentionMetadata, get_backend
from .block_allocator import BlockAllocator
from .block_table import BlockTable
from .parts import declared_support
from .kv_cache import KVCache, kv_bytes_per_token, num_blocks_for_budget
from .sampling import Sampler, SamplingParams
from .scheduler import Scheduler, SchedulerOutput
from .sequence import FinishReason, Sequence, SequenceStatus


@dataclass
class CompletionOutput:
    """One sample of a request (vLLM's CompletionOutput): with ``SamplingParams(n=k)``, k of them."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    finished: bool
    num_preemptions: int = 0


@dataclass
class RequestOutput:
    """What a caller gets back for one request (vLLM's RequestOutput, flattened).

    ``outputs`` holds every sample (one, unless ``SamplingParams.n > 1``), in sample order.
    ``text``, ``token_ids`` and ``finish_reason`` are sample 0's, so code written for n=1
    keeps working; ``finished`` is True once every sample is done.
    """

    request_id: str
    prompt: Any
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length", "abort", "rejected", or None while running
    finished: bool
    error: str | None = None  # why a request was rejected
    num_preemptions: int = 0
    metrics: dict = field(default_factory=dict)  # arrival, first_token and finish times (s)
    outputs: list = field(default_factory=list)  # CompletionOutput per sample (n), sample 0 first

    def __repr__(self) -> str:
        text = self.text if len(self.text) < 60 else self.text[:57] + "..."
        return f"RequestOutput(id={self.request_id!r}, finish={self.finish_reason}, tokens={len(self.token_ids)}, text={text!r})"


def _total_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not Linux/macOS
        return 8 * 2**30


def default_kv_budget(device: torch.device) -> int:
    """A modest slice of memory: 30% of free GPU memory, or 10% of RAM (at most 1 GiB) on CPU."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.3)
    return min(int(_total_memory_bytes() * 0.10), 2**30)


class ModelRunner:
    """Turns a SchedulerOutput into the flat tensors one forward pass needs."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def prepare(self, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[torch.Tensor] = []
        context_lens: list[int] = []
        query_start_loc = [0]
        sample_rows: list[int] = []  # row of the last new token of every sequence that samples
        for s in out.scheduled:
            seq, a, n = s.seq, s.start, s.num_new_tokens
            input_ids.extend(seq.token_ids[a : a + n])
            positions.extend(range(a, a + n))
            slots.append(seq.block_table.slot_mapping(a, a + n))
            context_lens.append(a + n)
            query_start_loc.append(query_start_loc[-1] + n)
            if s.samples:
                sample_rows.append(query_start_loc[-1] - 1)
        width = max(len(s.seq.block_table.blocks) for s in out.scheduled)
        block_tables = torch.stack([s.seq.block_table.as_tensor(width) for s in out.scheduled])
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.cat(slots).to(dev),
            block_tables=block_tables.to(dev),
            context_lens=torch.tensor(context_lens, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=dev),
            max_query_len=max(s.num_new_tokens for s in out.scheduled),
            max_context_len=max(context_lens),
        )
        ids = torch.tensor(input_ids, dtype=torch.long, device=dev)
        pos = torch.tensor(positions, dtype=torch.long, device=dev)
        return ids, pos, meta, sample_rows


def resolve_prefix_caching(setting: bool | None, scheduler_cls: type) -> bool:
    """None (the default): on when the scheduler's ``schedule`` declares ``prefix_caching``
    (minipaged's does); True: on, refused for a scheduler that does not declare it; False: off."""
    from .parts import declared_support, require_support

    if setting is None:
        return "prefix_caching" in declared_support(scheduler_cls, "schedule")
    if not isinstance(setting, bool):
        raise ValueError(f"enable_prefix_caching must be True, False or None (on when the scheduler supports it), got {setting!r}")
    if setting:
        require_support(scheduler_cls, "schedule", "prefix_caching", "enable_prefix_caching=True", "scheduler")
    return setting


class LLMEngine:
    """``add_request`` / ``step`` / ``has_unfinished_requests``, for watching an engine work.

    Parts are injected: ``allocator_cls(num_blocks, block_size)``,
    ``block_table_cls(allocator)``, ``scheduler_cls(allocator, block_table_cls=..., ...)`` and
    ``attention`` ("auto", "torch", "triton", or your own paged_attention).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any = None,
        *,
        allocator_cls: type = BlockAllocator,
        block_table_cls: type = BlockTable,
        scheduler_cls: type = Scheduler,
        attention: Any = "auto",
        block_size: int = 16,
        num_blocks: int | None = None,
        kv_cache_bytes: int | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 512,
        max_model_len: int | None = None,
        enable_chunked_prefill: bool = True,
        enable_prefix_caching: bool | None = None,
        prefix_cache_cls: type | None = None,
        record_trace: bool = True,
    ) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        cfg = model.config
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.max_model_len = max_model_len or cfg.max_position_embeddings
        if num_blocks is None:
            budget = kv_cache_bytes if kv_cache_bytes is not None else default_kv_budget(self.device)
            num_blocks = num_blocks_for_budget(budget, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block_size, self.dtype)
            # No point reserving more than max_num_seqs full-length sequences could ever use.
            num_blocks = min(num_blocks, max_num_seqs * -(-self.max_model_len // block_size))
        self.block_size = block_size
        self.allocator = allocator_cls(num_blocks, block_size)
        self.prefix_cache = None
        self.enable_prefix_caching = resolve_prefix_caching(enable_prefix_caching, scheduler_cls)
        sched_kw = {}
        if self.enable_prefix_caching:
            from .prefix_cache import PrefixCache

            # the cache is the pool the scheduler and block tables see (its free count includes
            # cached blocks nobody holds); the allocator it wraps is self.prefix_cache.pool
            self.prefix_cache = (prefix_cache_cls or PrefixCache)(self.allocator)
            self.allocator = self.prefix_cache
            sched_kw["enable_prefix_caching"] = True
        self.scheduler = scheduler_cls(
            self.allocator,
            block_table_cls=block_table_cls,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=self.max_model_len,
            enable_chunked_prefill=enable_chunked_prefill,
            **sched_kw,
        )
        self.kv_cache = KVCache(cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, self.dtype, self.device)
        self.backend = get_backend(attention, self.device)
        self.runner = ModelRunner(self.device)
        self.sampler = Sampler()
        self.scale = cfg.head_dim**-0.5
        self.requests: dict[str, tuple[Sequence, SamplingParams, Any]] = {}
        self.samples: dict[str, list[Sequence]] = {}  # request id -> its sequences, sample 0 first
        self._request_of: dict[str, str] = {}  # seq id of sample i >= 1 -> its request id
        self._ids = itertools.count()
        self._rejected: list[Sequence] = []
        self.t0 = time.perf_counter()
        self.num_steps = 0
        self.trace = None
        if record_trace:
            from .trace import Trace

            self.trace = Trace()

    # -- requests --------------------------------------------------------------------------
    @property
    def kv_bytes_per_token(self) -> int:
        cfg = self.model.config
        return kv_bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, self.dtype)

    def encode_prompt(self, prompt: Any) -> list[int]:
        """A string, chat messages (list of {"role", "content"} dicts) or token ids -> token ids."""
        if isinstance(prompt, str):
            self._need_tokenizer("a text prompt")
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        if isinstance(prompt, (list, tuple)):
            if all(isinstance(m, dict) for m in prompt) and prompt:
                self._need_tokenizer("chat messages")
                for m in prompt:
                    if "role" not in m or "content" not in m:
                        raise ValueError(f"a chat message needs 'role' and 'content' keys, got {m!r}")
                return self.tokenizer.encode(self.tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True))
            if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                vocab = self.model.config.vocab_size
                bad = [t for t in prompt if not 0 <= t < vocab]
                if bad:
                    raise ValueError(f"token ids must be in 0..{vocab - 1}; got {bad[:5]}")
                return list(prompt)
        raise TypeError(
            f"a prompt must be a string, a list of chat messages or a list of token ids, got {type(prompt).__name__}"
        )

    def _need_tokenizer(self, what: str) -> None:
        if self.tokenizer is None:
            raise ValueError(f"this engine has no tokenizer, so it cannot take {what}: pass token ids instead")

    def add_request(self, prompt: Any, sampling_params: SamplingParams | None = None, request_id: str | None = None) -> str:
        """Queue a request and return its id. Invalid input raises; a request that can never
        fit in the KV pool is rejected (its output says why) and the engine goes on."""
        params = sampling_params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        token_ids = self.encode_prompt(prompt)
        if params.n > 1 and "parallel_sampling" not in declared_support(type(self.scheduler), "schedule"):
            raise ValueError(
                f"SamplingParams(n={params.n}) needs a scheduler whose schedule() gives a seat to every sample, and "
                f"{type(self.scheduler).__name__}.schedule does not declare it (supports = {{'parallel_sampling'}}): "
                "send n separate requests instead (seeds seed, seed + 1, ...), or use minipaged's Scheduler"
            )
        source = self.tokenizer if self.tokenizer is not None else self.model.config
        eos = tuple(getattr(source, "eos_token_ids", ()) or ())
        seq = Sequence(
            request_id,
            token_ids,
            max_tokens=params.max_tokens,
            eos_token_ids=eos,
            stop_token_ids=tuple(params.stop_token_ids),
            ignore_eos=params.ignore_eos,
            sampling_params=params,
        )
        seq.arrival_time = time.perf_counter() - self.t0
        # parallel sampling: samples 1..n-1 wait in seq.forks until the prompt is computed once
        for i in range(1, params.n):
            f = Sequence(f"{request_id}#{i}", token_ids, max_tokens=params.max_tokens, eos_token_ids=eos,
                         stop_token_ids=tuple(params.stop_token_ids), ignore_eos=params.ignore_eos, sampling_params=params)
            f.arrival_time = seq.arrival_time
            seq.forks.append(f)
        samples = [seq] + list(seq.forks)
        self.requests[request_id] = (seq, params, prompt)
        self.samples[request_id] = samples
        for f in samples[1:]:
            self._request_of[f.seq_id] = request_id
        if not self.scheduler.add_request(seq):
            seq.finish_time = seq.arrival_time
            for f in samples[1:]:
                f.status, f.finish_reason, f.reject_reason, f.finish_time = seq.status, seq.finish_reason, seq.reject_reason, seq.finish_time
            seq.forks = []
            self._rejected.append(seq)
        else:
            for i, f in enumerate(samples):  # sample i draws from seed + i: reproducible alone or in a batch
                self.sampler.add(f.seq_id, params if params.seed is None or i == 0 else replace(params, seed=params.seed + i))
        return request_id

    def abort_request(self, request_id: str) -> None:
        for seq in self.samples.get(str(request_id), []):
            self.scheduler.abort(seq.seq_id)
            self.sampler.remove(seq.seq_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._rejected)

    # -- one step --------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Run one engine step; return an output for every request that changed."""
        changed: list[Sequence] = self._rejected
        self._rejected = []
        out = self.scheduler.schedule()
        if out.is_empty:
            if self.scheduler.has_unfinished() and not changed:
                raise RuntimeError(
                    "the scheduler scheduled nothing although requests are waiting: "
                    f"{len(self.scheduler.waiting)} waiting, {len(self.scheduler.running)} running, "
                    f"{self.allocator.num_free_blocks} free blocks. A scheduler must make progress every step."
                )
            return self._outputs(changed)
        if getattr(out, "blocks_to_copy", None):
            from .prefix_cache import copy_blocks

            copy_blocks(self.kv_cache, out.blocks_to_copy)  # copy-on-write, before this step writes K/V
        ids, pos, meta, rows = self.runner.prepare(out)
        hidden = self.model(ids, pos, self.kv_cache, meta, self.backend)
        sampling = [s.seq for s in out.scheduled if s.samples]
        sampled: dict = {}
        if sampling:
            logits = self.model.compute_logits(hidden[rows])
            # a prompt computed for n samples: its one row of logits gives every sample's first token
            who = [(i, q) for i, s in enumerate(sampling) for q in [s] + list(s.forks)]
            rows_of = torch.tensor([i for i, _ in who], device=logits.device)
            tokens = self.sampler(logits[rows_of], [q.seq_id for _, q in who], [q.sampling_params for _, q in who])
            sampled = {q.seq_id: t for (_, q), t in zip(who, tokens)}
            sampling = [q for _, q in who]
        now = time.perf_counter() - self.t0
        self.scheduler.update(out, sampled)
        for seq in sampling:
            if seq.first_token_time is None:
                seq.first_token_time = now
            if not seq.is_finished and seq.sampling_params.stop and self._hit_stop_string(seq):
                self.scheduler.finish(seq, FinishReason.STOP)
            if seq.is_finished:
                seq.finish_time = now
                self.sampler.remove(seq.seq_id)
        self.num_steps += 1
        if self.trace is not None:
            self.trace.record(self.scheduler, out, now)
        return self._outputs(changed + sampling)

    def _outputs(self, seqs: list[Sequence]) -> list[RequestOutput]:
        """One output per request that changed, in the order its first sequence comes."""
        seen: dict[str, None] = {}
        for s in seqs:
            seen.setdefault(self._request_of.get(s.seq_id, s.seq_id), None)
        return [self._output(self.requests[rid][0]) for rid in seen]

    def _hit_stop_string(self, seq: Sequence) -> bool:
        if self.tokenizer is None:
            return False
        text = self.tokenizer.decode(seq.output_token_ids)
        return any(s in text for s in seq.sampling_params.stop)

    def _completion(self, index: int, seq: Sequence) -> CompletionOutput:
        text = ""
        if self.tokenizer is not None and seq.output_token_ids:
            text = self.tokenizer.decode(seq.output_token_ids)
            for s in seq.sampling_params.stop if seq.sampling_params else ():
                if s in text:
                    text = text[: text.index(s)]
        reason = seq.finish_reason.value if seq.finish_reason is not None and seq.is_finished else None
        return CompletionOutput(index, text, list(seq.output_token_ids), reason, seq.is_finished, seq.num_preemptions)

    def _output(self, seq: Sequence) -> RequestOutput:
        rid = seq.seq_id
        _, _, prompt = self.requests[rid]
        samples = self.samples.get(rid, [seq])
        outs = [self._completion(i, q) for i, q in enumerate(samples)]
        first = [q.first_token_time for q in samples if q.first_token_time is not None]
        ends = [q.finish_time for q in samples if q.finish_time is not None]
        done = all(o.finished for o in outs)
        return RequestOutput(
            request_id=rid,
            prompt=prompt,
            prompt_token_ids=list(seq.prompt_token_ids),
            text=outs[0].text,
            token_ids=outs[0].token_ids,
            finish_reason=outs[0].finish_reason if done else None,
            finished=done,
            error=seq.reject_reason,
            num_preemptions=sum(q.num_preemptions for q in samples),
            metrics={"arrival_time": seq.arrival_time, "first_token_time": min(first) if first else None,
                     "finish_time": max(ends) if done and ends else None},
            outputs=outs,
        )

    def run(self, progress: bool = False, desc: str = "generating") -> dict[str, RequestOutput]:
        """Step until every request is done; return the final output of each, by request id."""
        done: dict[str, RequestOutput] = {}
        total = sum(1 for s, _, _ in self.requests.values() if not s.is_finished) + len(self._rejected)
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=total, desc=desc, unit="req")
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
        seqs = [q for rid in self.requests for q in self.samples.get(rid, [self.requests[rid][0]])]
        gen = sum(len(s.output_token_ids) for s in seqs)
        wall = max((s.finish_time or 0.0) for s in seqs) - min((s.arrival_time or 0.0) for s in seqs) if seqs else 0.0
        info = {
            "requests": len(self.requests),
            "sequences": len(seqs),
            "rejected": sum(s.status is SequenceStatus.REJECTED for s, _, _ in self.requests.values()),
            "generated_tokens": gen,
            "prompt_tokens": sum(s.num_prompt_tokens for s, _, _ in self.requests.values()),
            "seconds": wall,
            "output_tokens_per_s": gen / wall if wall > 0 else 0.0,
            "steps": self.num_steps,
            "num_blocks": self.allocator.num_blocks,
            "block_size": self.block_size,
            "kv_cache_mib": self.kv_cache.nbytes / 2**20,
            "preemptions": sum(s.num_preemptions for s in seqs),
        }
        if self.prefix_cache is not None:
            ps = self.scheduler.prefix_stats
            info.update(prefix_hit_rate=ps.hit_rate, prefix_hit_tokens=ps.hit_tokens,
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
    Everything else goes to LLMEngine (block_size, kv_cache_bytes, attention, *_cls, ...).
    """

    def __init__(
        self,
        model: Any = None,
        tokenizer: Any = None,
        device: str | torch.device | None = None,
        dtype: torch.dtype = torch.float32,
        **engine_kwargs: Any,
    ) -> None:
        if model is None or isinstance(model, (str, os.PathLike)):
            from .model import load_model

            # A GPU when there is one (Colab's GPU runtime), else the CPU; fp32 unless asked.
            device = device or ("cuda" if torch.cuda.is_available() else "cpu")
            t = time.perf_counter()
            model, loaded_tok = load_model(model, dtype=dtype, device=device)
            self.load_seconds = time.perf_counter() - t
            tokenizer = tokenizer or loaded_tok
        self.engine_kwargs = engine_kwargs
        self.engine = LLMEngine(model, tokenizer, **engine_kwargs)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Any,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Serve all ``prompts`` together (continuous batching); outputs in the prompts' order.

        A prompt that is invalid or can never fit is not fatal: its output has
        ``finish_reason="rejected"`` and ``error`` says why, and the others are served.
        """
        single = isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and (isinstance(prompts[0], int) or isinstance(prompts[0], dict))
        )
        if single:
            prompts = [prompts]
        prompts = list(prompts)
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(prompts):
                raise ValueError(f"{len(sampling_params)} sampling params for {len(prompts)} prompts: give one, or one per prompt")
            params = list(sampling_params)
        else:
            params = [sampling_params or SamplingParams()] * len(prompts)
        eng = self.engine
        ids: list[str | RequestOutput] = []
        for prompt, p in zip(prompts, params):
            try:
                ids.append(eng.add_request(prompt, p))
            except (ValueError, TypeError) as e:
                warnings.warn(f"request rejected: {e}", stacklevel=2)
                ids.append(RequestOutput("-", prompt, [], "", [], "rejected", True, error=str(e)))
        done = eng.run(progress=use_tqdm)
        results = []
        for rid in ids:
            o = rid if isinstance(rid, RequestOutput) else done[rid]
            if o.finish_reason == "rejected" and o.error and not isinstance(rid, RequestOutput):
                warnings.warn(f"request {o.request_id} rejected: {o.error}", stacklevel=2)
            results.append(o)
        return results

    def chat(self, messages: Any, sampling_params: SamplingParams | list[SamplingParams] | None = None, use_tqdm: bool = False) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"} dicts) or a list of conversations."""
        if messages and isinstance(messages[0], dict):
            messages = [messages]
        return self.generate(list(messages), sampling_params, use_tqdm=use_tqdm)

    def stream(self, prompt: Any, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Yield the answer's text piece by piece as tokens come (other requests may run too)."""
        eng = self.engine
        rid = eng.add_request(prompt, sampling_params)
        shown = ""
        while True:
            outs = {o.request_id: o for o in eng.step()}
            o = outs.get(rid)
            if o is None:
                if not eng.has_unfinished_requests():
                    return
                continue
            if o.error:
                raise ValueError(f"request rejected: {o.error}")
            text = o.text
            # hold back a trailing partial UTF-8 character until its other bytes arrive
            safe = text[:-1] if text.endswith("\ufffd") and not o.finished else text
            if len(safe) > len(shown) and safe.startswith(shown):
                yield safe[len(shown):]
                shown = safe
            if o.finished:
                return


def generate_all(engine: LLMEngine, prompts: Iterable[Any], params: SamplingParams) -> list[RequestOutput]:
    """Convenience for notebooks: add every prompt to ``engine``, run to the end, keep the order."""
    ids = [engine.add_request(p, params) for p in prompts]
    done = engine.run()
    return [done[i] for i in ids]
