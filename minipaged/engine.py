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

import bisect
import collections
import itertools
import os
import threading
import time
import warnings
from dataclasses import dataclass, field, replace
from typing import Any, Iterator

import torch

from .executor import make_executor
from .plan import Plan
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
from .outputs import CompletionOutput, RequestMetrics, RequestOutput  # noqa: F401 - vLLM's output types, importable from here too
from .sampling import Sampler, SamplingParams, prompt_logprobs_of
from .scheduler import Scheduler
from .spec_decode import SpecDecoder, SpeculativeConfig


@dataclass
class _Request:
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


def _check_encodable(text: str, what: str) -> str:
    """``text`` if UTF-8 can encode it; else a ValueError naming the lone surrogate and its position
    (tokenizers say only "TextInputSequence must be str")."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"{what} holds a lone surrogate {ascii(text[e.start])[1:-1]} at position {e.start}, which no text encoding "
            "can carry (it usually comes from bytes decoded with errors='surrogateescape'): fix the string, e.g. "
            "text.encode('utf-8', 'replace').decode()"
        ) from None
    return text


def _is_token_list(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def _is_chat(x: Any) -> bool:
    return isinstance(x, list) and bool(x) and all(isinstance(m, dict) and "role" in m for m in x)


CHAT_OPTIONS = ("add_generation_prompt", "continue_final_message", "chat_template", "chat_template_kwargs")


def _is_chat_request(x: Any) -> bool:
    """``{"messages": [...], "add_generation_prompt": ..., "continue_final_message": ..., "chat_template": ...}``"""
    return isinstance(x, dict) and "messages" in x and set(x) <= {"messages", *CHAT_OPTIONS}


class _KeepSpecialTokens:
    """A tokenizer whose ``decode`` keeps special tokens (``SamplingParams(skip_special_tokens=False)``)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tok, name)


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
        spec = SpeculativeConfig.from_dict(config.speculative_config)  # a bad value is a clear error here
        if spec is not None:
            require_support(parts.scheduler_cls, "schedule", "speculative_decoding", "speculative_config", "scheduler")
            trunc = getattr(parts.block_table_cls, "truncate", None)
            if trunc is not None and not callable(trunc):  # the contract's optional member (interfaces.OPTIONAL_MEMBERS)
                raise TypeError(f"{parts.block_table_cls.__name__}.truncate is {type(trunc).__name__}, not a method: "
                                "speculative_config rolls rejected drafts back with truncate(num_tokens); define it "
                                "as a method, or remove it to let minipaged cut the table through its public members")
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
        self.executor = self._build_executor()
        self.runner = ModelRunner(self.device)
        self.sampler = Sampler()
        # speculative decoding: n-gram drafts, verified in the step's one forward pass (None: off)
        self.spec = (SpecDecoder(spec, config.max_model_len,
                                 disable_by_batch_size=self.executor.plan.speculative_batch_limit,
                                 proposer=parts.proposer)
                     if spec is not None else None)
        self.sampler.decode = self._decode_token if tokenizer is not None else None  # Logprob.decoded_token
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
            self.shutdown()  # tensor-parallel workers hold the old shards: they are replaced too
            self.executor = self._build_executor()
            return self.executor.plan

    def _build_executor(self):
        if self.config.tensor_parallel_size > 1:  # one scheduler here, the model's shards in N processes
            from .distributed import TensorParallelExecutor

            return TensorParallelExecutor(self.config, self.model, self.device, self.parts.attention, self.kv_cache)
        return make_executor(self.config, self.model, self.device, self.parts.attention, self.kv_cache)

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
        - a list of chat messages (``{"role": ..., "content": ...}`` dicts, the content a string or
          OpenAI's ``[{"type": "text", "text": ...}]`` parts): rendered with the model's chat
          template, with the assistant's turn opened;
        - ``{"messages": [...], "add_generation_prompt": bool, "continue_final_message": bool,
          "chat_template": str}``: the same, with vLLM's chat options (see ``render_chat``).
        """
        vocab = self.model.config.vocab_size
        if isinstance(prompt, str):
            self._need_tokenizer("a text prompt")
            return self.tokenizer.encode(_check_encodable(prompt, "the prompt"))
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
            if _is_chat_request(prompt):
                options = {k: prompt[k] for k in CHAT_OPTIONS if k in prompt}
                return self.tokenizer.encode(_check_encodable(self.render_chat(prompt["messages"], **options), "the chat"))
            if "role" in keys:
                raise TypeError("one chat message is not a prompt: give the conversation as a list of messages")
            raise TypeError(
                f"a prompt dict takes exactly one key, 'prompt' or 'prompt_token_ids'; got keys {sorted(map(str, keys))}"
            )
        if _is_token_list(prompt):
            return self._check_ids(prompt, vocab)
        if _is_chat(prompt):
            return self.tokenizer.encode(_check_encodable(self.render_chat(prompt), "the chat"))
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

    @staticmethod
    def _chat_messages(messages: Any) -> list[dict]:
        """Chat messages with their content as one string (OpenAI's text parts joined)."""
        if not _is_chat(messages):
            raise TypeError("a conversation is a non-empty list of {'role', 'content'} dicts")
        out = []
        for i, m in enumerate(messages):
            content = m.get("content")
            if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                                                 for p in content):
                content = "".join(p["text"] for p in content)
            if set(m) - {"role", "content", "name"} or not isinstance(content, str) or not isinstance(m.get("role"), str):
                raise ValueError(f"a chat message is {{'role': str, 'content': str or [{{'type': 'text', 'text': str}}, ...]}}, got {m!r}")
            _check_encodable(content, f"message {i}'s content")
            _check_encodable(m["role"], f"message {i}'s role")
            out.append({**m, "content": content})
        return out

    def render_chat(self, messages: Any, add_generation_prompt: bool = True, continue_final_message: bool = False,
                    chat_template: str | None = None, chat_template_kwargs: dict | None = None) -> str:
        """A conversation as prompt text, in the model's chat template (or ``chat_template``, a Jinja
        string), as vLLM's ``LLM.chat`` renders it: ``add_generation_prompt`` opens the assistant's
        turn; ``continue_final_message`` leaves the last (assistant) message open, to be continued;
        ``chat_template_kwargs`` are more variables for the template (e.g. ``enable_thinking``).
        A template that does not compile or render is a ValueError starting "chat_template:"."""
        self._need_tokenizer("chat messages")
        msgs = self._chat_messages(messages)
        if not isinstance(add_generation_prompt, bool) or not isinstance(continue_final_message, bool):
            raise TypeError("add_generation_prompt and continue_final_message are True or False")
        if continue_final_message and (add_generation_prompt or msgs[-1]["role"] != "assistant"):
            raise ValueError("continue_final_message=True needs add_generation_prompt=False and the assistant's message last")
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
            raise TypeError(f"chat_template_kwargs is a dict of template variables, got {type(chat_template_kwargs).__name__}")
        if chat_template is None and not chat_template_kwargs:
            text = self.tokenizer.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt)
        else:
            if chat_template is not None and not isinstance(chat_template, str):
                raise TypeError(f"chat_template is a Jinja template string, got {type(chat_template).__name__}")
            import jinja2

            from .model.tokenizer import _render_chat_template

            tok = self.tokenizer
            kwargs = dict(chat_template_kwargs or {})
            template = chat_template if chat_template is not None else kwargs.get("chat_template") or getattr(tok, "chat_template", None)
            if not isinstance(template, (str, type(None))):
                raise TypeError(f"chat_template is a Jinja template string, got {type(template).__name__}")
            if not template:
                raise ValueError("chat_template: the model has no chat template; pass one (a Jinja string)")
            # vLLM's order: the request's kwargs are applied over the standard variables
            context = dict(messages=msgs, add_generation_prompt=add_generation_prompt,
                           bos_token=getattr(tok, "bos_token", None) or "", eos_token=getattr(tok, "eos_token", None) or "")
            context.update({k: v for k, v in kwargs.items() if k not in ("chat_template", "messages")})
            try:
                text = _render_chat_template(template, **context)
            except Exception as e:  # noqa: BLE001 - a template is user content: whatever it raises is its fault
                where = f" (line {e.lineno})" if isinstance(e, jinja2.TemplateSyntaxError) and e.lineno else ""
                raise ValueError(f"chat_template: the chat template failed to render{where}: {type(e).__name__}: {e}") from None
            if not isinstance(text, str):
                raise ValueError("chat_template: the chat template did not render to text")
        if continue_final_message:
            last = msgs[-1]["content"]
            end = text.rfind(last)
            if end >= 0:
                text = text[: end + len(last)]
        return text

    def _prompt_text(self, prompt: Any) -> str | None:
        """``RequestOutput.prompt``: the prompt as text (a chat rendered); None for token ids, as in vLLM."""
        if isinstance(prompt, str):
            return prompt
        if isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
            return prompt["prompt"]
        try:
            if _is_chat(prompt):
                return self.render_chat(prompt)
            if _is_chat_request(prompt):
                return self.render_chat(prompt["messages"], **{k: prompt[k] for k in CHAT_OPTIONS if k in prompt})
        except (TypeError, ValueError):
            return None
        return None

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
        TypeError and leaves the engine as it was. A request that can never fit in the KV pool is
        rejected instead (its output, from the next ``step()``, says why) and the engine goes on.
        """
        request_id, prompt, sampling_params = self._request_args(args, request_id, prompt, params, sampling_params)
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
            for j, stop in enumerate([params.stop] if isinstance(params.stop, str) else params.stop or ()):
                _check_encodable(stop, f"stop string {j}")
            if params.n > self.config.max_num_seqs:  # before any sample is made: n=2**40 costs nothing
                raise ValueError(
                    f"SamplingParams(n={params.n}) asks for {params.n} samples, but max_num_seqs={self.config.max_num_seqs} "
                    f"sequences run at once: lower n to at most {self.config.max_num_seqs}, or raise max_num_seqs"
                )
            if request_id is None:
                request_id = self.new_request_id()
            elif isinstance(request_id, bool) or not isinstance(request_id, (str, int)) or str(request_id) == "":
                raise TypeError(f"request_id must be a non-empty string, got {request_id!r}")
            request_id = str(request_id)
            if request_id in self.requests:
                raise ValueError(f"request id {request_id!r} is already in use by an unfinished request")
            token_ids = self.encode_prompt(prompt)
            if params.max_tokens is None:  # to the context's end: this request's own copy says how far
                params = params.clone()
                params.max_tokens = params.max_tokens_for(len(token_ids), self.config.max_model_len)
            room = self.config.max_model_len - len(token_ids)  # <= 0: the scheduler rejects the prompt, saying why
            if 0 < room < params.max_tokens:
                if sampling_params is not None:
                    raise ValueError(
                        f"max_tokens={params.max_tokens} does not fit: the model's context is {self.config.max_model_len} "
                        f"tokens and the prompt has {len(token_ids)}, which leaves {room} (prompt + max_tokens = "
                        f"{len(token_ids) + params.max_tokens}): lower max_tokens to at most {room}, pass max_tokens=None "
                        "for the rest of the context, or shorten the prompt"
                    )
                params.max_tokens = room  # no params given: the default ends within the context
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
                tok = self.tokenizer if params.skip_special_tokens or self.tokenizer is None else _KeepSpecialTokens(self.tokenizer)
                q.stop_checker = StopChecker.for_sequence(q, params.stop, self.config.max_model_len, tok)
                q.arrival_time = arrival
                samples.append(q)
            # parallel sampling: samples 1..n-1 wait in seq.forks until the prompt is computed once
            seq = samples[0]
            seq.forks = samples[1:]
            req = _Request(seq, self._prompt_text(prompt))
            if params.prompt_logprobs is not None:
                req.prompt_logprobs = self._prompt_logprobs(token_ids, params.prompt_logprobs)
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
                self.sampler.add(q.seq_id, params if params.seed is None or i == 0 else replace(params, seed=params.seed + i), seq=q)
                if i:
                    self._request_of[q.seq_id] = request_id
            return request_id

    @staticmethod
    def _request_args(args: tuple, request_id: Any, prompt: Any, params: Any, sampling_params: Any) -> tuple:
        """(request_id, prompt, sampling_params) from either order of ``add_request``'s arguments."""
        if params is not None and sampling_params is not None:
            raise TypeError("add_request got both params and sampling_params: give one")
        sp = params if params is not None else sampling_params
        args = list(args)
        if len(args) > 3:
            raise TypeError(f"add_request takes (request_id, prompt, params) or (prompt, params), got {len(args)} arguments")
        old = (len(args) >= 2 and (args[1] is None or isinstance(args[1], SamplingParams))) or (len(args) == 1 and prompt is None)
        if old:  # (prompt, params, request_id)
            names = ["prompt", "sampling_params", "request_id"]
        else:  # vLLM's (request_id, prompt, params)
            names = ["request_id", "prompt", "sampling_params"]
        given = {"request_id": request_id, "prompt": prompt, "sampling_params": sp}
        for name, value in zip(names, args):
            if given[name] is not None:
                raise TypeError(f"add_request got {name} twice")
            given[name] = value
        if given["prompt"] is None:
            raise TypeError("add_request needs a prompt: add_request(request_id, prompt, params)")
        return given["request_id"], given["prompt"], given["sampling_params"]

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
            if self.spec is not None:
                self.spec.forget(q.seq_id)
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
                out = self.scheduler.schedule()
                if out.is_empty:
                    if not outputs:
                        raise RuntimeError(
                            "the scheduler scheduled nothing although requests are waiting: "
                            f"{len(self.scheduler.waiting)} waiting, {len(self.scheduler.running)} running, "
                            f"{self.allocator.num_free_blocks} free blocks. A scheduler must make progress every step."
                        )
                    return outputs
                for sch in out.scheduled:  # vLLM's metrics: first scheduled, and what the prefix cache gave
                    if getattr(sch.seq, "first_scheduled_time", None) is None:
                        sch.seq.first_scheduled_time = time.perf_counter() - self.t0
                        sch.seq.num_cached_tokens = sch.seq.num_computed_tokens
                if out.blocks_to_copy:  # copy-on-write, before this step writes K/V
                    self.executor.copy_blocks(out.blocks_to_copy)
                inputs = self.runner.prepare(out)
                hidden = self.executor.forward(inputs.input_ids, inputs.positions, inputs.meta)
                # a NaN or inf ends the requests whose rows hold it (prefill chunks too), before update()
                # could cache a block they wrote; the others go on
                self._fail_nonfinite_rows(hidden, inputs)
                live = [k for k, s in enumerate(inputs.samplers) if not s.seq.is_finished]
                samplers = [inputs.samplers[k] for k in live]
                sampled: dict = {}
                if samplers:
                    h = hidden[[inputs.sample_rows[k] for k in live]]
                    # a prompt computed for n samples: its one row of logits gives every sample's first token
                    who = [(i, q) for i, s in enumerate(samplers) for q in [s.seq] + list(s.seq.forks)]
                    seqs = [q for _, q in who]
                    tokens = None
                    next_route = "sampler"
                    if (len(who) == len(samplers) and type(self.sampler) is Sampler
                            and all(not q.sampling_params.needs_logits for q in seqs)):
                        # (a row that wants logprobs, penalties, a bias or min_tokens needs the logits)
                        # every row greedy: the argmax straight from the head, where the plan allows
                        tokens = self.executor.greedy_tokens(h)
                        next_route = "head_argmax" if tokens is not None else next_route
                    if tokens is None:
                        logits = self.executor.compute_logits(h)
                        if len(who) > len(samplers):
                            logits = logits[torch.tensor([i for i, _ in who], device=logits.device)]
                        bad = self._fail_nonfinite(logits, seqs.__getitem__, "logits")
                        if bad:  # those requests are ended: sample the others only
                            keep = [r for r in range(len(seqs)) if r not in bad]
                            logits, seqs = logits[keep], [seqs[r] for r in keep]
                        tokens = self.sampler(logits, [s.seq_id for s in seqs], [s.sampling_params for s in seqs]) if seqs else []
                    sampled = {s.seq_id: t for s, t in zip(seqs, tokens)}
                    if self.spec is not None:  # each verifying sequence's accepted run
                        sampled = self.spec.verify(inputs, hidden, sampled, self.executor.compute_logits, self.sampler)
                    self.last_route = f"{self.executor.last_route}+{next_route}"
                else:
                    self.last_route = f"{self.executor.last_route}+none"
                self.route_counts[self.last_route] += 1
                now = time.perf_counter() - self.t0
                self.scheduler.update(out, sampled)
                if self.spec is not None:  # drafts of sequences the budget left out this step go too
                    self.spec.clear(self.scheduler.running)
            except Exception as e:
                return outputs + self._fail_step(out, e)
            outputs += self._pending  # requests a non-finite value ended in this step
            self._pending = []
            changed = []
            for seq in [q for s in inputs.samplers for q in [s.seq] + [f for f in self._samples_of(s.seq)[1:]]]:
                if seq.seq_id not in sampled:
                    continue
                if seq.first_token_time is None:
                    seq.first_token_time = now
                seq.last_token_time = now
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

    def _fail_nonfinite_rows(self, hidden: torch.Tensor, inputs: Any) -> None:
        """End the requests whose rows of the step's hidden states hold NaN or inf."""
        qsl = inputs.meta.query_start_loc
        if hidden.dim() != 2 or hidden.shape[0] != int(qsl[-1]):
            return  # not one row per token: the logits check still guards the sampled rows
        starts = qsl.tolist()
        order = inputs.order

        def seq_of_row(r: int) -> Sequence:
            return order[bisect.bisect_right(starts, r) - 1].seq

        self._fail_nonfinite(hidden, seq_of_row, "hidden states (the last layer's output: attention or a layer after it made them)")

    def _fail_nonfinite(self, values: torch.Tensor, seq_of_row: Any, part: str) -> set[int]:
        """End, with finish_reason "error", every request with a row of ``values`` that holds NaN or
        inf (``seq_of_row(r)``: the sequence of row r), before update() could cache a block it wrote;
        its blocks are cleared, so a later owner never reads the NaN. Returns those rows."""
        ok = torch.isfinite(values).all(dim=-1)
        if bool(ok.all()):
            return set()
        bad_rows = (~ok).nonzero().flatten().tolist()
        by_request: dict[str, tuple[_Request, list[int]]] = {}
        for r in bad_rows:
            req = self._request(seq_of_row(r))
            if req is not None and req.seq.seq_id in self.requests:
                by_request.setdefault(req.seq.seq_id, (req, []))[1].append(r)
        step = self.num_steps + 1
        for req, rows in by_request.values():
            kind = "NaN" if bool(torch.isnan(values[rows]).any()) else "inf"
            msg = (f"step {step}: the {part} of this request hold {kind} ({len(rows)} row(s)), so its next token would "
                   "be garbage: the request was ended, and no block it wrote in this step was cached")
            self._scrub(req)
            self._end(req, FinishReason.ERROR, msg)
        if by_request:
            warnings.warn(f"minipaged: step {step}: {len(by_request)} request(s) failed: non-finite {part.split(' (')[0]}",
                          stacklevel=4)
        return set(bad_rows)

    def _scrub(self, req: _Request) -> None:
        """Zero the K/V of ``req``'s blocks that no other request can read (no cached block), so that
        what a failed step wrote there (a NaN) never reaches the block's next owner."""
        pc = self.prefix_cache
        is_cached = getattr(pc, "is_cached", lambda b: True) if pc is not None else (lambda b: False)
        blocks = {b for q in req.samples if q.block_table is not None for b in q.block_table.blocks if not is_cached(b)}
        k, v = getattr(self.kv_cache, "k", None), getattr(self.kv_cache, "v", None)
        if not blocks or not k or not v:
            return
        idx = torch.tensor(sorted(blocks), dtype=torch.long, device=k[0].device)
        for t in list(k) + list(v):
            t.index_fill_(0, idx, 0)

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
                self._scrub(req)  # whatever the step wrote before it raised never reaches a later owner
                self._end(req, FinishReason.ERROR, msg)
        if not seqs:  # nothing to blame: surface the error rather than spin
            raise error
        warnings.warn(f"minipaged: {len(seqs)} request(s) failed: {msg}", stacklevel=3)
        failed, self._pending = self._pending, []
        return failed

    @staticmethod
    def _stop_reason(q: Sequence) -> int | str | None:
        """vLLM's stop_reason: the stop token id or stop string that ended ``q`` (None for EOS,
        the length limit, or while it runs)."""
        if q.finish_reason is not FinishReason.STOP or not q.is_finished:
            return None
        params = q.sampling_params
        last = q.output_token_ids[-1] if q.output_token_ids else None
        if last is not None and last in params.stop_token_ids:
            return last
        checker = q.stop_checker
        detok = getattr(checker, "detok", None)
        if params.stop and detok is not None:
            rest = detok.text[len(checker.text):]
            hits = [s for s in params.stop if rest.startswith(s)]
            if hits:
                return max(hits, key=len)
        return None

    def _output(self, seq: Sequence, req: _Request) -> RequestOutput:
        outs = []
        for i, q in enumerate(req.samples):
            checker = q.stop_checker
            reason = q.finish_reason.value if q.finish_reason is not None and q.is_finished else None
            text = checker.text if checker is not None else ""
            delta = checker.pop_delta() if checker is not None else ""
            stop_reason = self._stop_reason(q)
            params = q.sampling_params
            if isinstance(stop_reason, str) and params is not None and params.include_stop_str_in_output:
                text += stop_reason
                if not getattr(q, "stop_str_sent", False):  # once, with the delta that ends the stream
                    delta += stop_reason
                    q.stop_str_sent = True
            logprobs = self.sampler.logprobs(q.seq_id)
            if logprobs is None:  # retired already (aborted, failed): the last ones it had
                logprobs = getattr(q, "last_logprobs", None)
            else:
                q.last_logprobs = logprobs
            cumulative = sum(next(iter(e.values())).logprob for e in logprobs) if logprobs is not None else None
            outs.append(CompletionOutput(i, text, list(q.output_token_ids), reason, q.is_finished, delta, q.num_preemptions,
                                         cumulative_logprob=cumulative, logprobs=logprobs, stop_reason=stop_reason))
        done = all(o.finished for o in outs)
        firsts = [q.first_token_time for q in req.samples if q.first_token_time is not None]
        lasts = [getattr(q, "last_token_time", None) for q in req.samples]
        ends = [q.finish_time for q in req.samples if q.finish_time is not None]
        metrics = RequestMetrics(
            arrival_time=seq.arrival_time, first_scheduled_time=getattr(seq, "first_scheduled_time", None),
            first_token_time=min(firsts) if firsts else None,
            last_token_time=max((t for t in lasts if t is not None), default=None),
            finished_time=max(ends) if done and ends else None,
            num_generation_tokens=sum(len(o.token_ids) for o in outs),
            spec_decode=self.spec.request_metrics([q.seq_id for q in req.samples]) if self.spec is not None else None,
        )
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
            metrics=metrics,
            delta_text=outs[0].delta_text,
            outputs=outs,
            prompt_logprobs=req.prompt_logprobs,
            num_cached_tokens=getattr(seq, "num_cached_tokens", None),
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
        if self.spec is not None:  # acceptance rate, mean acceptance length (vLLM's spec-decode counts)
            info["spec_decode"] = self.spec.as_dict()
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


class _Mailbox:
    """One engine's outputs, kept for their owners: each ``LLM.stream`` and ``generate`` call claims
    its request ids, and whoever steps the engine files every output under its request's id, so
    streams and calls read in any order each get exactly their own (an output nobody claimed, from
    a request added straight to the engine, is dropped as ``step()``'s caller would)."""

    def __init__(self, engine: "LLMEngine") -> None:
        self.engine = engine
        self.boxes: dict[str, list[RequestOutput]] = {}

    def claim(self, request_id: str) -> None:
        self.boxes.setdefault(request_id, [])

    def release(self, request_id: str) -> None:
        self.boxes.pop(request_id, None)

    def take(self, request_id: str) -> list[RequestOutput]:
        box = self.boxes.get(request_id)
        if not box:
            return []
        out = list(box)
        box.clear()
        return out

    def pump(self) -> None:
        """One engine step; its outputs go to their owners' boxes."""
        for o in self.engine.step():
            box = self.boxes.get(o.request_id)
            if box is not None:
                box.append(o)


def _mailbox(engine: "LLMEngine") -> _Mailbox:
    """The engine's mailbox (one per engine, however many LLM objects or calls use it). It lives on
    the engine, so it goes with it: no module-level registry keeps an engine alive."""
    box = engine.__dict__.get("_mailbox")
    if box is None:
        box = engine.__dict__["_mailbox"] = _Mailbox(engine)
    return box


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
                 dtype: torch.dtype | str = "auto", seed: int | None = None, **kwargs: Any) -> None:
        from .dtypes import resolve_dtype
        from .engine_args import NO_EFFECT, load_tokenizer

        for name in [k for k in kwargs if k in NO_EFFECT]:  # vLLM settings that mean nothing here
            value = kwargs.pop(name)
            if NO_EFFECT[name] and value not in NO_EFFECT[name]:
                raise ValueError(f"LLM({name}={value!r}) is unsupported by minipaged (no pipeline parallelism, no CUDA graphs); leave it out")
        config, parts = split_kwargs(kwargs)  # before loading anything: a typo costs no load time
        SpeculativeConfig.from_dict(config.speculative_config)  # so does a bad speculative_config
        dtype = resolve_dtype(dtype)  # vLLM's names ("float32", "half", "auto": float32) or a torch dtype
        if isinstance(tokenizer, (str, os.PathLike)):
            tokenizer = load_tokenizer(tokenizer)  # a local folder or GGUF file; a Hub name says so now
        if model is None or isinstance(model, (str, os.PathLike)):
            from .model import load_model

            # A GPU when there is one (Colab's GPU runtime), else the CPU; fp32 unless asked.
            device = device or ("cuda" if torch.cuda.is_available() else "cpu")
            t = time.perf_counter()
            model, loaded_tok = load_model(model, dtype=dtype, device=device)
            self.load_seconds = time.perf_counter() - t
            tokenizer = tokenizer or loaded_tok
        if seed is not None:  # vLLM's seed: unseeded sampled requests repeat from run to run
            torch.manual_seed(seed)
        self.engine = LLMEngine(model, tokenizer, config, parts)

    @property
    def llm_engine(self) -> "LLMEngine":
        """The engine (vLLM's name for it)."""
        return self.engine

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """The sampling parameters ``generate`` and ``chat`` use when given none (vLLM reads the
        model's generation_config.json; minipaged uses SamplingParams' own defaults)."""
        return SamplingParams()

    def reset_prefix_cache(self) -> bool:
        return self.engine.reset_prefix_cache()

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
            params = [sampling_params] * len(prompts)  # None: the engine's default, cut to fit the context
        eng = self.engine
        mail = _mailbox(eng)
        ids: list[str | RequestOutput] = []
        mine: list[str] = []
        done: dict[str, RequestOutput] = {}
        bar = None
        try:
            for prompt, p in zip(prompts, params):
                rid = eng.new_request_id()
                try:
                    ids.append(eng.add_request(prompt, p, request_id=rid))
                    mail.claim(rid)
                    mine.append(rid)
                except (ValueError, TypeError) as e:
                    warnings.warn(f"request {rid} rejected: {e}", stacklevel=2)
                    ids.append(RequestOutput(rid, eng._prompt_text(prompt), [], "", [], "rejected", True, error=str(e)))
            if use_tqdm:
                from tqdm.auto import tqdm

                bar = tqdm(total=len(mine), desc="generating", unit="req")
            # step until this call's requests are done; another stream's outputs wait in its box
            while len(done) < len(mine):
                for rid in mine:
                    for o in mail.take(rid):
                        if o.finished and rid not in done:
                            done[rid] = o
                            if bar is not None:
                                bar.update(1)
                if len(done) == len(mine):
                    break
                if not eng.has_unfinished_requests():
                    raise RuntimeError(f"the engine has no unfinished requests, but {len(mine) - len(done)} of this call's never finished")
                mail.pump()
        finally:
            if bar is not None:
                bar.close()
            for rid in mine:
                mail.release(rid)
                if rid not in done:  # interrupted (Ctrl-C, an error): do not leave them running unowned
                    eng.abort_request(rid)
        results = []
        for rid in ids:
            o = rid if isinstance(rid, RequestOutput) else done[rid]
            if o.finish_reason in ("rejected", "error") and not isinstance(rid, RequestOutput):
                warnings.warn(f"request {o.request_id} {o.finish_reason}: {o.error}", stacklevel=2)
            results.append(o)
        return results

    def chat(self, messages: Any, sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = False, chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, chat_template_content_format: str = "auto",
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"} dicts; the content a string or OpenAI's
        ``[{"type": "text", "text": ...}]`` parts) or a list of conversations, as vLLM's ``LLM.chat``:
        ``chat_template`` (a Jinja string) replaces the model's, ``add_generation_prompt`` opens the
        assistant's turn, ``continue_final_message`` continues the last (assistant) message,
        ``chat_template_kwargs`` are more variables for the template."""
        if _is_chat(messages):
            messages = [messages]
        if not isinstance(messages, list) or not all(_is_chat(m) for m in messages):
            raise TypeError("chat() takes a conversation (a list of {'role', 'content'} dicts) or a list of conversations")
        if chat_template_content_format not in ("auto", "string", "openai"):
            raise ValueError(f"chat_template_content_format is 'auto', 'string' or 'openai', got {chat_template_content_format!r}")
        options = {}
        if chat_template is not None:
            options["chat_template"] = chat_template
        if add_generation_prompt is not True:
            options["add_generation_prompt"] = add_generation_prompt
        if continue_final_message:
            options["continue_final_message"] = continue_final_message
        if chat_template_kwargs:
            options["chat_template_kwargs"] = chat_template_kwargs
        prompts = [{"messages": m, **options} for m in messages] if options else messages
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def stream(self, prompt: Any, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Yield the answer's text piece by piece as tokens come (other requests may run too).

        Closing the generator early (``break``, ``close()``, or dropping it) aborts the request
        and frees its blocks. A stop string never appears in the pieces.
        """
        eng = self.engine
        mail = _mailbox(eng)
        rid = eng.add_request(prompt, sampling_params)
        mail.claim(rid)
        finished = False
        try:
            while True:
                outs = mail.take(rid)  # its own outputs only: the others' wait in their boxes
                if not outs:  # (another caller may have stepped the engine meanwhile and filled the box)
                    if not eng.has_unfinished_requests():
                        return
                    mail.pump()
                    continue
                for o in outs:
                    if o.finish_reason in ("rejected", "error"):
                        finished = True
                        raise ValueError(f"request {o.finish_reason}: {o.error}")
                    if o.delta_text:
                        yield o.delta_text
                    if o.finished:
                        finished = True
                        return
        finally:
            mail.release(rid)
            if not finished:
                eng.abort_request(rid)


