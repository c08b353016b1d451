"""vLLM's ``dtype`` strings ("auto", "float32", "half", ...) as torch dtypes, for ``LLM(dtype=...)``
and ``minipaged serve --dtype``."""
from __future__ import annotations

import torch

DTYPES = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}
CHOICES = ("auto", "float32", "float", "float16", "half", "bfloat16")


def resolve_dtype(dtype: "torch.dtype | str | None") -> torch.dtype:
    """A torch dtype, or one of vLLM's names. "auto" (and None) is float32: minipaged computes in
    fp32 unless asked (GGUF weights are dequantised, and bf16 matmuls are slow on a CPU)."""
    if dtype is None or dtype == "auto":
        return torch.float32
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype {dtype} is not one minipaged computes in: use float32, float16 or bfloat16")
        return dtype
    if isinstance(dtype, str):
        key = dtype.lower().removeprefix("torch.")
        if key in DTYPES:
            return DTYPES[key]
    raise ValueError(f"dtype must be a torch dtype or one of {', '.join(CHOICES)}; got {dtype!r}")
