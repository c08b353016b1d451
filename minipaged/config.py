"""One engine configuration and one record of injected parts.

Owns the knobs: every setting the engine, ``bench.simulate``, the bench and the checks share
is a field of :class:`EngineConfig`, declared once here. The parts a learner can swap in are
the fields of :class:`Parts`. ``split_kwargs`` turns ``LLM(**kw)`` into the two, refusing an
unknown keyword with the nearest valid one.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass, field, fields, replace
from typing import Any


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
    # MKL-packed weights for full decode batches (max_num_seqs rows), fp32 on a CPU only.
    # None: on when MKL packing is there, no address-space limit is set (MKL reserves about 4x
    # the weights' bytes of address space, and touches about 1x) and the packed copy takes at
    # most a quarter of free memory; True: on, refused where it cannot be; False: off.
    packed_gemm: bool | None = None
    # Batches of at most model.llama.GGUF_MATMUL_MAX_ROWS rows (every decode step and prefill
    # chunk the engine makes) multiply straight from the GGUF file's quantized integers and
    # scales: the same fp32 weights, a fifth of the bytes read (model/gguf_blocks.py). None: on where the model keeps
    # them (load_model gives a GGUF model in fp32 on a CPU its blocks) and the C kernels build
    # (then packed_gemm=None does not pack: full decode batches use the blocks); True: on,
    # refused where it cannot be; False: off, every batch reads the fp32 copy.
    gguf_blocks: bool | None = None

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
        for name in ("enable_chunked_prefill", "record_trace"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.packed_gemm is not None and not isinstance(self.packed_gemm, bool):
            raise ValueError(f"packed_gemm must be True, False or None (on where it helps), got {self.packed_gemm!r}")
        if self.gguf_blocks is not None and not isinstance(self.gguf_blocks, bool):
            raise ValueError(f"gguf_blocks must be True, False or None (on where the model keeps them), got {self.gguf_blocks!r}")
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

    def resolved(self) -> "Parts":
        from .block_allocator import BlockAllocator
        from .block_table import BlockTable
        from .prefix_cache import PrefixCache
        from .scheduler import Scheduler

        return Parts(
            self.allocator_cls or BlockAllocator,
            self.block_table_cls or BlockTable,
            self.scheduler_cls or Scheduler,
            self.attention,
            self.prefix_cache_cls or PrefixCache,
        )


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
