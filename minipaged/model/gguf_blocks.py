"""A GGUF weight kept as its quantized blocks, beside the fp32 copy the model computes with.

Owns the layout the CPU kernel ``cpu_kernels.qmatmul`` reads, and the rule that rebuilds fp32
weights from it. Why keep the blocks: at batch 1 a decode step must read every weight once, so
its speed is bytes / memory bandwidth. The default model's fp32 copies are 538 MB; its GGUF
blocks are 98 MB. The kernel rebuilds each block's 32 fp32 weights exactly as ``gguf.quants``
dequantizes them (the very values of the fp32 copy: a product, then a sum, each rounded), and
then does the same fp32 multiply-adds. Only the order of the sums differs from MKL's.

Kinds (llama.cpp's names; blocks of 32 weights along a row, ``q`` the stored integers):

=====  ===================  =====================  ====================
kind   weight               qs per block           scales
=====  ===================  =====================  ====================
Q4_0   d * (q - 8)          16 bytes, 2 nibbles    d
Q4_1   d * q + m            16 bytes, 2 nibbles    d, m
Q8_0   q * d                32 signed bytes        d
=====  ===================  =====================  ====================

Byte j of a nibble block holds weight j in its low 4 bits and weight j + 16 in its high 4 bits.
The fp16 scales are widened to fp32 once, here (exactly: every fp16 value is an fp32 value).
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
    """One (out_features, in_features) weight as blocks: ``qs`` uint8 (N, K/32, 16 or 32),
    ``d`` and (Q4_1 only) ``m`` float32 (N, K/32)."""

    kind: str
    qs: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None

    @property
    def shape(self) -> tuple[int, int]:
        return self.qs.shape[0], self.qs.shape[1] * QBLOCK

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.d, self.m) if t is not None)

    @classmethod
    def from_file_rows(cls, kind: str, raw: np.ndarray) -> "GGUFBlocks":
        """From a tensor's bytes as the file stores them: (N, K/32 * block bytes) uint8."""
        if kind not in KINDS:
            raise ValueError(f"{kind} blocks are not supported (only {', '.join(KINDS)})")
        raw = np.asarray(raw)
        if raw.dtype != np.uint8 or raw.ndim != 2 or raw.shape[1] % _BLOCK_BYTES[kind]:
            raise ValueError(f"{kind} rows must be uint8 (N, K/32 * {_BLOCK_BYTES[kind]}), got {raw.dtype} {raw.shape}")
        b = raw.reshape(raw.shape[0], -1, _BLOCK_BYTES[kind])

        def scale(i: int) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(b[..., i:i + 2]).view(np.float16)[..., 0].astype(np.float32))

        first_q = 4 if kind == "Q4_1" else 2
        qs = torch.from_numpy(np.ascontiguousarray(b[..., first_q:]))
        return cls(kind, qs, scale(0), scale(2) if kind == "Q4_1" else None)

    def permute_rows(self, order: np.ndarray) -> "GGUFBlocks":
        """The same weight with its rows (output features) reordered: row i of the result is row order[i]."""
        idx = torch.as_tensor(np.asarray(order), dtype=torch.long)
        return GGUFBlocks(self.kind, self.qs[idx].contiguous(), self.d[idx].contiguous(),
                          None if self.m is None else self.m[idx].contiguous())

    def dequantize(self) -> torch.Tensor:
        """(N, K) float32, by the same rule as gguf.quants (for tests and for checking a copy)."""
        N, K = self.shape
        d = self.d[..., None]
        if self.kind == "Q8_0":
            return (self.qs.view(torch.int8).float() * d).reshape(N, K)
        q = torch.cat([self.qs & 15, self.qs >> 4], dim=-1).float()  # weights 0-15, then 16-31
        w = d * (q - 8) if self.kind == "Q4_0" else d * q + self.m[..., None]
        return w.reshape(N, K)
