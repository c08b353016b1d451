"""The cost model: how much KV fits on a GPU, and how long one engine step takes there.

Owns two pieces of arithmetic and every constant they use, each named with its reason:

* KV room = GPU memory x utilisation - weights - activation reserve (:func:`memory_plan`);
* step time = max(bytes moved / bandwidth, FLOPs / peak) + overheads (:class:`StepCostModel`),
  a roofline: a decode step reads every weight once and every sequence's whole context of
  K and V, so attention's cost grows with the context read.

Nothing here runs a model; the simulator calls :meth:`StepCostModel.step_time` once per step.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from .specs import GPUSpec, ModelSpec, get_gpu, get_model

# vLLM's default share of GPU memory it may use (EngineArgs.gpu_memory_utilization = 0.9); the
# rest is left to the CUDA context, the allocator's fragmentation and other processes.
GPU_MEMORY_UTILIZATION = 0.9
# vLLM's defaults when the paper ran (v0.1): at most 256 sequences and 2,560 tokens per step.
MAX_NUM_SEQS = 256
MAX_NUM_BATCHED_TOKENS = 2560
# Logits are kept in fp32 for sampling.
LOGIT_BYTES = 4


@dataclass(frozen=True)
class MemoryPlan:
    """Where a GPU's memory goes: every term in bytes, and the KV room left in tokens."""

    gpu: str
    model: str
    usable_bytes: int  # memory x utilisation
    weight_bytes: int
    activation_bytes: int
    kv_bytes: int
    kv_bytes_per_token: int
    kv_tokens: int

    def lines(self) -> list[str]:
        g = 1e9
        return [f"{self.gpu}: {self.usable_bytes / g:.2f} GB usable ({GPU_MEMORY_UTILIZATION:.0%} of memory)",
                f"  - weights {self.weight_bytes / g:.2f} GB ({self.model})",
                f"  - activation reserve {self.activation_bytes / g:.2f} GB",
                f"  = KV {self.kv_bytes / g:.2f} GB / {self.kv_bytes_per_token / 1e3:.1f} kB per token "
                f"= {self.kv_tokens:,} token slots"]


def activation_reserve_bytes(model: ModelSpec, max_num_batched_tokens: int = MAX_NUM_BATCHED_TOKENS,
                             max_num_seqs: int = MAX_NUM_SEQS) -> int:
    """The peak activations of one forward pass over a full step, as vLLM profiles it before
    sizing the cache: per token, the residual stream and its normed copy (2 x hidden), Q, K and
    V, and the MLP's intermediate (twice for a gated MLP: gate and up), at the weights' dtype;
    plus fp32 logits for every sequence that samples."""
    q_kv = (model.num_heads + 2 * model.num_kv_heads) * model.head_dim
    mlp = model.intermediate_size * (2 if model.mlp == "gated" else 1)
    per_token = (2 * model.hidden_size + q_kv + mlp) * model.dtype_bytes
    return max_num_batched_tokens * per_token + max_num_seqs * model.vocab_size * LOGIT_BYTES


def memory_plan(gpu: str | GPUSpec, model: str | ModelSpec, memory_bytes: int | None = None,
                utilization: float = GPU_MEMORY_UTILIZATION, max_num_batched_tokens: int = MAX_NUM_BATCHED_TOKENS,
                max_num_seqs: int = MAX_NUM_SEQS) -> MemoryPlan:
    """KV room for ``model`` on ``gpu`` (``memory_bytes`` overrides the GPU's memory, for the
    "what if it had more memory" dial). Raises ValueError, with the numbers, when the weights
    and activations leave no room for the KV cache."""
    g, m = get_gpu(gpu), get_model(model)
    total = g.memory_bytes if memory_bytes is None else int(memory_bytes)
    usable = int(total * utilization)
    act = activation_reserve_bytes(m, max_num_batched_tokens, max_num_seqs)
    kv = usable - m.weight_bytes - act
    if kv < m.kv_bytes_per_token:
        raise ValueError(
            f"{m.name} does not fit on {g.name}: {usable / 1e9:.2f} GB usable ({utilization:.0%} of "
            f"{total / 1e9:.2f} GB) - {m.weight_bytes / 1e9:.2f} GB of weights - {act / 1e9:.2f} GB of activations "
            f"leaves {max(kv, 0) / 1e9:.2f} GB for the KV cache: pick a larger GPU or a smaller model")
    return MemoryPlan(g.name, m.name, usable, m.weight_bytes, act, kv, m.kv_bytes_per_token, kv // m.kv_bytes_per_token)


@dataclass(frozen=True)
class Calibration:
    """The step-time model's constants; one set for every GPU, model and figure.

    * ``bandwidth_efficiency``: the share of datasheet bandwidth a whole decode step's reads
      reach. A STREAM-like copy reaches about 90% on an A100; a step is dozens of kernels per
      layer, each with a ramp-up and a tail, and 2023-era attention kernels (vLLM v0.1's
      paged kernel, FasterTransformer's) reached well under the copy rate: we take 0.7.
    * ``compute_efficiency``: the share of dense tensor-core peak that large fp16 GEMMs reach
      (prefill, big batches): 0.6, typical of cuBLAS on A100-class parts at these shapes.
    * ``step_overhead_s``: a fixed cost per step, the serving loop outside the GPU's work
      (scheduling, input preparation, sampling, kernel launches of ~40 layers x ~10 kernels):
      5 ms, the order of vLLM v0.1's Python step loop.
    * ``seq_overhead_s``: a cost per sequence per step (vLLM v0.1 built each sequence's inputs
      and sampled each one in Python): 0.2 ms.
    """

    bandwidth_efficiency: float = 0.7
    compute_efficiency: float = 0.6
    step_overhead_s: float = 0.005
    seq_overhead_s: float = 0.0002


DEFAULT_CALIBRATION = Calibration()


@dataclass(frozen=True)
class StepCost:
    """One step's cost broken down: the roofline's two sides and the overheads, in seconds."""

    bytes_moved: float
    flops: float
    memory_s: float
    compute_s: float
    overhead_s: float

    @property
    def seconds(self) -> float:
        return max(self.memory_s, self.compute_s) + self.overhead_s

    @property
    def bound(self) -> str:
        return "memory" if self.memory_s >= self.compute_s else "compute"


@dataclass
class StepCostModel:
    """Step time of ``model`` on ``gpu`` (or on any machine given its bandwidth and FLOP rate:
    this machine's CPU, for the validation).

    A step is a list of ``(start, num_new)`` pairs, one per scheduled sequence: positions
    ``start .. start + num_new - 1`` are computed against a context of ``start + num_new``
    tokens. Per step:

    * bytes = the weights read once + every sequence's context of K and V read + the new
      tokens' K and V written (activations stay in cache and are left out);
    * FLOPs = 2 x (the layers' weight matrices) per new token + 2 x the LM head per sampled
      sequence + attention, 4 x layers x heads x head_dim per (query, key) pair (QK^T and PV),
      with the causal pairs of a chunk counted exactly.
    """

    gpu: GPUSpec | str
    model: ModelSpec | str
    calibration: Calibration = field(default_factory=Calibration)
    bandwidth: float | None = None  # bytes/s; default: the GPU's datasheet figure
    peak_flops: float | None = None  # FLOP/s; default: the GPU's datasheet figure
    dtype_bytes: int | None = None  # default: the model's (2, fp16)

    def __post_init__(self) -> None:
        self.gpu, self.model = get_gpu(self.gpu), get_model(self.model)
        m = self.model
        self._bw = (self.bandwidth or self.gpu.bandwidth) * self.calibration.bandwidth_efficiency
        self._fl = (self.peak_flops or self.gpu.peak_flops) * self.calibration.compute_efficiency
        db = self.dtype_bytes or m.dtype_bytes
        scale = db / m.dtype_bytes
        self.weight_read = m.weight_bytes_read_per_step * scale
        self.kv_per_token = m.kv_bytes_per_token * scale
        self.body_params = m.shape_params() - m.vocab_size * m.hidden_size * (1 if m.tied_embeddings else 2)
        self.head_params = m.vocab_size * m.hidden_size
        self.attn_flops_per_pair = 4 * m.num_layers * m.num_heads * m.head_dim

    def cost(self, step: Iterable[tuple[int, int]]) -> StepCost:
        """The cost of one step of ``(start, num_new)`` pairs (see the class)."""
        tokens = ctx = pairs = seqs = 0
        for start, n in step:
            tokens += n
            ctx += start + n
            pairs += n * start + n * (n + 1) // 2
            seqs += 1
        return self.cost_of_totals(tokens, ctx, pairs, seqs)

    def cost_of_totals(self, tokens: int, ctx: int, pairs: int, seqs: int) -> StepCost:
        """The cost of a step from its totals: new ``tokens``, the contexts read (``ctx``, the sum
        of ``start + num_new``), the (query, key) ``pairs`` attended and the ``seqs`` scheduled.
        :meth:`cost` sums a step's pairs into these; the simulator's skip-ahead calls this
        directly for decode-only steps (the same integers give the same floats)."""
        if seqs == 0:
            return StepCost(0.0, 0.0, 0.0, 0.0, 0.0)
        nbytes = self.weight_read + (ctx + tokens) * self.kv_per_token
        flops = 2 * self.body_params * tokens + 2 * self.head_params * seqs + self.attn_flops_per_pair * pairs
        c = self.calibration
        return StepCost(nbytes, flops, nbytes / self._bw, flops / self._fl, c.step_overhead_s + c.seq_overhead_s * seqs)

    def step_time(self, step: Iterable[tuple[int, int]]) -> float:
        """Seconds for one step of ``(start, num_new)`` pairs."""
        return self.cost(step).seconds

    def decode_totals_time(self, seqs: int, ctx: int) -> float:
        """Seconds for a decode-only step of ``seqs`` sequences whose contexts sum to ``ctx``
        (each reads ``start + 1`` keys: its ``pairs`` equal its context)."""
        return self.cost_of_totals(seqs, ctx, ctx, seqs).seconds

    def decode_time(self, batch: int, context: int) -> float:
        """Seconds for a pure decode step of ``batch`` sequences with ``context`` tokens each."""
        return self.step_time([(context - 1, 1)] * batch)
