"""One engine configuration and one record of injected parts.

Owns the knobs: every setting the engine, ``bench.simulate``, the bench and the checks share
is a field of :class:`EngineConfig`, declared once here. The parts a learner can swap in are
the fields of :class:`Parts`. ``split_kwargs`` turns ``LLM(**kw)`` into the two, refusing an
unknown keyword with the nearest valid one.
"""
from __future__ import annotations

import difflib
import os
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal, get_args

# kv_cache_dtype's names, as vLLM spells them (minipaged/kv_quant.py implements them)
KVCacheDtype = Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8"]
KV_CACHE_DTYPES: tuple[str, ...] = get_args(KVCacheDtype)


def check_kv_cache_dtype(name: object) -> str:
    """``name`` as given, or a ValueError listing the valid names."""
    if not isinstance(name, str) or name not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown kv_cache_dtype {name!r}: use one of {', '.join(KV_CACHE_DTYPES)}")
    return name


def _env_on(name: str) -> bool:
    """An environment variable only sets a default: unset or anything but 0/false/no/off is on."""
    return os.environ.get(name, "1").strip().lower() not in ("0", "false", "no", "off")


FAST_PATH_FIELDS = ("c_kernels", "gguf_blocks", "packed_gemm", "whole_step_decode", "greedy_from_head", "prefill_as_decodes")


@dataclass(frozen=True)
class EngineConfig:
    """The engine's settings. ``num_blocks`` wins over ``kv_cache_bytes``; with neither, the
    KV budget is a modest slice of memory (see ``minipaged.kv_cache.plan_num_blocks``)."""

    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_bytes: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    enable_chunked_prefill: bool = True
    # None: on when the scheduler's schedule() declares "prefix_caching" (minipaged's does);
    # True: on, refused for a scheduler that does not declare it; False: off
    enable_prefix_caching: bool | None = None
    record_trace: bool = True
    # Tensor parallelism (minipaged/distributed.py): the model's heads and MLP columns split over
    # this many processes joined by torch.distributed; one scheduler on the driver.
    tensor_parallel_size: int = 1
    # What the KV pages store, as vLLM spells it (minipaged/kv_quant.py): "auto" (the model's dtype:
    # fp32 on a CPU), "fp8" (= "fp8_e4m3") and "fp8_e5m2" (torch's float8, one scale per layer for K
    # and one for V), "int8" (one scale per (block, KV head), stored beside the block). Any other
    # name is a ValueError; a dtype that cannot run here is refused by the plan, with the reason.
    kv_cache_dtype: KVCacheDtype = "auto"
    # fp8 only: each layer's k_scale/v_scale from the first batch it stores (largest |value| / the
    # format's largest); False: 1.0.
    calculate_kv_scales: bool = False
    # -- speed: every fast path is chosen once, per engine, by minipaged/plan.py ----------------
    # The master switch. False: the plain PyTorch model and the chosen attention backend only
    # (the route the lessons teach). Default from $MINIPAGED_FAST_PATHS (0 turns it off).
    fast_paths: bool = field(default_factory=lambda: _env_on("MINIPAGED_FAST_PATHS"))
    # Each fast path below: None, on where it can be (the plan says why not elsewhere); True, on,
    # and the engine is refused where it cannot be; False, off.
    # The C kernels (minipaged/cpu/csrc), fp32 on a CPU. Default from $MINIPAGED_CPU_KERNELS.
    c_kernels: bool | None = field(default_factory=lambda: None if _env_on("MINIPAGED_CPU_KERNELS") else False)
    # Linear layers multiply straight from a GGUF file's Q4_0/Q4_1/Q8_0 blocks (the same fp32
    # weights rebuilt block by block, a fifth of the bytes read): models loaded from a GGUF file,
    # on a CPU with AVX-512.
    gguf_blocks: bool | None = None
    # MKL-packed weights for full decode batches (max_num_seqs rows), fp32 weights on a CPU; by
    # default only where the GGUF matmul does not serve and the copy fits.
    packed_gemm: bool | None = None
    # A step of decodes only runs every layer in one C call (needs the GGUF matmul on every layer,
    # the C element-wise ops and the C attention).
    whole_step_decode: bool | None = None
    # Greedy rows take their token straight from the LM head's GGUF matmul, without the logits.
    greedy_from_head: bool | None = None
    # With the C attention, a prefill chunk over a short context (<= 256) attends each new token
    # as one decode query, straight from the pages.
    prefill_as_decodes: bool | None = None
    # Speculative decoding, as vLLM spells it: {"method": "ngram", "num_speculative_tokens": k,
    # "prompt_lookup_max": n, "prompt_lookup_min": m} (minipaged/spec_decode.py; its values are
    # checked when the engine is built), or None: one token a step.
    speculative_config: dict | None = None
    # -- where KV lives besides the device pool (minipaged/kv_connector.py) ---------------------
    # A host-memory tier of this many GiB under the device pool (vLLM's --kv-offloading-size): full
    # blocks are saved there after the step that computed them, and a prefix that misses the device
    # pool but hits the host store is loaded back instead of recomputed. None: no host tier.
    kv_offloading_size: float | None = None
    # Prefill and decode on separate engines (minipaged/disagg.py), as vLLM spells it:
    # {"kv_connector": "TorchDistributedConnector", "kv_role": "kv_producer" | "kv_consumer" | "kv_both",
    #  "kv_ip": "127.0.0.1", "kv_port": 14579}. None: this engine prefills and decodes its own requests.
    kv_transfer_config: dict | None = None

    def __post_init__(self) -> None:
        def positive_int(name: str, value: Any, allow_none: bool = False) -> None:
            if value is None and allow_none:
                return
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")

        positive_int("block_size", self.block_size)
        if self.block_size > 256:
            raise ValueError(f"block_size must be in 1..256, got {self.block_size} (16 is the usual choice)")
        positive_int("num_blocks", self.num_blocks, allow_none=True)
        positive_int("kv_cache_bytes", self.kv_cache_bytes, allow_none=True)
        positive_int("max_num_seqs", self.max_num_seqs)
        positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        positive_int("max_model_len", self.max_model_len, allow_none=True)
        positive_int("tensor_parallel_size", self.tensor_parallel_size)
        check_kv_cache_dtype(self.kv_cache_dtype)
        for name in ("enable_chunked_prefill", "record_trace", "calculate_kv_scales"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if not isinstance(self.fast_paths, bool):
            raise ValueError(f"fast_paths must be True or False, got {self.fast_paths!r}")
        for name in FAST_PATH_FIELDS:
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"{name} must be True, False or None (on where it can be), got {value!r}")
        if self.speculative_config is not None and not isinstance(self.speculative_config, dict):
            raise ValueError(f"speculative_config must be a dict like {{'method': 'ngram', 'num_speculative_tokens': 3}} "
                             f"or None, got {type(self.speculative_config).__name__}")
        size = self.kv_offloading_size
        if size is not None and (isinstance(size, bool) or not isinstance(size, (int, float)) or not size > 0):
            raise ValueError(f"kv_offloading_size is the host KV store's size in GiB, a number > 0 (or None: no host "
                             f"tier), got {size!r}")
        if self.kv_transfer_config is not None and not isinstance(self.kv_transfer_config, dict):
            raise ValueError(f"kv_transfer_config must be a dict like {{'kv_connector': 'TorchDistributedConnector', "
                             f"'kv_role': 'kv_producer'}} or None, got {type(self.kv_transfer_config).__name__}")
        if self.kv_cache_dtype != "auto" and (self.kv_offloading_size is not None or self.kv_transfer_config is not None):
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} with a KV connector (kv_offloading_size or "
                             f"kv_transfer_config): the connectors copy pages without their 8-bit scales. Use one of "
                             f"them: kv_cache_dtype='auto' with the connector, or the 8-bit pages without it")
        if self.enable_prefix_caching is not None and not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be True, False or None (on when the scheduler supports it), "
                             f"got {self.enable_prefix_caching!r}")

    def replace(self, **changes: Any) -> "EngineConfig":
        return replace(self, **changes)


@dataclass(frozen=True)
class Parts:
    """The swappable parts (see minipaged.interfaces for each one's contract)."""

    allocator_cls: Any = None  # default: minipaged.BlockAllocator
    block_table_cls: Any = None  # default: minipaged.BlockTable
    scheduler_cls: Any = None  # default: minipaged.Scheduler
    attention: Any = "auto"  # "auto", "torch", "triton", "reference", or a paged_attention function
    prefix_cache_cls: Any = None  # default: minipaged.prefix_cache.PrefixCache (used when prefix caching is on)
    proposer: Any = None  # default: minipaged.spec_decode.propose_ngram (interfaces.ProposerFn; used when speculative_config is on)
    kv_connector: Any = None  # interfaces.KVConnector class; default: the host tier when kv_offloading_size is set, else none
    # how tables share blocks (interfaces.SharingFns; minipaged's scheduler and beam search call them):
    fork_table: Any = None  # default: minipaged.parts.fork_table (a beam or a sample forked from its parent)
    copy_on_write: Any = None  # default: minipaged.prefix_cache.copy_on_write (before a write into shared blocks)
    free_table: Any = None  # default: minipaged.parts.free_table (a beam that falls out of a beam search)
    # (None means minipaged's own part: the engine fills them in, minipaged.engine.resolve_parts)


CONFIG_FIELDS = tuple(f.name for f in fields(EngineConfig))
PARTS_FIELDS = tuple(f.name for f in fields(Parts))


def split_kwargs(kwargs: dict[str, Any], extra: tuple[str, ...] = ()) -> tuple[EngineConfig, Parts]:
    """``LLM(**kw)``'s keywords -> (EngineConfig, Parts). An unknown key raises TypeError naming the nearest."""
    valid = CONFIG_FIELDS + PARTS_FIELDS + tuple(extra)
    for key in kwargs:
        if key not in valid:
            near = difflib.get_close_matches(key, valid, n=1)
            hint = f" Did you mean {near[0]!r}?" if near else ""
            raise TypeError(f"unknown engine setting {key!r}.{hint} Valid settings: {', '.join(valid)}")
    cfg = EngineConfig(**{k: v for k, v in kwargs.items() if k in CONFIG_FIELDS})
    parts = Parts(**{k: v for k, v in kwargs.items() if k in PARTS_FIELDS})
    return cfg, parts


__all__ = ["EngineConfig", "Parts", "split_kwargs", "CONFIG_FIELDS", "PARTS_FIELDS"]
