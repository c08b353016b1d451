"""KV cache quantization: K and V stored in 8 bits, with the scales that turn them back.

Owns the formats ``kv_cache_dtype`` names (vLLM's spelling), the quantizing write, and the one
dequantizing read every attention backend calls. Which blocks belong to whom is not its business.

==========  ======================  ==============  ===========================================
name        stored as               largest value   scale
==========  ======================  ==============  ===========================================
auto        the model's dtype       -               none (fp32 on a CPU, the weights' on a GPU)
fp8         = fp8_e4m3              -               -
fp8_e4m3    torch.float8_e4m3fn     448             one per layer for K, one for V (vLLM's
fp8_e5m2    torch.float8_e5m2       57344           ``k_scale``/``v_scale``): 1.0, or calibrated
                                                    on the first batch (``calculate_kv_scales``)
int8        torch.int8              127             one per (block, KV head), beside the block
==========  ======================  ==============  ===========================================

A stored value ``q`` means ``q * scale``. The scales ride on the cache tensors themselves (the
attributes ``kv_format`` and ``kv_scales``, read with :func:`kv_format` / :func:`kv_scales`), so
every op that is handed one layer's ``k_cache`` is handed its scales with it. ``kv_scales(cache)``
is always (num_blocks, num_kv_heads) fp32: an int8 cache's own table, or, for fp8, the layer's one
scale seen through ``expand`` (no copy), so one read serves both: ``blocks * scales[block, head]``.

An int8 block's scale only grows: a new token larger than ``127 * scale`` raises the scale of
its (block, head) and the rows already there are re-rounded to it. A write at row 0 of a block
starts the block afresh (its old scale, from an earlier owner, is dropped). Bad input never
poisons a block: NaN is stored as 0 and +-inf clipped to the format's range (int8: fp16's, 65504;
fp8: its largest value times the layer's scale), so every scale stays finite (the request whose
token held them then fails on its non-finite hidden state and its blocks are scrubbed, see
step_faults.fail_nonfinite), and a scale of zero, NaN or inf is refused where it is set.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import KV_CACHE_DTYPES
from .config import check_kv_cache_dtype as check_name
INT8_RANGE = 65504.0  # int8 pages hold what a 16-bit cache would: |x| beyond fp16's largest is clipped
ALIASES = {"fp8": "fp8_e4m3"}


@dataclass(frozen=True)
class KVFormat:
    """One quantized KV format: what the pages store, its largest value, and what a scale covers."""

    name: str  # fp8_e4m3, fp8_e5m2 or int8
    storage: torch.dtype
    qmax: float  # the largest magnitude it stores
    per_block: bool  # True: one scale per (block, KV head); False: one per layer (K and V each)

    @property
    def element_bytes(self) -> int:
        return 1

    @property
    def scale_granularity(self) -> str:
        return "one scale per (block, KV head)" if self.per_block else "one scale per layer for K and one for V"


def _formats() -> dict[str, KVFormat]:
    out = {"int8": KVFormat("int8", torch.int8, 127.0, True)}
    if hasattr(torch, "float8_e4m3fn"):
        out["fp8_e4m3"] = KVFormat("fp8_e4m3", torch.float8_e4m3fn, float(torch.finfo(torch.float8_e4m3fn).max), False)
    if hasattr(torch, "float8_e5m2"):
        out["fp8_e5m2"] = KVFormat("fp8_e5m2", torch.float8_e5m2, float(torch.finfo(torch.float8_e5m2).max), False)
    return out


FORMATS = _formats()


def unavailable(name: str) -> str | None:
    """Why ``name`` cannot run with this torch (None: it can)."""
    name = ALIASES.get(check_name(name), name)
    if name != "auto" and name not in FORMATS:
        return f"this torch ({torch.__version__}) has no torch.{'float8_e4m3fn' if name == 'fp8_e4m3' else 'float8_e5m2'}"
    return None


def resolve(name: str) -> KVFormat | None:
    """The format ``kv_cache_dtype`` names (None for auto: the pages hold the model's dtype);
    a ValueError with the reason where this torch cannot store it (never a silent fallback)."""
    why = unavailable(name)
    if why is not None:
        raise ValueError(f"kv_cache_dtype={name!r} cannot run: {why}; use kv_cache_dtype='auto' or 'int8'")
    return None if name == "auto" else FORMATS[ALIASES.get(name, name)]


# -- the scales, on the cache tensors --------------------------------------------------------
def kv_format(cache: torch.Tensor) -> KVFormat | None:
    """The format of one layer's K or V pages (None: unquantized)."""
    return getattr(cache, "kv_format", None)


def kv_scales(cache: torch.Tensor) -> torch.Tensor | None:
    """(num_blocks, num_kv_heads) fp32: the scale of each (block, KV head) of a quantized layer cache
    (a per-layer scale is the same number everywhere); None for an unquantized one."""
    return getattr(cache, "kv_scales", None)


def new_cache(shape: tuple[int, int, int, int], fmt: KVFormat, device: torch.device | str = "cpu") -> torch.Tensor:
    """Empty pages of ``fmt`` with their scales attached: per block 0 (nothing written yet),
    per layer 1.0 (and pending calibration until :func:`set_layer_scale` or the first write)."""
    cache = torch.zeros(shape, dtype=fmt.storage, device=device)
    cache.kv_format = fmt
    if fmt.per_block:
        cache.kv_scales = torch.zeros(shape[0], shape[2], dtype=torch.float32, device=device)
    else:
        cache.kv_layer_scale = torch.ones(1, 1, dtype=torch.float32, device=device)
        cache.kv_scales = cache.kv_layer_scale.expand(shape[0], shape[2])
        cache.kv_calibrate = False
    return cache


def set_layer_scale(cache: torch.Tensor, scale: float) -> None:
    """Set an fp8 layer's scale (vLLM's ``k_scale``/``v_scale``). Zero, negative, NaN or inf is a
    ValueError: such a scale would turn every value of the layer into 0, inf or NaN."""
    fmt = kv_format(cache)
    if fmt is None or fmt.per_block:
        raise ValueError("set_layer_scale is for an fp8 layer cache (int8 keeps one scale per block, set as it is written)")
    s = float(scale)
    if not (s > 0 and s != float("inf")):
        raise ValueError(f"a KV scale must be a finite number > 0, got {scale!r}: a scale of 0, NaN or inf "
                         "would poison every block of the layer; leave it at 1.0 or calibrate (calculate_kv_scales=True)")
    cache.kv_layer_scale.fill_(s)
    cache.kv_calibrate = False


def calibration_scale(x: torch.Tensor, qmax: float) -> float:
    """The scale that maps the largest finite magnitude of ``x`` to ``qmax``; 1.0 when there is
    none (an all-zero or non-finite batch must not set a zero or NaN scale)."""
    finite = x[torch.isfinite(x)]
    amax = float(finite.abs().max()) if finite.numel() else 0.0
    return amax / qmax if amax > 0 else 1.0


# -- the write: quantize -----------------------------------------------------------------------
def _clean(x: torch.Tensor, clip: float = float("inf")) -> torch.Tensor:
    """fp32, NaN as 0 (a NaN stored in a page would poison every read of its block), clipped to +-clip."""
    return torch.nan_to_num(x.float(), nan=0.0, posinf=clip, neginf=-clip).clamp(-clip, clip)


def quantize(x: torch.Tensor, scale: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """``x / scale``, NaN as 0, clipped to the format's range, rounded to ``fmt.storage``.
    A zero scale (an int8 block of zeros) stores 0."""
    x = _clean(x)
    y = torch.where(scale > 0, x / torch.where(scale > 0, scale, 1.0), 0.0).clamp(-fmt.qmax, fmt.qmax)
    return (y.round() if fmt.storage == torch.int8 else y).to(fmt.storage)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Stored values back to numbers: ``q * scale`` in ``dtype``."""
    return q.to(dtype) * scale.to(dtype)


def _bits(cache: torch.Tensor) -> torch.Tensor:
    """The pages as raw bytes: CPU torch has no index_copy_/index_fill_ for float8."""
    return cache.view(torch.uint8) if cache.dtype != torch.int8 else cache


def write(cache: torch.Tensor, x: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Quantize each new token's row ``x`` (N, H_kv, D) into its slot of a quantized layer cache."""
    fmt = kv_format(cache)
    nb, bs, h, d = cache.shape
    slots = slot_mapping.long()
    if fmt.per_block:
        x = x.float()
        finite = torch.isfinite(x)
        # an inf sets no scale (it would zero every other value of its block): it is clipped to
        # 127 * the block's scale; a finite value beyond fp16's range is clipped to 65504
        _write_per_block(cache, fmt, _clean(x, INT8_RANGE), torch.where(finite, x.abs(), 0.0).clamp(max=INT8_RANGE), slots)
        return
    if cache.kv_calibrate:  # the first batch this layer sees sets its scale
        set_layer_scale(cache, calibration_scale(x, fmt.qmax))
    q = quantize(x, cache.kv_layer_scale.view(()), fmt)
    _bits(cache).view(nb * bs, h, d).index_copy_(0, slots, q.view(torch.uint8))


def _write_per_block(cache: torch.Tensor, fmt: KVFormat, x: torch.Tensor, mag: torch.Tensor,
                     slots: torch.Tensor) -> None:
    nb, bs, h, d = cache.shape
    scales = cache.kv_scales  # (nb, H)
    blocks = slots // bs
    fresh = blocks[slots % bs == 0]
    if fresh.numel():
        scales.index_fill_(0, fresh, 0.0)  # row 0 written: the block starts afresh, its old scale goes
    need = mag.amax(-1) / fmt.qmax  # (N, H): from the magnitudes of the finite values
    touched, which = torch.unique(blocks, return_inverse=True)
    old = scales.index_select(0, touched)
    new = old.clone().scatter_reduce_(0, which[:, None].expand(-1, h), need, "amax")  # max(old, the new tokens')
    grow = ((new > old) & (old > 0)).any(-1)
    if bool(grow.any()):  # re-round the rows already there to the larger scale
        g = touched[grow]
        ratio = old[grow] / new[grow]
        rows = cache.index_select(0, g).float() * ratio[:, None, :, None]
        cache.index_copy_(0, g, rows.round().clamp(-fmt.qmax, fmt.qmax).to(fmt.storage))
    scales.index_copy_(0, touched, new)
    q = quantize(x, scales.index_select(0, blocks)[:, :, None], fmt)
    cache.view(nb * bs, h, d).index_copy_(0, slots, q)


# -- the read: dequantize ---------------------------------------------------------------------
def read_blocks(cache: torch.Tensor, ids: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Blocks ``ids`` of one layer's pages, (n, block_size, H_kv, D): as stored for an unquantized
    cache, else dequantized to ``dtype`` (default fp32) with each (block, head)'s scale."""
    blocks = cache.index_select(0, ids)
    scales = kv_scales(cache)
    if scales is None:
        return blocks
    return dequantize(blocks, scales.index_select(0, ids)[:, None, :, None], dtype or torch.float32)


# -- blocks that move: copy-on-write, scrubbing ---------------------------------------------------
def copy_blocks(cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy blocks ``src`` to ``dst`` in one layer's pages, with their scales (per block)."""
    cache[dst] = cache[src]
    if kv_format(cache) is not None and kv_format(cache).per_block:
        cache.kv_scales[dst] = cache.kv_scales[src]


def clear_blocks(cache: torch.Tensor, ids: torch.Tensor) -> None:
    """Zero blocks ``ids`` (their values and, per block, their scales)."""
    _bits(cache).index_fill_(0, ids, 0)
    fmt = kv_format(cache)
    if fmt is not None and fmt.per_block:
        cache.kv_scales.index_fill_(0, ids, 0.0)


__all__ = ["KV_CACHE_DTYPES", "ALIASES", "KVFormat", "FORMATS", "check_name", "unavailable", "resolve", "kv_format",
           "kv_scales", "new_cache", "set_layer_scale", "calibration_scale", "quantize", "dequantize", "write",
           "read_blocks", "copy_blocks", "clear_blocks"]
