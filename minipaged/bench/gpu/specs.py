"""The spec tables: GPUs (memory, HBM bandwidth, dense fp16/bf16 rate) and models (their shapes).

Owns numbers only, each with its source. Every GPU figure is the vendor's datasheet figure
for the SXM/PCIe part named; every model figure is the model's published ``config.json``
(Hugging Face hub) or its paper. Nothing here is measured on this machine.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass

GiB = 1 << 30


@dataclass(frozen=True)
class GPUSpec:
    """One accelerator as its datasheet states it.

    ``memory_bytes``: HBM/GDDR capacity ("40GB" on a datasheet is 40 GiB of HBM as the driver
    reports it, 40,960 MiB); ``bandwidth``: memory bandwidth in bytes/s; ``peak_flops``: dense
    (no sparsity) fp16/bf16 tensor-core rate in FLOP/s.
    """

    name: str
    memory_bytes: int
    bandwidth: float
    peak_flops: float
    source: str


@dataclass(frozen=True)
class ModelSpec:
    """One decoder-only transformer's shape, from its published config.

    ``num_params``: the published parameter count; ``mlp``: ``"gated"`` (Llama: gate, up, down)
    or ``"plain"`` (OPT: fc1, fc2); ``tied_embeddings``: the LM head is the embedding table;
    ``max_len``: the context the model was trained for (``max_position_embeddings``).
    """

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_len: int
    num_params: int
    mlp: str
    tied_embeddings: bool
    source: str
    dtype_bytes: int = 2  # fp16/bf16 weights and KV, as the paper serves them
    kv_dtype_bytes: int | None = None  # the KV pages' bytes per value when not the weights' (kv_cache_dtype fp8: 1)

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V, every layer, every KV head: 2 x layers x kv_heads x head_dim x KV dtype bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * (self.kv_dtype_bytes or self.dtype_bytes)

    def shape_params(self) -> int:
        """The parameter count the shape implies (matrices only, no biases or norms): a check on
        the published figure and on this table's numbers."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h
        mlp = (3 if self.mlp == "gated" else 2) * h * self.intermediate_size
        emb = self.vocab_size * h * (1 if self.tied_embeddings else 2)
        return self.num_layers * (attn + mlp) + emb

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights held in GPU memory: every parameter at ``dtype_bytes``."""
        return self.num_params * self.dtype_bytes

    @property
    def weight_bytes_read_per_step(self) -> int:
        """Bytes of weights one forward pass reads: all of them, less the input embedding
        table when it is not the LM head (only the rows of the step's tokens are gathered)."""
        skip = 0 if self.tied_embeddings else self.vocab_size * self.hidden_size
        return (self.num_params - skip) * self.dtype_bytes


_NV = "NVIDIA datasheet: "
GPUS: dict[str, GPUSpec] = {g.name: g for g in (
    GPUSpec("a100-40gb", 40 * GiB, 1555e9, 312e12,
            _NV + "NVIDIA A100 Tensor Core GPU (A100 40GB SXM: 1,555 GB/s HBM2, 312 TFLOPS FP16 tensor, dense)"),
    GPUSpec("a100-80gb", 80 * GiB, 2039e9, 312e12,
            _NV + "NVIDIA A100 Tensor Core GPU (A100 80GB SXM: 2,039 GB/s HBM2e, 312 TFLOPS FP16 tensor, dense)"),
    GPUSpec("h100-sxm", 80 * GiB, 3.35e12, 989e12,
            _NV + "NVIDIA H100 Tensor Core GPU (H100 SXM: 80GB, 3.35 TB/s HBM3, 1,979 TFLOPS FP16 with sparsity = 989 dense)"),
    GPUSpec("h200", 141 * GiB, 4.8e12, 989e12,
            _NV + "NVIDIA H200 Tensor Core GPU (H200 SXM: 141GB, 4.8 TB/s HBM3e, 1,979 TFLOPS FP16 with sparsity = 989 dense)"),
    GPUSpec("l4", 24 * GiB, 300e9, 121e12,
            _NV + "NVIDIA L4 Tensor Core GPU (24GB GDDR6, 300 GB/s, 242 TFLOPS FP16 with sparsity = 121 dense)"),
    GPUSpec("t4", 16 * GiB, 320e9, 65e12,
            _NV + "NVIDIA T4 Tensor Core GPU (16GB GDDR6, 320 GB/s, 65 TFLOPS FP16/FP32 mixed precision)"),
)}

_HF = "Hugging Face config.json of "
MODELS: dict[str, ModelSpec] = {m.name: m for m in (
    # OPT: 2,048 learned positions (+2 offset rows), fc1/fc2 MLP, tied LM head; 12.85e9 parameters.
    ModelSpec("opt-13b", 40, 5120, 40, 40, 128, 20480, 50272, 2048, 12_853_000_000, "plain", True,
              _HF + "facebook/opt-13b; Zhang et al., OPT (2022), Table 1"),
    # LLaMA (1) 13B, the paper's model for the shared-prefix figure (§6.4): Llama 2 13B's shape, 2,048 positions.
    ModelSpec("llama-13b", 40, 5120, 40, 40, 128, 13824, 32000, 2048, 13_016_000_000, "gated", False,
              "Touvron et al., LLaMA (2023), Table 2 (13B: 40 layers, 5,120 wide, 40 heads, 2,048 context)"),
    ModelSpec("llama-2-7b", 32, 4096, 32, 32, 128, 11008, 32000, 4096, 6_738_000_000, "gated", False,
              _HF + "meta-llama/Llama-2-7b-hf; Touvron et al., Llama 2 (2023)"),
    ModelSpec("llama-2-13b", 40, 5120, 40, 40, 128, 13824, 32000, 4096, 13_016_000_000, "gated", False,
              _HF + "meta-llama/Llama-2-13b-hf; Touvron et al., Llama 2 (2023)"),
    # Grouped-query attention: 64 query heads share 8 KV heads. 68.98e9 parameters (the "70B").
    ModelSpec("llama-2-70b", 80, 8192, 64, 8, 128, 28672, 32000, 4096, 68_976_648_192, "gated", False,
              _HF + "meta-llama/Llama-2-70b-hf; Touvron et al., Llama 2 (2023)"),
    ModelSpec("smollm2-135m", 30, 576, 9, 3, 64, 1536, 49152, 8192, 134_515_008, "gated", True,
              _HF + "HuggingFaceTB/SmolLM2-135M-Instruct"),
)}


def _lookup(table: dict, name: str, what: str):
    key = name.strip().lower()
    if key in table:
        return table[key]
    near = difflib.get_close_matches(key, list(table), n=1)
    hint = f" Did you mean {near[0]!r}?" if near else ""
    raise ValueError(f"unknown {what} {name!r}.{hint} Known: {', '.join(table)}")


def get_gpu(name: str | GPUSpec) -> GPUSpec:
    """The GPU called ``name`` (an unknown name is a ValueError that lists the known ones)."""
    return name if isinstance(name, GPUSpec) else _lookup(GPUS, name, "GPU")


def get_model(name: str | ModelSpec) -> ModelSpec:
    """The model called ``name`` (an unknown name is a ValueError that lists the known ones)."""
    return name if isinstance(name, ModelSpec) else _lookup(MODELS, name, "model")
