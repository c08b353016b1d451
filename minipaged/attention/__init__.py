"""Paged-attention backends behind one signature, and the choice between them.

Every backend offers ``write_kv(k_cache, v_cache, k, v, slot_mapping)`` and
``paged_attention(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale, out=None)``
(see reference.py for the shapes). The engine calls nothing else.
"""
from __future__ import annotations

import importlib.util
import inspect
import os
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..kv_cache import write_kv as _torch_write_kv
from .reference import paged_attention as _reference_paged_attention
from .torch_sdpa import paged_attention as _torch_paged_attention


@dataclass(frozen=True)
class AttentionMetadata:
    """What one engine step tells every attention layer (the same for all layers), made once
    per step by the runner. Backends dispatch on these fields, never on tensor shapes."""

    slot_mapping: torch.Tensor  # (num_tokens,) int64: where each new token's K/V goes
    block_tables: torch.Tensor  # (num_seqs, max_blocks) int32
    context_lens: torch.Tensor  # (num_seqs,) int32: tokens each sequence attends to after this step
    query_start_loc: torch.Tensor  # (num_seqs + 1,) int32: cumulative new-token counts
    num_decodes: int = 0  # the first num_decodes sequences have exactly one new token each


@dataclass(frozen=True)
class AttentionBackend:
    """``write_kv`` stores new K/V; ``forward`` attends, given the step's metadata.

    ``paged_attention`` has the reference signature (interfaces.PagedAttentionFn). A backend
    whose function takes ``num_decodes=`` gets it, so it can batch the decode sequences at once.
    """

    name: str
    write_kv: Callable[..., Any]
    paged_attention: Callable[..., Any]
    takes_num_decodes: bool = False

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
        args = (q, k_cache, v_cache, meta.block_tables, meta.context_lens, meta.query_start_loc, scale)
        if self.takes_num_decodes:
            return self.paged_attention(*args, out=out, num_decodes=meta.num_decodes)
        result = self.paged_attention(*args, out)
        if not isinstance(result, torch.Tensor) or result.shape != q.shape:
            got = tuple(result.shape) if isinstance(result, torch.Tensor) else type(result).__name__
            raise ValueError(
                f"attention {self.name!r} returned {got}; a paged_attention function must return a tensor "
                f"shaped like q {tuple(q.shape)} (num_tokens, num_heads, head_dim)"
            )
        return result


def _takes_num_decodes(fn: Callable[..., Any]) -> bool:
    try:
        return "num_decodes" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


_PARAMS = ("q", "k_cache", "v_cache", "block_tables", "context_lens", "query_start_loc", "scale")


def check_attention_fn(fn: Any) -> None:
    """Refuse, when the engine is built, a function that cannot take the reference's arguments."""
    if not callable(fn):
        raise TypeError(f"attention must be a paged_attention function, got {type(fn).__name__}")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # a builtin or C function: trust it
    try:
        sig.bind(*_PARAMS, None)
    except TypeError:
        raise TypeError(
            f"your attention function {getattr(fn, '__name__', fn)!r}{sig} cannot be called as "
            f"paged_attention({', '.join(_PARAMS)}, out=None): give it exactly these parameters, in this order"
        ) from None


# "torch": the serving path (fused SDPA); "reference": the oracle, explicit maths, slower.
TORCH = AttentionBackend("torch", _torch_write_kv, _torch_paged_attention, _takes_num_decodes(_torch_paged_attention))
REFERENCE = AttentionBackend("reference", _torch_write_kv, _reference_paged_attention)
_announced = False


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def _load_triton() -> AttentionBackend:
    global _announced
    if not triton_available():
        hint = (
            "Triton has no build for macOS or Windows; use attention='torch' (or 'auto') there."
            if sys.platform != "linux"
            else "install it with: pip install triton"
        )
        raise ImportError(f"attention='triton' needs the triton package, which is not installed: {hint}")
    if not torch.cuda.is_available():
        # The interpreter must be on before any @triton.jit kernel is defined.
        if os.environ.get("TRITON_INTERPRET") != "1":
            if "minipaged.attention.triton_paged" in sys.modules:
                raise RuntimeError(
                    "the Triton kernels were already compiled for a GPU, but no GPU is present; "
                    "set TRITON_INTERPRET=1 before importing minipaged"
                )
            os.environ["TRITON_INTERPRET"] = "1"
        if not _announced:
            warnings.warn(
                "minipaged: no CUDA GPU found, so the Triton kernels run in Triton's interpreter on the CPU "
                "(TRITON_INTERPRET=1): correct but slow, for learning and tests.",
                stacklevel=3,
            )
            _announced = True
    from . import triton_paged

    return AttentionBackend("triton", triton_paged.write_kv, triton_paged.paged_attention, _takes_num_decodes(triton_paged.paged_attention))


def get_backend(attention: "str | AttentionBackend | Any" = "auto", device: "torch.device | str | None" = None) -> AttentionBackend:
    """``"auto"`` (Triton on a CUDA GPU, else PyTorch), ``"torch"``, ``"triton"``, ``"reference"``
    (the explicit oracle of reference.py), or your own.

    ``device`` is where the model and cache live: "auto" picks Triton only for CUDA tensors.

    Your own backend is any object with ``paged_attention`` (and optionally ``write_kv``)
    attributes, or a bare ``paged_attention`` function with the reference's signature.
    """
    if isinstance(attention, AttentionBackend):
        return attention
    if isinstance(attention, str):
        if attention == "torch":
            return TORCH
        if attention == "reference":
            return REFERENCE
        if attention == "triton":
            return _load_triton()
        if attention == "auto":
            on_gpu = torch.cuda.is_available() if device is None else torch.device(device).type == "cuda"
            if on_gpu and triton_available():
                return _load_triton()
            return TORCH
        raise ValueError(
            f"unknown attention backend {attention!r}: use 'auto', 'torch', 'triton', 'reference' or your own function"
        )
    if callable(attention) and not hasattr(attention, "paged_attention"):
        check_attention_fn(attention)
        return AttentionBackend(getattr(attention, "__name__", "custom"), _torch_write_kv, attention)
    if hasattr(attention, "paged_attention"):
        check_attention_fn(attention.paged_attention)
        return AttentionBackend(
            getattr(attention, "name", type(attention).__name__),
            getattr(attention, "write_kv", _torch_write_kv),
            attention.paged_attention,
        )
    raise TypeError(f"attention must be a name or an object with paged_attention, got {type(attention).__name__}")


__all__ = ["AttentionMetadata", "AttentionBackend", "get_backend", "check_attention_fn", "triton_available", "TORCH", "REFERENCE"]
