"""Small C kernels for the CPU, built on first use with the system's C compiler.

Owns building, caching and calling ``cpu_kernels.c``: paged decode attention (torch_sdpa.py
decides when to use it), and a Llama layer's fused elementwise ops (RMSNorm with the residual
add, SiLU(gate) * up, RoPE in place), which model/llama.py uses on fp32 CPU tensors.
Why C: on a CPU, PyTorch can only attend pages by first gathering them into a padded copy
(``index_select``), then running SDPA over the copy. That moves every cached K/V byte twice and
computes the padding. The kernel reads each cached row once, where it lies, through the block table.

- Built with ``cc -O3 -march=native -fno-trapping-math -fopenmp`` (no PyTorch headers, so it compiles in about a
  second), loaded with ``ctypes``. The call releases the GIL.
- Cached by a hash of the source, the flags and this CPU's feature flags, under
  ``$MINIPAGED_CACHE_DIR``, else ``$XDG_CACHE_HOME/minipaged``, else ``~/.cache/minipaged``
  (a temporary folder when none of those is writable).
- No compiler, a failed build, or ``MINIPAGED_CPU_KERNELS=0`` in the environment (read at the
  first use): ``available()`` is False, ``why_not()`` says why, and the PyTorch path runs
  instead. Results agree to fp32 rounding.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("cpu_kernels.c")
_ENV_SWITCH = "MINIPAGED_CPU_KERNELS"
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_reason: str | None = None  # why the kernel is not available (None: not tried yet, or available)
_tried = False


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cache_dir() -> Path:
    for candidate in (os.environ.get("MINIPAGED_CACHE_DIR"),
                      os.environ.get("XDG_CACHE_HOME") and os.path.join(os.environ["XDG_CACHE_HOME"], "minipaged"),
                      os.path.expanduser("~/.cache/minipaged")):
        if not candidate:
            continue
        path = Path(candidate)
        try:
            path.mkdir(parents=True, exist_ok=True)
            if os.access(path, os.W_OK):
                return path
        except OSError:
            continue
    path = Path(tempfile.gettempdir()) / f"minipaged-{os.getuid() if hasattr(os, 'getuid') else 'user'}"
    path.mkdir(parents=True, exist_ok=True)
    return path


# -fno-trapping-math (no floating-point exception flags are read) lets floorf inline, so the
# exp and softmax loops vectorize.
_FLAG_SETS = (
    ["-O3", "-march=native", "-fno-trapping-math", "-fopenmp"],
    ["-O3", "-fno-trapping-math", "-fopenmp"],
    ["-O3", "-march=native", "-fno-trapping-math"],  # no OpenMP (e.g. Apple clang): one core
    ["-O3"],
)


def _build() -> ctypes.CDLL:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        raise RuntimeError("no C compiler found (install gcc, or set CC)")
    source = SOURCE.read_bytes()
    errors = []
    for flags in _FLAG_SETS:
        key = hashlib.sha256(source + " ".join([compiler] + flags).encode() + _cpu_flags().encode()
                             + torch.__version__.encode()).hexdigest()[:16]
        target = _cache_dir() / f"cpu_kernels-{key}.so"
        if not target.exists():
            tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
            cmd = [compiler, *flags, "-fPIC", "-shared", str(SOURCE), "-o", str(tmp), "-lm"]
            try:
                run = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            except (OSError, subprocess.TimeoutExpired) as e:
                errors.append(f"{' '.join(flags)}: {e}")
                continue
            if run.returncode != 0:
                errors.append(f"{' '.join(flags)}: {run.stderr.strip().splitlines()[-1:] or run.returncode}")
                tmp.unlink(missing_ok=True)
                continue
            os.replace(tmp, target)  # atomic: a concurrent process sees the whole file or none
        try:
            lib = ctypes.CDLL(str(target))
            if lib.minipaged_decode_abi() != 7:
                raise OSError("wrong ABI version")
        except OSError as e:
            # a cached build this machine cannot load (a home folder shared with another machine):
            # drop it, so that the next process builds afresh
            errors.append(f"{' '.join(flags)}: could not load {target.name}: {e}")
            target.unlink(missing_ok=True)
            continue
        fn = lib.minipaged_paged_decode_f32
        i64, p = ctypes.c_int64, ctypes.c_void_p
        fn.argtypes = [p, p, p, p, i64, p, p, i64, i64, i64, i64, i64, i64, i64, ctypes.c_float]
        fn.restype = ctypes.c_int
        f32 = ctypes.c_float
        lib.minipaged_rmsnorm_f32.argtypes = [p, p, p, p, i64, i64, f32]
        lib.minipaged_rmsnorm_f32.restype = None
        lib.minipaged_silu_mul_f32.argtypes = [p, p, p, i64, i64]
        lib.minipaged_silu_mul_f32.restype = None
        lib.minipaged_rope_f32.argtypes = [p, i64, i64, i64, i64, p, p]
        lib.minipaged_rope_f32.restype = None
        lib.minipaged_write_kv_f32.argtypes = [p, p, p, p, i64, i64, p, i64, i64, i64]
        lib.minipaged_write_kv_f32.restype = ctypes.c_int
        lib.minipaged_qmatmul_f32.argtypes = [p, i64, p, p, p, i64, p, i64, i64, i64]
        lib.minipaged_qmatmul_f32.restype = ctypes.c_int
        lib.minipaged_qmatvec_f32.argtypes = [p, i64, p, p, p, i64, p, i64, i64, i64]
        lib.minipaged_qmatvec_f32.restype = ctypes.c_int
        lib.minipaged_qmatmul_fast.argtypes = []
        lib.minipaged_qmatmul_fast.restype = ctypes.c_int
        lib.minipaged_exp_f32.argtypes = [p, p, i64]
        lib.minipaged_exp_f32.restype = None
        lib.minipaged_qmatmul_argmax_f32.argtypes = [p, i64, p, p, p, i64, i64, i64, i64, p]
        lib.minipaged_qmatmul_argmax_f32.restype = ctypes.c_int
        lib.minipaged_decode_layers_f32.argtypes = [p, i64, p]
        lib.minipaged_decode_layers_f32.restype = ctypes.c_int
        return lib
    raise RuntimeError("the C compiler failed: " + "; ".join(errors))


def available() -> bool:
    """True when the kernel is built and loaded (builds it on the first call). Called on every
    layer's every op, so after the first call it is one check: ``MINIPAGED_CPU_KERNELS`` is
    read at that first call (set it before the process starts, or before first use)."""
    if _tried:
        return _lib is not None
    return _first_use()


def _first_use() -> bool:
    global _lib, _reason, _tried
    with _lock:
        if not _tried:
            if os.environ.get(_ENV_SWITCH, "1").strip().lower() in ("0", "false", "no", "off"):
                _lib, _reason = None, f"{_ENV_SWITCH}=0 is set"
            else:
                try:
                    _lib, _reason = _build(), None
                except Exception as e:  # any failure means: use the PyTorch path
                    _lib, _reason = None, str(e)
            _tried = True
    return _lib is not None


def why_not() -> str | None:
    """Why the kernel is not in use, or None when it is."""
    return None if available() else _reason


def applies(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """The kernel handles fp32 CPU tensors laid out as the cache makes them."""
    return (q.device.type == "cpu" and q.dtype == torch.float32 and k_cache.dtype == torch.float32
            and v_cache.dtype == torch.float32 and k_cache.is_contiguous() and v_cache.is_contiguous()
            and available())


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, out: torch.Tensor | None = None,
                 max_context_len: int | None = None) -> torch.Tensor:
    """One query per sequence over its paged context: q (S, H, D) -> (S, H, D), like decode_attention.

    ``max_context_len`` is accepted for decode_attention's signature and not trusted: the kernel
    checks every sequence's length against its table row and every block id against the cache."""
    if not available():
        raise RuntimeError(f"the CPU decode kernel is not available: {why_not()}")
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
    rc = _lib.minipaged_paged_decode_f32(
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


def fused_ops_apply(x: torch.Tensor) -> bool:
    """The fused elementwise ops handle contiguous fp32 CPU tensors without autograd."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and x.is_contiguous()
            and not (x.requires_grad and torch.is_grad_enabled()) and available())


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """(N, C) -> weight * x / rms(x). With ``residual``: residual += x in place first, and the
    norm is of the updated residual (returned: the normed tensor; the residual holds the sum)."""
    N, C = x.shape
    if weight.dtype != torch.float32 or not weight.is_contiguous() or weight.numel() != C:
        raise ValueError(f"RMSNorm weight must be {C} contiguous fp32 values")
    if residual is not None and (residual.shape != x.shape or not residual.is_contiguous() or residual.dtype != torch.float32):
        raise ValueError("the residual must be a contiguous fp32 tensor shaped like x")
    out = torch.empty_like(x)
    _lib.minipaged_rmsnorm_f32(x.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(),
                               out.data_ptr(), N, C, float(eps))
    return out


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up, both (N, I) contiguous fp32, into gate's memory (returned)."""
    if gate.shape != up.shape or not (gate.is_contiguous() and up.is_contiguous()):
        raise ValueError("gate and up must be contiguous and the same shape")
    N, I = gate.shape
    _lib.minipaged_silu_mul_f32(gate.data_ptr(), up.data_ptr(), gate.data_ptr(), N, I)
    return gate


def write_kv_applies(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """fp32 CPU caches, contiguous, and k, v whose heads lie contiguous within each token's row."""
    def rows_ok(x: torch.Tensor) -> bool:
        return x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]

    return (k_cache.device.type == "cpu" and k_cache.dtype == v_cache.dtype == k.dtype == v.dtype == torch.float32
            and k_cache.is_contiguous() and v_cache.is_contiguous() and rows_ok(k) and rows_ok(v) and available())


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """kv_cache.write_kv in one C call for K and V: every slot checked first, nothing written if one is bad."""
    num_blocks, block_size, h, d = k_cache.shape
    n = k.shape[0]
    if k.shape != (n, h, d) or v.shape != (n, h, d) or slot_mapping.shape != (n,):
        raise ValueError(f"k, v must be ({n}, {h}, {d}) with one slot each; got {tuple(k.shape)}, {tuple(v.shape)}, "
                         f"{tuple(slot_mapping.shape)} slots")
    slots = slot_mapping.to(torch.int64).contiguous()
    rc = _lib.minipaged_write_kv_f32(k_cache.data_ptr(), v_cache.data_ptr(), k.data_ptr(), v.data_ptr(), k.stride(0),
                                     v.stride(0), slots.data_ptr(), n, h * d, num_blocks * block_size)
    if rc != 0:
        raise IndexError(f"a slot is outside the cache (0..{num_blocks * block_size - 1}): nothing was written")


_qfast: bool | None = None


def qmatmul_fast() -> bool:
    """True when the GGUF matmul is the vectorized one (built for a CPU with AVX-512). Elsewhere
    the kernels keep only a portable loop, correct but far too slow to serve with, and the
    model multiplies with its fp32 copy instead. (Asked on every small matmul: one check.)"""
    global _qfast
    if _qfast is None:
        _qfast = available() and bool(_lib.minipaged_qmatmul_fast())
    return _qfast


def qmatmul_why_not() -> str | None:
    """Why the GGUF matmul does not serve here, or None when it does."""
    if not available():
        return f"the CPU kernels are not available: {why_not()}"
    if not qmatmul_fast():
        return "this CPU (or compiler) has no AVX-512, which the fast GGUF matmul is written for"
    return None


def qmatmul(x: torch.Tensor, blocks) -> torch.Tensor:
    """x (M, K) fp32 @ W^T -> (M, N), W given as its GGUF integers and scales (a
    model.gguf_blocks.GGUFBlocks): each fp32 weight is rebuilt exactly as gguf.quants makes it,
    then multiplied in fp32. It reads a fifth of the fp32 weights' bytes."""
    if not available():
        raise RuntimeError(f"the CPU kernels are not available: {why_not()}")
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
        rc = _lib.minipaged_qmatvec_f32(x.data_ptr(), x.stride(0), qt, dt, mt, kind, y.data_ptr(), x.shape[0], N, K)
    else:
        qt, dt, mt, kind = blocks.pointers
        rc = _lib.minipaged_qmatmul_f32(x.data_ptr(), x.stride(0), qt, dt, mt, kind, y.data_ptr(), x.shape[0], N, K)
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
    model.gguf_blocks.GGUFBlocks each) with their biases, and the layer's K/V pages. It keeps
    their addresses only (holding them would keep a finished engine's cache alive): the caller
    checks, before each use, that every address and shape is still the one given here
    (model/llama.py does, every step)."""

    def __init__(self, layers: list[dict], eps: float, dims: dict) -> None:
        self.dims = dict(dims)  # C, H, H_kv, D, I
        self.eps = float(eps)
        arr = (_Layer * len(layers))()
        for i, ly in enumerate(layers):
            arr[i] = _Layer(ly["input_norm"].data_ptr(), ly["post_norm"].data_ptr(),
                            *(_qlinear(*ly[n]) for n in ("q", "k", "v", "o", "gate", "up", "down")),
                            ly["k_cache"].data_ptr(), ly["v_cache"].data_ptr())
        self.layers = arr
        self.num_layers = len(layers)
        k_cache = layers[0]["k_cache"] if layers else None
        self.cache_shape = tuple(k_cache.shape) if k_cache is not None else None


def decode_layers(plan: DecodeLayers, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn, scale: float) -> torch.Tensor:
    """Run every layer of ``plan`` over a step whose tokens are all decodes (row s = sequence s's
    one new token), from the GGUF blocks, in one C call: the same maths, op for op, as the
    layers' own forward (the same kernels on the same rows), so the same bits. ``x`` (M, C), the
    residual stream, is updated in place and returned. Refused with nothing written: a sequence
    with other than one new token, a slot, block id or context length the cache cannot hold."""
    if not available():
        raise RuntimeError(f"the CPU kernels are not available: {why_not()}")
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
    rc = _lib.minipaged_decode_layers_f32(plan.layers, plan.num_layers, ctypes.byref(step))
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
    rc = _lib.minipaged_qmatmul_argmax_f32(x.data_ptr(), x.stride(0), qt, dt, mt, kind, x.shape[0],
                                          blocks.out_features, blocks.in_features, at.data_ptr())
    if rc == -2:
        raise MemoryError("the GGUF argmax could not allocate its buffers")
    return at.tolist() if rc == 0 else None


def exp(x: torch.Tensor) -> torch.Tensor:
    """The kernels' own e^x (for testing its accuracy): contiguous fp32 in, same shape out."""
    x = x.contiguous()
    out = torch.empty_like(x)
    _lib.minipaged_exp_f32(x.data_ptr(), out.data_ptr(), x.numel())
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
    _lib.minipaged_rope_f32(x.data_ptr(), x.stride(0), N, heads, D, cos.data_ptr(), sin.data_ptr())
    return x


__all__ = ["available", "why_not", "applies", "paged_decode", "fused_ops_apply", "rmsnorm", "silu_mul", "rope_", "qmatmul", "qmatmul_fast", "qmatmul_why_not",
           "write_kv_applies", "write_kv", "DecodeLayers", "decode_layers", "qmatmul_argmax"]
