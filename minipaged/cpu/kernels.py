"""Python faces of the C kernels (csrc/): shapes checked, pointers passed, errors named.

Each function assumes the library is built (the engine's plan only puts a kernel in its table when
``build.library()`` loaded); none decides whether it should be used. They hold no state.

- ``paged_decode``: one query per sequence over its paged context, read in place (the CPU
  sibling of lesson 05's Triton kernel; csrc/paged_attention.c).
- ``write_kv``: the K/V write through a slot mapping.
- ``rmsnorm``, ``silu_mul``, ``rope_``: a Llama layer's element-wise ops in one pass each.
- ``qmatmul``, ``qmatmul_argmax``: y = x @ W^T from a GGUF file's blocks (gguf_blocks.py).
- ``decode_layers``: a decode step's layers in one call (csrc/decode_step.c).
"""
from __future__ import annotations

import ctypes

import torch

from .build import library


def _lib() -> ctypes.CDLL:
    lib = library()
    if lib is None:
        from .build import info

        raise RuntimeError(f"the CPU kernels are not available: {info()['why_not']}")
    return lib


def qmatmul_fast() -> bool:
    """True when the GGUF matmul is the vectorized one (built for a CPU with AVX-512). Elsewhere
    only a portable loop is built: correct, far too slow to serve with."""
    lib = library()
    return lib is not None and bool(lib.minipaged_qmatmul_fast())


def qmatmul_amx() -> bool:
    """True when the GGUF matmul's lane kernel (more than 8 rows: GEMMs, the head's argmax, the
    whole-step decode's linears) runs on AMX tiles: a CPU with AMX-BF16 (Sapphire Rapids and
    later) and a Linux that grants the tile state, unless ``MINIPAGED_AMX=0`` was set before the
    kernels were first used. Each x is split exactly into three bf16 parts, so the products are
    exact; the sums come in another order than on AVX-512 (as accurate as an fp32 matmul, not the
    same bits). See csrc/gguf_matmul.c."""
    lib = library()
    return lib is not None and bool(lib.minipaged_qmatmul_amx())


def set_amx(on: bool) -> bool:
    """Turn the AMX kernel on or off for this process (tests compare the two); returns whether it
    was on. Raises RuntimeError where it cannot be turned on (no AMX in this CPU or build)."""
    was = _lib().minipaged_set_amx(1 if on else 0)
    if was < 0:
        raise RuntimeError("the AMX kernel cannot run here: this CPU or build has no AMX-BF16 (see qmatmul_amx)")
    return bool(was)


def openmp() -> bool:
    """True when the kernels split their work over the cores."""
    lib = library()
    return lib is not None and bool(lib.minipaged_openmp())


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, out: torch.Tensor | None = None,
                 max_context_len: int | None = None) -> torch.Tensor:
    """One query per sequence over its paged context: q (S, H, D) -> (S, H, D), like decode_attention.

    ``max_context_len`` is accepted for decode_attention's signature and not trusted: the kernel
    checks every sequence's length against its table row and every block id against the cache."""
    S, H, D = q.shape
    num_blocks, block_size, h_kv, d = k_cache.shape
    if d != D or H % h_kv:
        raise ValueError(f"q is (S, {H}, {D}) but the cache is (blocks, block_size, {h_kv}, {d})")
    q = q.contiguous()
    tables = block_tables.to(torch.int32)
    if tables.stride(-1) != 1:
        tables = tables.contiguous()
    lens = context_lens.to(torch.int32).contiguous()
    if tables.shape[0] < S or lens.shape[0] < S:
        raise ValueError(f"{S} queries but {tables.shape[0]} block-table rows and {lens.shape[0]} context lengths")
    result = out if out is not None and out.is_contiguous() and out.dtype == torch.float32 else torch.empty_like(q)
    rc = _lib().minipaged_paged_decode_f32(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), tables.stride(0),
        lens.data_ptr(), result.data_ptr(), S, H, h_kv, D, block_size, num_blocks, tables.shape[1], float(scale))
    if rc != 0:  # the kernel checks every id and length itself: nothing is read out of bounds
        if -rc & 4:
            raise IndexError("a block table names a block outside the cache")
        if -rc & 8:
            raise ValueError(f"a context is longer than its block table holds ({tables.shape[1]} blocks of {block_size})")
        raise MemoryError(f"the CPU decode kernel could not allocate its scores ({rc})")
    if out is not None and result is not out:
        out.copy_(result)
        return out
    return result


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """(N, C) -> weight * x / rms(x). With ``residual``: residual += x in place first, and the
    norm is of the updated residual (returned: the normed tensor; the residual holds the sum)."""
    N, C = x.shape
    if weight.dtype != torch.float32 or not weight.is_contiguous() or weight.numel() != C:
        raise ValueError(f"RMSNorm weight must be {C} contiguous fp32 values")
    if residual is not None and (residual.shape != x.shape or not residual.is_contiguous() or residual.dtype != torch.float32):
        raise ValueError("the residual must be a contiguous fp32 tensor shaped like x")
    out = torch.empty_like(x)
    _lib().minipaged_rmsnorm_f32(x.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(),
                               out.data_ptr(), N, C, float(eps))
    return out


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up, both (N, I) contiguous fp32, into gate's memory (returned)."""
    if gate.shape != up.shape or not (gate.is_contiguous() and up.is_contiguous()):
        raise ValueError("gate and up must be contiguous and the same shape")
    N, I = gate.shape
    _lib().minipaged_silu_mul_f32(gate.data_ptr(), up.data_ptr(), gate.data_ptr(), N, I)
    return gate


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """kv_cache.write_kv in one C call for K and V: every slot checked first, nothing written if one is bad."""
    num_blocks, block_size, h, d = k_cache.shape
    n = k.shape[0]
    if k.shape != (n, h, d) or v.shape != (n, h, d) or slot_mapping.shape != (n,):
        raise ValueError(f"k, v must be ({n}, {h}, {d}) with one slot each; got {tuple(k.shape)}, {tuple(v.shape)}, "
                         f"{tuple(slot_mapping.shape)} slots")
    slots = slot_mapping.to(torch.int64).contiguous()
    rc = _lib().minipaged_write_kv_f32(k_cache.data_ptr(), v_cache.data_ptr(), k.data_ptr(), v.data_ptr(), k.stride(0),
                                     v.stride(0), slots.data_ptr(), n, h * d, num_blocks * block_size)
    if rc != 0:
        raise IndexError(f"a slot is outside the cache (0..{num_blocks * block_size - 1}): nothing was written")


def qmatmul(x: torch.Tensor, blocks) -> torch.Tensor:
    """x (M, K) fp32 @ W^T -> (M, N), W given as its GGUF integers and scales (a
    cpu.gguf_blocks.GGUFBlocks): each fp32 weight is rebuilt exactly as gguf.quants makes it,
    then multiplied in fp32. It reads a fifth of the fp32 weights' bytes. Past 8 rows on a CPU
    with AMX (:func:`qmatmul_amx`) the same exact products are summed block by block on the tile
    unit instead: as accurate, not the same bits."""
    N, K = blocks.out_features, blocks.in_features
    if x.dim() != 2 or x.shape[1] != K or x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"x must be fp32 (M, {K}) on the CPU, got {x.dtype} {tuple(x.shape)} on {x.device}")
    if x.stride(1) != 1:
        x = x.contiguous()
    y = torch.empty(x.shape[0], N, dtype=torch.float32)
    if x.shape[0] == 0:
        return y
    if x.shape[0] <= 8:  # the row layout streams better (see model/gguf_blocks.py)
        qt, dt, mt, kind = blocks.row_pointers  # checked and fixed when the blocks were made
        rc = _lib().minipaged_qmatvec_f32(x.data_ptr(), x.stride(0), qt, dt, mt, kind, y.data_ptr(), x.shape[0], N, K)
    else:
        qt, dt, mt, kind = blocks.pointers
        rc = _lib().minipaged_qmatmul_f32(x.data_ptr(), x.stride(0), qt, dt, mt, kind, y.data_ptr(), x.shape[0], N, K)
    if rc == -2:
        raise MemoryError("the GGUF matmul could not allocate its weight panel")
    if rc != 0:
        raise ValueError(f"{blocks.kind} blocks of a ({N}, {K}) weight: K must be a multiple of 32")
    return y


# -- a decode step's decoder layers in one call (minipaged_decode_layers_f32) ---------------
class _QLinear(ctypes.Structure):
    _fields_ = [(n, ctypes.c_void_p) for n in ("qt", "dt", "mt", "rq", "rd", "rm", "bias")] + \
               [(n, ctypes.c_int64) for n in ("kind", "N", "K")]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p)] + \
               [(n, _QLinear) for n in ("q", "k", "v", "o", "gate", "up", "down")] + \
               [("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p)]


class _Step(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int64) for n in ("M", "C", "H", "H_kv", "D", "I", "BS", "num_blocks", "bt_stride",
                                              "max_blocks")] + \
               [("eps", ctypes.c_float), ("scale", ctypes.c_float)] + \
               [(n, ctypes.c_void_p) for n in ("x", "cos", "sin", "slots", "tables", "lens", "qsl",
                                               "h", "q", "k", "v", "o", "a", "g", "u")]


def _qlinear(blocks, bias: torch.Tensor | None) -> _QLinear:
    qt, dt, mt, kind = blocks.pointers
    rq, rd, rm, _ = blocks.row_pointers
    return _QLinear(qt, dt, mt, rq, rd, rm, None if bias is None else bias.data_ptr(), kind,
                    blocks.out_features, blocks.in_features)


class DecodeLayers:
    """What ``decode_layers`` needs of a stack of Llama layers, worked out once: per layer the two
    RMSNorm weights, the seven linear layers' GGUF blocks (q, k, v, o, gate, up, down; a
    cpu.gguf_blocks.GGUFBlocks each) with their biases, and the layer's K/V pages. It holds
    them (the C side reads their addresses), so it lives exactly as long as the executor that
    made it."""

    def __init__(self, layers: list[dict], eps: float, dims: dict) -> None:
        self.dims = dict(dims)  # C, H, H_kv, D, I
        self.eps = float(eps)
        arr = (_Layer * len(layers))()
        for i, ly in enumerate(layers):
            arr[i] = _Layer(ly["input_norm"].data_ptr(), ly["post_norm"].data_ptr(),
                            *(_qlinear(*ly[n]) for n in ("q", "k", "v", "o", "gate", "up", "down")),
                            ly["k_cache"].data_ptr(), ly["v_cache"].data_ptr())
        self.layers = arr
        self.holds = layers  # keeps every tensor whose address the C side reads alive
        self.num_layers = len(layers)
        k_cache = layers[0]["k_cache"] if layers else None
        self.cache_shape = tuple(k_cache.shape) if k_cache is not None else None


def decode_layers(plan: DecodeLayers, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn, scale: float) -> torch.Tensor:
    """Run every layer of ``plan`` over a step whose tokens are all decodes (row s = sequence s's
    one new token), from the GGUF blocks, in one C call: the same maths, op for op, as the
    layers' own forward (the same kernels on the same rows), so the same bits. ``x`` (M, C), the
    residual stream, is updated in place and returned. Refused with nothing written: a sequence
    with other than one new token, a slot, block id or context length the cache cannot hold."""
    d = plan.dims
    M, C = x.shape
    num_blocks, block_size, h_kv, head_dim = plan.cache_shape
    if C != d["C"] or x.dtype != torch.float32 or not x.is_contiguous() or cos.shape != (M, head_dim) \
            or sin.shape != (M, head_dim) or not (cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError(f"x must be contiguous fp32 ({M}, {d['C']}) with cos, sin ({M}, {head_dim})")
    slots = attn.slot_mapping.to(torch.int64).contiguous()
    tables = attn.block_tables.to(torch.int32)
    if tables.dim() != 2 or tables.stride(-1) != 1:
        tables = tables.reshape(tables.shape[0], -1).contiguous()
    lens = attn.context_lens.to(torch.int32).contiguous()
    qsl = attn.query_start_loc.to(torch.int32).contiguous()
    if slots.shape != (M,) or lens.shape != (M,) or tables.shape[0] != M or qsl.shape != (M + 1,):
        raise ValueError(f"{M} tokens need {M} slots, sequences and block-table rows, and {M + 1} query starts")
    H, I = d["H"], d["I"]
    scratch = torch.empty(M * (2 * C + 2 * H * head_dim + 2 * h_kv * head_dim + 2 * I), dtype=torch.float32)
    parts, at = {}, 0
    for name, width in (("h", C), ("q", H * head_dim), ("k", h_kv * head_dim), ("v", h_kv * head_dim),
                        ("o", H * head_dim), ("a", C), ("g", I), ("u", I)):
        parts[name] = scratch.data_ptr() + 4 * at
        at += M * width
    step = _Step(M, C, H, h_kv, head_dim, I, block_size, num_blocks, tables.stride(0), tables.shape[1],
                 plan.eps, float(scale), x.data_ptr(), cos.data_ptr(), sin.data_ptr(), slots.data_ptr(),
                 tables.data_ptr(), lens.data_ptr(), qsl.data_ptr(), *parts.values())
    rc = _lib().minipaged_decode_layers_f32(plan.layers, plan.num_layers, ctypes.byref(step))
    if rc == 0:
        return x
    if rc == -3:
        raise ValueError("decode_layers is for steps of decodes only: every sequence must have exactly one new token")
    if rc == -4:
        raise IndexError("a block table names a block outside the cache: nothing was written")
    if rc == -8:
        raise ValueError(f"a context is empty or longer than its block table holds ({tables.shape[1]} blocks of "
                         f"{block_size}): nothing was written")
    if rc == -16:
        raise IndexError(f"a slot is outside the cache (0..{num_blocks * block_size - 1}): nothing was written")
    if rc == -2:
        raise MemoryError("decode_layers could not allocate its buffers")
    raise ValueError("the layers' weights do not fit the step's shapes")


def qmatmul_argmax(x: torch.Tensor, blocks) -> list[int] | None:
    """Each row's argmax of ``qmatmul(x, blocks)`` (its first largest output), without making the
    product: greedy sampling from the LM head, whose logits are 12 MB a step at batch 64. The same
    accumulators as qmatmul's lane kernel, so the same token. None where it does not apply (up to
    8 rows, where qmatmul takes the row layout; no fast kernel; a row with a NaN): compute the
    logits then."""
    if not qmatmul_fast() or x.dim() != 2 or x.shape[0] <= 8 or x.dtype != torch.float32 or x.device.type != "cpu" \
            or x.shape[1] != blocks.in_features:
        return None
    if x.stride(1) != 1:
        x = x.contiguous()
    qt, dt, mt, kind = blocks.pointers
    at = torch.empty(x.shape[0], dtype=torch.int64)
    rc = _lib().minipaged_qmatmul_argmax_f32(x.data_ptr(), x.stride(0), qt, dt, mt, kind, x.shape[0],
                                          blocks.out_features, blocks.in_features, at.data_ptr())
    if rc == -2:
        raise MemoryError("the GGUF argmax could not allocate its buffers")
    return at.tolist() if rc == 0 else None


def exp(x: torch.Tensor) -> torch.Tensor:
    """The kernels' own e^x (for testing its accuracy): contiguous fp32 in, same shape out."""
    x = x.contiguous()
    out = torch.empty_like(x)
    _lib().minipaged_exp_f32(x.data_ptr(), out.data_ptr(), x.numel())
    return out


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (N, heads, D) in place, rotate_half layout; cos, sin: (N, D), each token's row.
    x's last two dims must be contiguous (a view into a wider row is fine)."""
    N, heads, D = x.shape
    if x.stride(2) != 1 or x.stride(1) != D or D % 2:
        raise ValueError("rope_ needs x's heads contiguous, with an even head_dim")
    if cos.shape != (N, D) or sin.shape != (N, D) or not (cos.is_contiguous() and sin.is_contiguous()) \
            or cos.dtype != torch.float32 or sin.dtype != torch.float32:
        raise ValueError(f"cos and sin must be contiguous fp32 ({N}, {D}) rows")
    _lib().minipaged_rope_f32(x.data_ptr(), x.stride(0), N, heads, D, cos.data_ptr(), sin.data_ptr())
    return x


__all__ = ["paged_decode", "rmsnorm", "silu_mul", "rope_", "write_kv", "qmatmul", "qmatmul_argmax", "qmatmul_fast", "qmatmul_amx", "set_amx",
           "openmp", "DecodeLayers", "decode_layers", "exp"]
