"""KV-cache arithmetic: bytes per token, the memory of a device, how many sequences fit, waste.

Owns plain numbers only (no tensors, no allocator): what a model's weights and KV cost, and
what contiguous max-length reservation wastes next to paged allocation. Pictures of these
numbers are in viz.py; the live allocator's state is in trace.py.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Sequence as Seq

import torch

from .kv_cache import dtype_bytes, kv_bytes_per_token, kv_scale_bytes_per_block

GiB = 2**30
MiB = 2**20
KiB = 2**10

# Bytes per element. fp32/fp16/bf16 go through kv_cache.dtype_bytes (the engine's own table);
# fp8/int8/int4 are here so the calculator can show what quantised weights or KV would buy.
_TORCH_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}
_SMALL_DTYPES = {"fp8": 1.0, "float8": 1.0, "int8": 1.0, "int4": 0.5, "q4": 0.5,
                 "fp8_e4m3": 1.0, "fp8_e5m2": 1.0}  # kv_cache_dtype's names (kv_quant.py)


def element_bytes(dtype: str | torch.dtype) -> float:
    """Bytes of one element: 'float32' -> 4, 'fp16'/'bf16' -> 2, 'fp8'/'int8' -> 1, 'int4' -> 0.5."""
    if isinstance(dtype, torch.dtype):
        return float(dtype_bytes(dtype))
    key = str(dtype).lower().removeprefix("torch.")
    if key in _TORCH_DTYPES:
        return float(dtype_bytes(_TORCH_DTYPES[key]))
    if key in _SMALL_DTYPES:
        return _SMALL_DTYPES[key]
    raise ValueError(
        f"unknown dtype {dtype!r}: use one of {sorted(set(_TORCH_DTYPES) | set(_SMALL_DTYPES))} or a torch dtype"
    )


# -- models ------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelConfig:
    """The few numbers of a decoder-only model that decide its memory.

    KV per token depends only on ``num_layers``, ``num_kv_heads`` and ``head_dim`` (grouped-query
    attention makes ``num_kv_heads`` smaller than ``num_heads``); weights only on ``num_params``.
    """

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_params: int
    num_heads: int | None = None
    hidden_size: int | None = None
    max_position: int | None = None  # the model's context length

    def __post_init__(self) -> None:
        for f in ("num_layers", "num_kv_heads", "head_dim", "num_params"):
            v = getattr(self, f)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"ModelConfig {self.name!r}: {f} must be a positive int, got {v!r}")


MODEL_CONFIGS: dict[str, ModelConfig] = {
    c.name: c
    for c in (
        ModelConfig("SmolLM2-135M", num_layers=30, num_kv_heads=3, head_dim=64, num_params=134_515_008,
                    num_heads=9, hidden_size=576, max_position=8192),
        ModelConfig("Qwen2.5-0.5B", num_layers=24, num_kv_heads=2, head_dim=64, num_params=494_032_768,
                    num_heads=14, hidden_size=896, max_position=32768),
        ModelConfig("Llama-2-7B", num_layers=32, num_kv_heads=32, head_dim=128, num_params=6_738_415_616,
                    num_heads=32, hidden_size=4096, max_position=4096),
        ModelConfig("Llama-3-8B", num_layers=32, num_kv_heads=8, head_dim=128, num_params=8_030_261_248,
                    num_heads=32, hidden_size=4096, max_position=8192),
    )
}


def custom_model(
    num_params: float,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    name: str = "custom",
    **extra,
) -> ModelConfig:
    """A model of your own: ``custom_model(3e9, num_layers=28, num_kv_heads=8, head_dim=128)``."""
    return ModelConfig(name=name, num_layers=int(num_layers), num_kv_heads=int(num_kv_heads),
                       head_dim=int(head_dim), num_params=int(round(num_params)), **extra)


def get_model(model: str | ModelConfig) -> ModelConfig:
    """A ModelConfig from itself or from a name in MODEL_CONFIGS (case-insensitive)."""
    if isinstance(model, ModelConfig):
        return model
    for name, cfg in MODEL_CONFIGS.items():
        if name.lower() == str(model).lower():
            return cfg
    raise KeyError(f"unknown model {model!r}: use one of {list(MODEL_CONFIGS)} or build one with custom_model(...)")


# -- bytes -------------------------------------------------------------------------------
def token_kv_bytes(model: str | ModelConfig, kv_dtype: str | torch.dtype = "float16") -> int:
    """K and V of one token across all layers: 2 * layers * kv_heads * head_dim * bytes per element."""
    m = get_model(model)
    nbytes = element_bytes(kv_dtype)
    if nbytes in (2.0, 4.0):
        return kv_bytes_per_token(m.num_layers, m.num_kv_heads, m.head_dim,
                                  torch.float32 if nbytes == 4.0 else torch.float16)
    return int(math.ceil(2 * m.num_layers * m.num_kv_heads * m.head_dim * nbytes))


def block_kv_bytes(model: str | ModelConfig, block_size: int = 16, kv_dtype: str | torch.dtype = "float16") -> int:
    """One block of ``block_size`` tokens across all layers, with the scales stored beside it:
    ``kv_dtype="int8"`` (kv_cache_dtype's name) keeps one fp32 scale per (block, KV head) for K and
    for V in every layer, as the engine's pages do (kv_cache.kv_scale_bytes_per_block); fp8's
    per-layer scales belong to no block."""
    m = get_model(model)
    if int(block_size) < 1:
        raise ValueError(f"block_size must be a positive number of tokens, got {block_size!r}")
    scales = 0
    if isinstance(kv_dtype, str) and kv_dtype.lower() == "int8":
        scales = kv_scale_bytes_per_block(m.num_layers, m.num_kv_heads, "int8")
    return token_kv_bytes(model, kv_dtype) * int(block_size) + scales


def sequence_kv_bytes(model: str | ModelConfig, num_tokens: int, kv_dtype: str | torch.dtype = "float16") -> int:
    """KV of one sequence of ``num_tokens`` tokens (what a contiguous cache reserves for max_len)."""
    return num_tokens * token_kv_bytes(model, kv_dtype)


def weights_bytes(model: str | ModelConfig, dtype: str | torch.dtype = "float16") -> int:
    """Bytes of the weights: parameters * bytes per parameter (no quantisation scales counted)."""
    return int(math.ceil(get_model(model).num_params * element_bytes(dtype)))


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks a paged cache gives a sequence of ``num_tokens`` tokens: ceil(num_tokens / block_size)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    return -(-int(num_tokens) // block_size)


# -- the device --------------------------------------------------------------------------
@dataclass(frozen=True)
class MemoryBreakdown:
    """Where a device's memory goes: weights, overhead, and a KV budget (reserved + free).

    ``kv_reserved_bytes`` is the part of the budget handed to sequences, ``kv_used_bytes`` the
    part of that holding real tokens; reserved - used is waste. ``overhead_bytes`` stands for
    activations, the CUDA context and the allocator's own fragmentation.
    """

    device_bytes: int
    weights_bytes: int
    overhead_bytes: int
    kv_budget_bytes: int
    kv_reserved_bytes: int = 0
    kv_used_bytes: int = 0
    label: str = ""

    @property
    def free_bytes(self) -> int:
        return self.kv_budget_bytes - self.kv_reserved_bytes

    @property
    def kv_wasted_bytes(self) -> int:
        return self.kv_reserved_bytes - self.kv_used_bytes

    @property
    def fits(self) -> bool:
        """False when the weights and overhead alone exceed the device."""
        return self.weights_bytes + self.overhead_bytes <= self.device_bytes

    def with_kv(self, reserved_bytes: int, used_bytes: int | None = None, label: str | None = None) -> "MemoryBreakdown":
        """The same device with ``reserved_bytes`` of the KV budget handed out (``used_bytes`` holding tokens)."""
        used = reserved_bytes if used_bytes is None else used_bytes
        if not 0 <= used <= reserved_bytes <= self.kv_budget_bytes:
            raise ValueError(
                f"need 0 <= used ({used}) <= reserved ({reserved_bytes}) <= KV budget ({self.kv_budget_bytes}) bytes"
            )
        return replace(self, kv_reserved_bytes=int(reserved_bytes), kv_used_bytes=int(used),
                       label=self.label if label is None else label)

    def as_gib(self) -> dict[str, float]:
        return {
            "device": self.device_bytes / GiB, "weights": self.weights_bytes / GiB,
            "kv_used": self.kv_used_bytes / GiB, "kv_wasted": self.kv_wasted_bytes / GiB,
            "free": self.free_bytes / GiB, "overhead": self.overhead_bytes / GiB,
        }


def memory_breakdown(
    device_bytes: int,
    model: str | ModelConfig,
    weights_dtype: str | torch.dtype = "float16",
    overhead_fraction: float = 0.1,
    kv_reserved_bytes: int = 0,
    kv_used_bytes: int | None = None,
    label: str = "",
) -> MemoryBreakdown:
    """Split ``device_bytes`` into weights, overhead (``overhead_fraction`` of the device) and KV.

    The KV budget is what is left: device - weights - overhead (0 if the model does not fit),
    the number vLLM computes at start-up from ``gpu_memory_utilization``.
    """
    if not 0 <= overhead_fraction < 1:
        raise ValueError(f"overhead_fraction must be in [0, 1), got {overhead_fraction}")
    device_bytes = int(device_bytes)
    w = weights_bytes(model, weights_dtype)
    overhead = int(device_bytes * overhead_fraction)
    budget = max(0, device_bytes - w - overhead)
    b = MemoryBreakdown(device_bytes, w, overhead, budget, label=label)
    return b.with_kv(kv_reserved_bytes, kv_used_bytes) if kv_reserved_bytes else b


# -- how many sequences fit --------------------------------------------------------------
def _as_lengths(lengths: int | Seq[int]) -> list[int]:
    ls = [int(lengths)] if isinstance(lengths, (int, float)) else [int(x) for x in lengths]
    if not ls or min(ls) < 1:
        raise ValueError(f"lengths must be one or more positive token counts, got {lengths!r}")
    return ls


def contiguous_seqs_that_fit(kv_budget_bytes: int, model: str | ModelConfig, max_len: int,
                             kv_dtype: str | torch.dtype = "float16") -> int:
    """Sequences that fit when each reserves ``max_len`` tokens up front, whatever it will use."""
    return int(kv_budget_bytes) // sequence_kv_bytes(model, max_len, kv_dtype)


def _take_in_order(capacity: int, costs: list[int]) -> tuple[int, int]:
    """Admit items costing ``costs`` (repeating the list) until the next does not fit.

    Returns (items admitted, total cost). Whole cycles are counted arithmetically, so a budget
    of millions of tokens costs O(len(costs)).
    """
    cycle = sum(costs)
    full = capacity // cycle
    n, spent = full * len(costs), full * cycle
    for c in costs:
        if spent + c > capacity:
            break
        n, spent = n + 1, spent + c
    return n, spent


def paged_seqs_that_fit(kv_budget_bytes: int, model: str | ModelConfig, lengths: int | Seq[int],
                        block_size: int = 16, kv_dtype: str | torch.dtype = "float16") -> int:
    """Sequences that fit when each holds only ceil(length / block_size) blocks.

    ``lengths`` is one length for all, or a list taken in order (and repeated) until the next
    sequence's blocks do not fit in the pool.
    """
    num_blocks = int(kv_budget_bytes) // block_kv_bytes(model, block_size, kv_dtype)
    return _take_in_order(num_blocks, [blocks_for(n, block_size) for n in _as_lengths(lengths)])[0]


def contiguous_waste(lengths: int | Seq[int], max_len: int) -> float:
    """Reserved-but-unused / reserved when each sequence reserves ``max_len`` slots."""
    ls = _as_lengths(lengths)
    if max(ls) > max_len:
        raise ValueError(f"a length of {max(ls)} tokens does not fit a contiguous reservation of max_len={max_len}")
    return 1.0 - sum(ls) / (len(ls) * max_len)


def paged_waste(lengths: int | Seq[int], block_size: int = 16) -> float:
    """Reserved-but-unused / reserved with paging: only the last block of each sequence is part-empty."""
    ls = _as_lengths(lengths)
    return 1.0 - sum(ls) / sum(blocks_for(n, block_size) * block_size for n in ls)


@dataclass(frozen=True)
class Concurrency:
    """Contiguous vs paged on one KV budget: sequences that fit, bytes reserved and used, waste."""

    kv_budget_bytes: int
    bytes_per_token: int
    block_size: int
    max_len: int
    num_blocks: int
    contiguous_seqs: int
    paged_seqs: int
    contiguous_waste: float
    paged_waste: float
    contiguous_reserved_bytes: int
    contiguous_used_bytes: int
    paged_reserved_bytes: int
    paged_used_bytes: int

    @property
    def gain(self) -> float:
        """How many times more sequences paging fits (inf if contiguous fits none)."""
        if self.contiguous_seqs == 0:
            return math.inf if self.paged_seqs else 1.0
        return self.paged_seqs / self.contiguous_seqs


def concurrency(
    kv_budget_bytes: int,
    model: str | ModelConfig,
    lengths: int | Seq[int],
    max_len: int,
    block_size: int = 16,
    kv_dtype: str | torch.dtype = "float16",
) -> Concurrency:
    """How many sequences of the actual ``lengths`` fit ``kv_budget_bytes``, contiguous vs paged.

    Contiguous reserves ``max_len`` tokens per sequence; paged reserves whole blocks for the
    tokens each really has. ``lengths`` is one length or a list taken in order (and repeated).
    """
    ls = _as_lengths(lengths)
    bpt = token_kv_bytes(model, kv_dtype)
    kv_budget_bytes = int(kv_budget_bytes)
    per_block = block_kv_bytes(model, block_size, kv_dtype)
    num_blocks = kv_budget_bytes // per_block
    n_c = contiguous_seqs_that_fit(kv_budget_bytes, model, max_len, kv_dtype)
    n_p, blocks_used = _take_in_order(num_blocks, [blocks_for(n, block_size) for n in ls])
    c_waste = contiguous_waste(ls, max_len)

    def tokens_of_first(n: int) -> int:
        full, rest = divmod(n, len(ls))
        return full * sum(ls) + sum(ls[:rest])

    return Concurrency(
        kv_budget_bytes=kv_budget_bytes, bytes_per_token=bpt, block_size=block_size, max_len=max_len,
        num_blocks=num_blocks, contiguous_seqs=n_c, paged_seqs=n_p,
        contiguous_waste=c_waste, paged_waste=paged_waste(ls, block_size),
        contiguous_reserved_bytes=n_c * max_len * bpt, contiguous_used_bytes=tokens_of_first(n_c) * bpt,
        paged_reserved_bytes=blocks_used * per_block, paged_used_bytes=tokens_of_first(n_p) * bpt,
    )


def format_bytes(n: float) -> str:
    """1536 -> '1.5 KiB', 5 * 2**30 -> '5.00 GiB'."""
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= size:
            v = n / size
            return f"{v:.2f} {unit}" if unit == "GiB" else f"{v:.4g} {unit}"
    return f"{int(n)} B"


# -- the seed's scenario, recomputed -----------------------------------------------------
GB = 10**9  # the seed page speaks in decimal gigabytes (40 GB, 14 GB); GiB = 2**30 is used elsewhere


@dataclass(frozen=True)
class SeedClaim:
    """One figure of the explainer page the course started from, next to what this module computes.

    ``verdict`` is "reproduced" (within 5%), "off" (same quantity, another value: ``off_by`` is
    claimed / recomputed), "inconsistent" (it contradicts another of the page's own figures), or
    "no method" (a measurement given without a method: only its arithmetic can be checked).
    """

    number: int
    claim: str
    claimed: float
    recomputed: float
    verdict: str
    note: str

    @property
    def off_by(self) -> float:
        return self.claimed / self.recomputed if self.recomputed else math.inf


def _verdict(claimed: float, recomputed: float, tol: float = 0.05) -> str:
    return "reproduced" if abs(claimed - recomputed) <= tol * abs(recomputed) else "off"


def seed_scenario(device_gb: float = 40, overhead_gb: float = 2, max_len: int = 2048) -> dict:
    """The seed page's scenario (a 40 GB GPU, a 7B fp16 model, 2,048-token sequences), every figure recomputed.

    Returns the recomputed figures (``figures``) and one SeedClaim per claim of the page
    (``claims``, numbered as in the course's list of seed claims). Only arithmetic: the model
    shape is Llama-2-7B's (32 layers, 32 KV heads, head_dim 128); "7B" weights are 7e9 x 2 bytes.
    """
    llama = get_model("Llama-2-7B")
    nominal = custom_model(7e9, llama.num_layers, llama.num_kv_heads, llama.head_dim, name="7B (nominal)")
    weights = weights_bytes(nominal, "float16")
    device, overhead = int(device_gb * GB), int(overhead_gb * GB)
    kv_budget = device - weights - overhead
    per_token = token_kv_bytes(llama, "float16")
    per_seq = sequence_kv_bytes(llama, max_len, "float16")
    contiguous = contiguous_seqs_that_fit(kv_budget, llama, max_len)
    # the page's 60% contiguous waste means sequences hold 40% of max_len on average
    mean_len_60 = round(0.4 * max_len)
    paged_at_60 = paged_seqs_that_fit(kv_budget, llama, mean_len_60, 16)
    # the page's 24 paged sequences in 24 GB means each holds this many tokens
    len_for_24 = min(max_len, (kv_budget // 24) // per_token)
    tput = {"naive": 840.0, "static": 1820.0, "continuous": 2576.0, "continuous_elsewhere": 2800.0}
    fig = {
        "device_bytes": device, "weights_bytes": weights, "weights_bytes_llama2": weights_bytes(llama, "float16"),
        "overhead_bytes": overhead, "kv_budget_bytes": kv_budget, "kv_bytes_per_token": per_token,
        "kv_bytes_per_sequence": per_seq, "contiguous_seqs": contiguous,
        "reservation_bytes_for_9": kv_budget / 9, "tokens_per_reservation_for_9": kv_budget / 9 / per_token,
        "mean_len_for_60pct_waste": mean_len_60, "paged_seqs_at_60pct_lengths": paged_at_60,
        "paged_waste_at_60pct_lengths": paged_waste(mean_len_60, 16),
        "tokens_per_seq_for_24_paged": len_for_24, "contiguous_waste_for_24_paged": contiguous_waste(len_for_24, max_len),
        "paged_waste_for_24_paged": paged_waste(len_for_24, 16),
        "continuous_over_static": tput["continuous"] / tput["static"],
        "continuous_over_naive": tput["continuous"] / tput["naive"],
        "static_over_naive": tput["static"] / tput["naive"],
        "elsewhere_over_naive": tput["continuous_elsewhere"] / tput["naive"],
        "paged_over_contiguous_claimed": 24 / 9,
    }
    gb = lambda b: b / GB  # noqa: E731
    claims = [
        SeedClaim(1, "model weights take 14 GB", 14, gb(weights), _verdict(14, gb(weights)),
                  f"7e9 x 2 bytes = {gb(weights):.1f} GB; Llama-2-7B's {llama.num_params / 1e9:.2f}B parameters "
                  f"take {gb(fig['weights_bytes_llama2']):.2f} GB"),
        SeedClaim(2, "24 GB for the KV cache (2 GB overhead)", 24, gb(kv_budget), _verdict(24, gb(kv_budget)),
                  f"40 - 14 - 2 = {gb(kv_budget):.0f} GB; the same page's '~26 GB for KV' forgets the overhead "
                  "(inconsistent by 2 GB)"),
        SeedClaim(3, "contiguous serving: 9 sequences", 9, contiguous, "inconsistent",
                  f"{per_token // KiB} KiB per token x {max_len} = {per_seq / GiB:.0f} GiB per reservation: "
                  f"24 GB holds {contiguous}, not 9 (9 would need {fig['tokens_per_reservation_for_9']:,.0f}-token "
                  "reservations)"),
        SeedClaim(4, "paged: 24 sequences, 4% wasted", 24, paged_at_60, "inconsistent",
                  f"with claim 3's 60% waste (sequences of ~{mean_len_60} tokens) paging fits {paged_at_60}, "
                  f"wasting {paged_waste(mean_len_60, 16):.1%}; 24 sequences fill 24 GB only at "
                  f"{len_for_24:,} tokens each, where contiguous would waste {fig['contiguous_waste_for_24_paged']:.0%}, "
                  "not 60%"),
        SeedClaim(5, "paging fits '3-4x' more", 3.5, 24 / 9, _verdict(3.5, 24 / 9),
                  f"the page's own 24 / 9 = {24 / 9:.2f}x; recomputed with claim 3's lengths: "
                  f"{paged_at_60} / {contiguous} = {paged_at_60 / contiguous:.1f}x"),
        SeedClaim(6, "page table: 4 sequences share 20 pages of 16 tokens", 20 * 16, 20 * 16, "reproduced",
                  "20 x 16 = 320 token slots; lesson 03 serves SmolLM2 on exactly this pool, 4 sequences at a time, "
                  "and a finished sequence's pages return to the pool in the same step"),
        SeedClaim(7, "continuous 2,576 vs static 1,820 tok/s", 2576 / 1820, fig["continuous_over_static"], "no method",
                  f"2,576 / 1,820 = {fig['continuous_over_static']:.2f}x; 2,576 / 840 = {fig['continuous_over_naive']:.2f}x "
                  "(arithmetic only: no method is given)"),
        SeedClaim(8, "vLLM 2,800 tok/s, '3.3x' over 840 naive", 2800, 2576, "inconsistent",
                  f"2,800 / 840 = {fig['elsewhere_over_naive']:.2f}x, but claim 7 gives vLLM 2,576 tok/s "
                  f"({2800 / 2576 - 1:.1%} apart)"),
        SeedClaim(9, "continuous batching gives '2-5x' over static", 2.0, fig["continuous_over_static"], "inconsistent",
                  f"the page's own figures give {fig['continuous_over_static']:.2f}x (claim 7), below the low end of 2-5x"),
        SeedClaim(10, "contiguous serving wastes 60% of memory", 0.60, 1 - 0.382, _verdict(0.60, 1 - 0.382),
                  "the vLLM paper measured 20.4-38.2% of KV memory holding tokens in earlier systems: "
                  "61.8-79.6% wasted, so 60% is just below that range"),
    ]
    return {"figures": fig, "claims": claims}
