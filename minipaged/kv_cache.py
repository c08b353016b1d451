"""The paged KV cache tensors and the write of new K/V through a slot mapping.

Owns the memory: per layer one K and one V tensor of shape
(num_blocks, block_size, num_kv_heads, head_dim). Which block belongs to whom is not
its business (see block_allocator.py and block_table.py).
"""
from __future__ import annotations

import torch

_DTYPE_BYTES = {torch.float32: 4, torch.float16: 2, torch.bfloat16: 2}


def dtype_bytes(dtype: torch.dtype) -> int:
    if dtype not in _DTYPE_BYTES:
        raise ValueError(f"unsupported KV dtype {dtype}; use one of {list(_DTYPE_BYTES)}")
    return _DTYPE_BYTES[dtype]


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype = torch.float32) -> int:
    """Bytes of K and V one token occupies across all layers: 2 * layers * kv_heads * head_dim * bytes."""
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes(dtype)


def num_blocks_for_budget(
    budget_bytes: int,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
) -> int:
    """How many whole blocks fit in ``budget_bytes`` of KV memory."""
    per_block = kv_bytes_per_token(num_layers, num_kv_heads, head_dim, dtype) * block_size
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
    """Store each new token's K and V at its slot (the reference; Triton has its own)."""
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
    ) -> None:
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.num_kv_heads, self.head_dim, self.dtype = num_kv_heads, head_dim, dtype
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        write_kv(self.k[layer], self.v[layer], k, v, slot_mapping)

    def __repr__(self) -> str:
        return (
            f"KVCache(layers={self.num_layers}, blocks={self.num_blocks}x{self.block_size}, "
            f"kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, {self.dtype}, {self.nbytes / 2**20:.1f} MiB)"
        )
