"""The paged KV cache tensors and the write of new K/V through a slot mapping.

Owns the memory: per layer one K and one V tensor of shape
(num_blocks, block_size, num_kv_heads, head_dim). Which block belongs to whom is not
its business (see block_allocator.py and block_table.py).
"""
from __future__ import annotations

import os

import torch

from .parts import cdiv

_DTYPE_BYTES = {torch.float32: 4, torch.float16: 2, torch.bfloat16: 2}  # the model's dtypes (8-bit KV: kv_cache_dtype)


def dtype_bytes(dtype: torch.dtype) -> int:
    if dtype not in _DTYPE_BYTES:
        raise ValueError(f"unsupported KV dtype {dtype}; use one of {list(_DTYPE_BYTES)}")
    return _DTYPE_BYTES[dtype]


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype = torch.float32,
                       kv_cache_dtype: str = "auto") -> int:
    """Bytes of K and V one token occupies across all layers: 2 * layers * kv_heads * head_dim * bytes
    (bytes: the model's ``dtype``'s for ``kv_cache_dtype="auto"``, else 1; an int8 block's scales
    are counted per block, see :func:`kv_bytes_per_block`)."""
    nbytes = dtype_bytes(dtype) if kv_cache_dtype == "auto" else 1
    return 2 * num_layers * num_kv_heads * head_dim * nbytes


def kv_scale_bytes_per_block(num_layers: int, num_kv_heads: int, kv_cache_dtype: str = "auto") -> int:
    """Bytes of scales stored beside one block: int8 keeps one fp32 scale per (block, KV head) for
    K and for V in every layer; fp8's per-layer scales belong to no block (0)."""
    from .kv_quant import check_name

    return 2 * num_layers * num_kv_heads * 4 if check_name(kv_cache_dtype) == "int8" else 0


def kv_bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int = 16,
                       dtype: torch.dtype = torch.float32, kv_cache_dtype: str = "auto") -> int:
    """Bytes one block of ``block_size`` tokens takes in every layer, its scales included."""
    return (kv_bytes_per_token(num_layers, num_kv_heads, head_dim, dtype, kv_cache_dtype) * block_size
            + kv_scale_bytes_per_block(num_layers, num_kv_heads, kv_cache_dtype))


def num_blocks_for_budget(
    budget_bytes: int,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    kv_cache_dtype: str = "auto",
) -> int:
    """How many whole blocks fit in ``budget_bytes`` of KV memory (in ``kv_cache_dtype``)."""
    per_block = kv_bytes_per_block(num_layers, num_kv_heads, head_dim, block_size, dtype, kv_cache_dtype)
    n = int(budget_bytes) // per_block
    if n < 1:
        raise ValueError(
            f"a KV budget of {budget_bytes} bytes holds no block: one block of {block_size} tokens needs "
            f"{per_block} bytes for this model. Give a larger budget."
        )
    return n


def write_kv(
    k_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
    v_cache: torch.Tensor,
    k: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    v: torch.Tensor,
    slot_mapping: torch.Tensor,  # (num_tokens,) int: block_id * block_size + offset
) -> None:
    """Store each new token's K and V at its slot (the reference; Triton has its own). A quantized
    cache (``kv_cache_dtype``) is written through kv_quant.write, which quantizes."""
    if getattr(k_cache, "kv_format", None) is not None:
        from . import kv_quant

        kv_quant.write(k_cache, k, slot_mapping)
        kv_quant.write(v_cache, v, slot_mapping)
        return
    num_blocks, block_size, h, d = k_cache.shape
    # A flat view turns the slot straight into a row index; no per-block arithmetic needed.
    k_cache.view(num_blocks * block_size, h, d).index_copy_(0, slot_mapping.long(), k.to(k_cache.dtype))
    v_cache.view(num_blocks * block_size, h, d).index_copy_(0, slot_mapping.long(), v.to(v_cache.dtype))


class KVCache:
    """K and V for every layer, allocated once for the whole pool."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        kv_cache_dtype: str = "auto",
        calculate_kv_scales: bool = False,
    ) -> None:
        """``dtype``: the model's (what attention computes in); ``kv_cache_dtype``: what the pages
        store ("auto": ``dtype``; "fp8"/"fp8_e4m3"/"fp8_e5m2"/"int8": 8 bits with scales, see
        kv_quant.py). ``calculate_kv_scales``: fp8 layers set their scale from the first batch."""
        from . import kv_quant

        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.num_kv_heads, self.head_dim, self.dtype = num_kv_heads, head_dim, dtype
        self.kv_cache_dtype = kv_quant.check_name(kv_cache_dtype)
        self.format = kv_quant.resolve(kv_cache_dtype)
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        if self.format is None:
            self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
            self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        else:
            self.k = [kv_quant.new_cache(shape, self.format, device) for _ in range(num_layers)]
            self.v = [kv_quant.new_cache(shape, self.format, device) for _ in range(num_layers)]
            for t in self.k + self.v:
                if not self.format.per_block:
                    t.kv_calibrate = bool(calculate_kv_scales)

    @property
    def storage_dtype(self) -> torch.dtype:
        """What the pages hold: the model's dtype, or the quantized format's."""
        return self.dtype if self.format is None else self.format.storage

    @property
    def nbytes(self) -> int:
        """The pages' bytes, with the scales stored beside int8 blocks."""
        pages = sum(t.numel() * t.element_size() for t in self.k + self.v)
        if self.format is None or not self.format.per_block:
            return pages
        return pages + sum(t.kv_scales.numel() * 4 for t in self.k + self.v)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        write_kv(self.k[layer], self.v[layer], k, v, slot_mapping)

    def __repr__(self) -> str:
        return (
            f"KVCache(layers={self.num_layers}, blocks={self.num_blocks}x{self.block_size}, "
            f"kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"{self.dtype if self.format is None else self.format.name}, {self.nbytes / 2**20:.1f} MiB)"
        )


# -- sizing the pool from the configuration ----------------------------------------------
def available_memory_bytes(device: torch.device | str = "cpu") -> int:
    """Memory a new KV cache could take now: free GPU memory, or the OS's MemAvailable."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:  # macOS and other Unixes: physical memory (an upper bound)
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 8 * 2**30


def default_kv_budget(device: torch.device | str = "cpu") -> int:
    """A modest slice of memory: 30% of free GPU memory, or 10% of available RAM (at most 1 GiB) on CPU."""
    avail = available_memory_bytes(device)
    if torch.device(device).type == "cuda":
        return int(avail * 0.3)
    return min(int(avail * 0.10), 2**30)


def plan_num_blocks(config, num_layers: int, num_kv_heads: int, head_dim: int, max_model_len: int,
                    dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> int:
    """How many KV blocks the engine gets for ``config`` (an EngineConfig) and this model shape.

    ``num_blocks`` wins; else ``kv_cache_bytes``; else ``default_kv_budget``. The pool is capped
    at what ``max_num_seqs`` full-length sequences could ever use, and must fit in the memory
    available now: a budget larger than that is a ValueError, never an out-of-memory kill.
    """
    bs = config.block_size
    kv_dtype = getattr(config, "kv_cache_dtype", "auto")
    per_block = kv_bytes_per_block(num_layers, num_kv_heads, head_dim, bs, dtype, kv_dtype)
    avail = available_memory_bytes(device)
    if config.num_blocks is not None:
        n = config.num_blocks
        asked = n * per_block
        what = f"num_blocks={n} ({asked / 2**30:.2f} GiB of KV)"
    else:
        budget = config.kv_cache_bytes if config.kv_cache_bytes is not None else default_kv_budget(device)
        asked = budget
        what = f"kv_cache_bytes={budget} ({budget / 2**30:.2f} GiB)"
        n = num_blocks_for_budget(budget, num_layers, num_kv_heads, head_dim, bs, dtype, kv_dtype)
        n = min(n, config.max_num_seqs * cdiv(max_model_len, bs))  # more could never be used
    if asked > 0.9 * avail:
        raise ValueError(
            f"{what} is more than the memory available for it on {torch.device(device)}: "
            f"{avail / 2**30:.2f} GiB free now. Give a smaller kv_cache_bytes (or num_blocks); "
            f"one block of {bs} tokens takes {per_block} bytes for this model"
        )
    return n
