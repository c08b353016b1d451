"""A GGUF weight kept as its quantized integers and scales, beside the fp32 copy the model computes with.

Owns the layout the CPU kernel ``kernels.qmatmul`` reads, and the rule that rebuilds fp32
weights from it. Why keep them: a decode step must read every weight once, so at small
batches its speed is bytes / memory bandwidth, and at batch 64 the fp32 weights (538 MB for
the default model) stream from memory every step. The file's integers and scales are 98 MB.
The kernel rebuilds each fp32 weight exactly as ``gguf.quants`` dequantizes it (the very value
of the fp32 copy), then does the same fp32 multiply-adds; only the order of the sums differs
from MKL's.

Kinds (llama.cpp's names; the file stores blocks of 32 weights along a row, ``q`` the integers):

=====  ===================  ============================  ==========
kind   weight               integers                      scales
=====  ===================  ============================  ==========
Q4_0   d * (q - 8)          4 bits                        d
Q4_1   d * q + m            4 bits                        d, m
Q8_0   q * d                8 bits, signed                d
=====  ===================  ============================  ==========

The file's layout (per row: blocks of fp16 scale(s), then 16 bytes whose low nibbles are
weights 0-15 and high nibbles weights 16-31) is re-arranged once, at load, for the kernel:
output features in groups of 16 lanes, so that one vector holds 16 neighbouring outputs'
weights at one input index k (G = ceil(N / 16) groups; lanes past N have zero scales):

- ``qt``: Q4_0/Q4_1 (G, K/2, 16) bytes, byte i = q(lane i, k = 2kk) | q(lane i, 2kk + 1) << 4;
  Q8_0 (G, K, 16) signed bytes;
- ``dt`` and (Q4_1 only) ``mt``: (G, K/32, 16) float32, the fp16 scales widened exactly.

The file's own row layout is kept too (``rq`` (N, K/32, 16 or 32) bytes, ``rd``/``rm`` (N, K/32)
float32): up to 8 rows of x the kernel reads one weight row after another from it, which streams
through memory better than the lane groups do; above 8 rows (a GEMM, compute-bound) the lanes
serve. The two cost twice the bytes (222 MB for the default model, against 538 MB of fp32).

Other kinds (K-quants, F16, ...) are not kept: those layers use the fp32 copy only.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

QBLOCK = 32
KINDS = {"Q4_0": 0, "Q4_1": 1, "Q8_0": 2}
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}  # as stored in the file: fp16 scale(s), then qs


@dataclass(frozen=True)
class GGUFBlocks:
    """One (out_features, in_features) weight in the kernel's layout (see the module docstring)."""

    kind: str
    qt: torch.Tensor
    dt: torch.Tensor
    mt: torch.Tensor | None
    out_features: int
    in_features: int
    rq: torch.Tensor
    rd: torch.Tensor
    rm: torch.Tensor | None

    def __post_init__(self) -> None:
        g = -(-self.out_features // 16)
        nb = self.in_features // QBLOCK
        q_len = self.in_features if self.kind == "Q8_0" else self.in_features // 2
        want = {"qt": (g, q_len, 16), "dt": (g, nb, 16), "mt": (g, nb, 16) if self.kind == "Q4_1" else None,
                "rq": (self.out_features, nb, 32 if self.kind == "Q8_0" else 16), "rd": (self.out_features, nb),
                "rm": (self.out_features, nb) if self.kind == "Q4_1" else None}
        for name, shape in want.items():
            t = getattr(self, name)
            if shape is None:
                if t is not None:
                    raise ValueError(f"{self.kind} has no {name}")
                continue
            dtype = torch.uint8 if name in ("qt", "rq") else torch.float32
            if t is None or tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous() or t.device.type != "cpu":
                raise ValueError(f"{self.kind} {name} must be a contiguous {dtype} CPU tensor {shape}, got "
                                 f"{None if t is None else (t.dtype, tuple(t.shape))}")
        if self.in_features % QBLOCK or self.kind not in KINDS:
            raise ValueError(f"{self.kind} blocks of {self.in_features} inputs: need a kind of {list(KINDS)} and a multiple of 32")
        # what the kernel is handed on every call, worked out once (the tensors never change)
        object.__setattr__(self, "pointers", (self.qt.data_ptr(), self.dt.data_ptr(),
                                              None if self.mt is None else self.mt.data_ptr(), KINDS[self.kind]))
        object.__setattr__(self, "row_pointers", (self.rq.data_ptr(), self.rd.data_ptr(),
                                                  None if self.rm is None else self.rm.data_ptr(), KINDS[self.kind]))

    @property
    def shape(self) -> tuple[int, int]:
        return self.out_features, self.in_features

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qt, self.dt, self.mt, self.rq, self.rd, self.rm)
                   if t is not None)

    @property
    def stream_bytes(self) -> int:
        """What one pass over the weight reads at batch 1 (the row layout)."""
        return sum(t.numel() * t.element_size() for t in (self.rq, self.rd, self.rm) if t is not None)

    @classmethod
    def from_file_rows(cls, kind: str, raw: np.ndarray) -> "GGUFBlocks":
        """From a tensor's bytes as the file stores them: (N, K/32 * block bytes) uint8."""
        if kind not in KINDS:
            raise ValueError(f"{kind} blocks are not supported (only {', '.join(KINDS)})")
        raw = np.asarray(raw)
        if raw.dtype != np.uint8 or raw.ndim != 2 or raw.shape[1] % _BLOCK_BYTES[kind]:
            raise ValueError(f"{kind} rows must be uint8 (N, K/32 * {_BLOCK_BYTES[kind]}), got {raw.dtype} {raw.shape}")
        n = raw.shape[0]
        b = raw.reshape(n, -1, _BLOCK_BYTES[kind])
        nb = b.shape[1]
        k = nb * QBLOCK
        groups = -(-n // 16)

        def lanes(a: np.ndarray) -> np.ndarray:  # (N, X) -> (G, X, 16), zero lanes past N
            padded = np.zeros((groups * 16, a.shape[1]), dtype=a.dtype)
            padded[:n] = a
            return np.ascontiguousarray(padded.reshape(groups, 16, a.shape[1]).transpose(0, 2, 1))

        def row_scale(i: int) -> np.ndarray:  # (N, nb) fp32
            return np.ascontiguousarray(b[..., i:i + 2]).view(np.float16)[..., 0].astype(np.float32)

        def scale(i: int) -> torch.Tensor:
            return torch.from_numpy(lanes(row_scale(i)))

        first = 2 if kind != "Q4_1" else 4
        rows = (torch.from_numpy(np.ascontiguousarray(b[..., first:])), torch.from_numpy(row_scale(0)),
                torch.from_numpy(row_scale(2)) if kind == "Q4_1" else None)
        if kind == "Q8_0":
            q = np.ascontiguousarray(b[..., 2:]).reshape(n, k)  # the int8 bytes, as they are
            return cls(kind, torch.from_numpy(lanes(q)), scale(0), None, n, k, *rows)
        packed = b[..., first:]  # (N, nb, 16): low nibbles weights 0-15, high nibbles 16-31
        q = np.concatenate([packed & 15, packed >> 4], axis=-1).reshape(n, k)  # (N, K), 0..15
        ql = lanes(q)  # (G, K, 16)
        qt = ql[:, 0::2, :] | (ql[:, 1::2, :] << 4)
        return cls(kind, torch.from_numpy(np.ascontiguousarray(qt)), scale(0),
                   scale(2) if kind == "Q4_1" else None, n, k, *rows)

    def dequantize_rows(self) -> torch.Tensor:
        """(N, K) float32 from the row layout, by the same rule (tests check the two layouts agree)."""
        n, k = self.shape
        d = self.rd[..., None]
        if self.kind == "Q8_0":
            return (self.rq.view(torch.int8).float() * d).reshape(n, k)
        q = torch.cat([self.rq & 15, self.rq >> 4], dim=-1).float()  # weights 0-15, then 16-31
        w = d * (q - 8) if self.kind == "Q4_0" else d * q + self.rm[..., None]
        return w.reshape(n, k)

    def dequantize(self) -> torch.Tensor:
        """(N, K) float32, by the same rule as gguf.quants (for tests and for checking a copy)."""
        n, k = self.shape
        d = self.dt.repeat_interleave(QBLOCK, dim=1)  # (G, K, 16): each block's scale for its 32 k
        if self.kind == "Q8_0":
            w = self.qt.view(torch.int8).float() * d
        else:
            q = torch.stack([self.qt & 15, self.qt >> 4], dim=2).reshape(self.qt.shape[0], k, 16).float()
            w = d * (q - 8) if self.kind == "Q4_0" else d * q + self.mt.repeat_interleave(QBLOCK, dim=1)
        return w.permute(0, 2, 1).reshape(-1, k)[:n].contiguous()


def read_blocks(path, config) -> dict[str, GGUFBlocks]:
    """The linear layers' weights of the GGUF file at ``path`` as their quantized blocks (Q4_0,
    Q4_1, Q8_0 only), in Hugging Face names, rows in the order the loader gives the fp32 weights
    (``config`` is the model's LlamaConfig). A tied model's head is the embedding's blocks."""
    from ..model.errors import CorruptModelError
    from ..model.gguf_loader import hf_name, hf_rows, open_gguf

    reader = open_gguf(path)
    blocks = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        kind = t.tensor_type.name
        if name is None or kind not in KINDS or not name.endswith(".weight") or "norm" in name:
            continue
        try:  # a row of blocks is a row of weights: the same un-permuting as the loader's
            blocks[name] = GGUFBlocks.from_file_rows(kind, hf_rows(name, np.asarray(t.data), config))
        except ValueError as e:
            raise CorruptModelError(f"{path}: tensor {t.name} ({kind}): {e}") from e
    if config.tie_word_embeddings and "model.embed_tokens.weight" in blocks:
        blocks.setdefault("lm_head.weight", blocks["model.embed_tokens.weight"])
    blocks.pop("model.embed_tokens.weight", None)  # the lookup reads the fp32 copy
    return blocks


class _FileBlocks(dict):
    """hf name -> GGUFBlocks of one file (a dict that can be weakly referenced)."""


class _ModuleBlocks(dict):
    """module -> GGUFBlocks for one model; holds its file's blocks (``file``), so the source's weak
    reference to them lives exactly as long as a plan that multiplies from them."""

    file: _FileBlocks


def model_blocks(model) -> tuple[dict | None, str | None]:
    """The GGUF file's blocks for each of ``model``'s linear layers (module -> GGUFBlocks), or why
    not. They are read once per loaded file and shared by the plans that use them; the model's
    source keeps only a weak reference, so they are freed with the last plan that used them."""
    import weakref

    from torch import nn

    source = getattr(model, "source", None)
    if source is None or source.format != "gguf":
        return None, "the model was not loaded from a GGUF file (load_model(path.gguf) keeps where it came from)"
    cached = source.cache.get("gguf_blocks")
    by_name = cached() if isinstance(cached, weakref.ref) else cached  # blocks made in memory are held as given
    if by_name is None:
        by_name = _FileBlocks(read_blocks(source.path, model.config))
        source.cache["gguf_blocks"] = weakref.ref(by_name)
    names = {"lm_head.weight": model.lm_head}
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear) and m is not model.lm_head:
            names[f"model.{name}.weight"] = m
    blocks = _ModuleBlocks((m, by_name[n]) for n, m in names.items() if n in by_name)
    blocks.file = by_name  # the next engine on this model reads them from memory, not the file again (seconds)
    if not blocks:
        return None, "the GGUF file holds no Q4_0/Q4_1/Q8_0 linear weights"
    return blocks, None


def blocks_still_match(blocks: dict) -> str | None:
    """Every weight must still be exactly what its blocks rebuild: weights changed since loading
    are never served from the file. Checked in full, one layer at a time. None when they match."""
    for m, b in blocks.items():
        if tuple(m.weight.shape) != (b.out_features, b.in_features):
            return "a linear layer's shape differs from the file's"
        if not torch.equal(b.dequantize_rows(), m.weight.float()):
            return "the weights were changed after loading, so the file's blocks no longer hold them"
    return None
