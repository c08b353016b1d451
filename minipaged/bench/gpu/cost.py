"""The cost model: how much KV fits on a GPU, and how long one engine step takes there.

Owns two pieces of arithmetic and every constant they use, each named with its reason:

* KV room = GPU memory x utilisation - weights - activation reserve (:func:`memory_plan`);
* step time = max(bytes moved / bandwidth, FLOPs / peak) + overheads (:class:`StepCostModel`),
  a roofline: a decode step reads every weight once and every sequence's whole context of
  K and V, so attention's cost grows with the context read.

Where the operators can be timed (this machine's CPU, for the validation), measured profiles
replace the roofline's terms, as Vidur (MLSys 2024) profiles each operator at the shapes it runs:
a :class:`LinearProfile` prices the weights (a GEMM library's rate at 2 rows is not a roofline's:
on this CPU PyTorch's fp32 matmul is slower at 2-4 rows than at 8) and an
:class:`AttentionProfile` prices decode attention as the route runs it (the plain route gathers
every sequence's blocks into a padded copy and runs SDPA over it: several passes over K and V,
not the one a paged kernel makes; prefills' attention timed shape by shape where a timer is
given). What no profile covers (K/V writes, and prefills' attention without a timer) and the
overheads stay the roofline's.

Nothing here runs a model; the simulator calls :meth:`StepCostModel.step_time` once per step.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Iterable

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
    * ``token_overhead_s``: a cost per new token that neither the matmuls nor attention carry
      (norms, rotary embedding, the MLP's activation, residual adds): 0 on a GPU, where those
      ops fuse into the roofline's traffic; fitted by the CPU validation, where the plain route
      runs each as its own PyTorch op over the step's activations.
    """

    bandwidth_efficiency: float = 0.7
    compute_efficiency: float = 0.6
    step_overhead_s: float = 0.005
    seq_overhead_s: float = 0.0002
    token_overhead_s: float = 0.0


DEFAULT_CALIBRATION = Calibration()


def _axis(what: str, values: Iterable) -> tuple:
    """A profile's grid axis as ints, refused unless distinct, increasing and >= 1."""
    v = tuple(int(x) for x in values)
    if not v or list(v) != sorted(set(v)) or v[0] < 1:
        raise ValueError(f"{what} must be distinct, increasing and >= 1, got {list(v)}")
    return v


def _interp(xs: tuple, ys: tuple, x: float) -> float:
    """Piecewise-linear through ``(xs, ys)`` (xs increasing); past the last point, the last
    segment's slope (the cost per row keeps growing as it last did), or flat where that slope is
    negative (a noisy measurement: extrapolating it would reach negative times); 0 at x <= 0."""
    if x <= 0:
        return 0.0
    if x <= xs[0]:
        return ys[0] * x / xs[0]
    for i in range(1, len(xs)):
        if x <= xs[i]:
            t = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
            return ys[i - 1] + t * (ys[i] - ys[i - 1])
    if len(xs) == 1:
        return ys[0] * x / xs[0]
    slope = max((ys[-1] - ys[-2]) / (xs[-1] - xs[-2]), 0.0)  # a noisy last segment never prices more rows cheaper
    return ys[-1] + slope * (x - xs[-1])


@dataclass(frozen=True)
class LinearProfile:
    """The linear layers' measured time against rows: ``body_s[i]`` seconds for one step's
    matmuls of every layer but the LM head at ``rows[i]`` tokens, ``head_s[i]`` for the LM head at
    ``rows[i]`` sampled sequences (``minipaged.bench.hardware.linear_profile`` times them on the
    model's own weights). Between rows, linear; past the last, its last slope."""

    rows: tuple
    body_s: tuple
    head_s: tuple
    source: str = "measured"

    def __post_init__(self) -> None:
        r = _axis("a linear profile's rows", self.rows)
        if len(self.body_s) != len(r) or len(self.head_s) != len(r):
            raise ValueError(f"a linear profile needs one body and one head time per row: {len(r)} rows, "
                             f"{len(self.body_s)} body and {len(self.head_s)} head times")
        object.__setattr__(self, "rows", r)
        object.__setattr__(self, "body_s", tuple(float(x) for x in self.body_s))
        object.__setattr__(self, "head_s", tuple(float(x) for x in self.head_s))

    def body(self, tokens: int) -> float:
        return _interp(self.rows, self.body_s, tokens)

    def head(self, seqs: int) -> float:
        return _interp(self.rows, self.head_s, seqs)

    def to_dict(self) -> dict:
        return {"rows": list(self.rows), "body_s": list(self.body_s), "head_s": list(self.head_s),
                "source": self.source}


def _bilinear(xs: tuple, ys: tuple, table: tuple, x: float, y: float) -> float:
    """``table[i][j]`` at ``(xs[i], ys[j])``, interpolated linearly in each direction (and
    extended past the grid's edges by its edge segments, as :func:`_interp`)."""
    col = [_interp(ys, row, y) for row in table]  # along y in every row
    return _interp(xs, tuple(col), x)


@dataclass(frozen=True)
class AttentionProfile:
    """Decode attention's measured time, all layers of one step: ``seconds[i][j]`` for one call
    over ``batches[i]`` sequences whose (padded) context is ``contexts[j]`` tokens each
    (``minipaged.bench.hardware.attention_profile`` times the route's own decode attention).
    ``groups``: the route's rule for which decodes share one call (the padded gather pads each
    call to its longest context), a function of the contexts that returns lists of indices;
    None: all in one call. ``prefill``: a function that times the route's attention, all layers,
    over a step's other sequences (a tuple of ``(start, num_new)`` pairs, each with more than
    one new token), as ``hardware.attention_timer`` does on demand; None: the roofline prices
    them."""

    batches: tuple
    contexts: tuple
    seconds: tuple
    groups: Any = None
    source: str = "measured"
    prefill: Any = None

    def __post_init__(self) -> None:
        for name in ("batches", "contexts"):
            object.__setattr__(self, name, _axis(f"an attention profile's {name}", getattr(self, name)))
        t = tuple(tuple(float(x) for x in row) for row in self.seconds)
        if len(t) != len(self.batches) or any(len(row) != len(self.contexts) for row in t):
            raise ValueError(f"an attention profile needs one time per (batch, context): {len(self.batches)} x "
                             f"{len(self.contexts)}")
        object.__setattr__(self, "seconds", t)

    def call(self, batch: int, context: int) -> float:
        return _bilinear(self.batches, self.contexts, self.seconds, batch, context) if batch > 0 else 0.0

    def decode(self, contexts: list[int]) -> float:
        """Seconds for decodes reading ``contexts`` keys each: one call per group, each padded to
        its longest context."""
        if not contexts:
            return 0.0
        groups = self.groups(contexts) if self.groups is not None else [list(range(len(contexts)))]
        return sum(self.call(len(g), max(contexts[i] for i in g)) for g in groups)

    def to_dict(self) -> dict:
        return {"batches": list(self.batches), "contexts": list(self.contexts),
                "seconds": [list(r) for r in self.seconds], "source": self.source,
                "prefills": "timed" if self.prefill is not None else "roofline"}


@dataclass(frozen=True)
class FusedDecodeProfile:
    """A route that runs a decode-only step as one fused call (minipaged's C whole-step decode:
    every layer and the head in one call) is one operator, so it is profiled as one: ``seconds[i]``
    is a whole pure-decode step of ``batches[i]`` sequences reading ``context`` keys each, measured
    on the route itself, sampling included. Pricing such a step from the linear layers timed one
    call at a time would charge it the per-call costs the fused call does not pay."""

    batches: tuple
    seconds: tuple
    context: int
    source: str = "measured"

    def __post_init__(self) -> None:
        object.__setattr__(self, "batches", _axis("a fused decode profile's batches", self.batches))
        t = tuple(float(x) for x in self.seconds)
        if len(t) != len(self.batches) or self.context < 1:
            raise ValueError(f"a fused decode profile needs one time per batch ({len(self.batches)}) and a context >= 1, "
                             f"got {len(t)} times and context {self.context}")
        object.__setattr__(self, "seconds", t)

    def at(self, batch: int) -> float:
        """The whole step at ``batch`` sequences of ``context`` keys (interpolated between batches)."""
        return _interp(self.batches, self.seconds, batch)

    def to_dict(self) -> dict:
        return {"batches": list(self.batches), "seconds": list(self.seconds), "context": self.context,
                "source": self.source}


@dataclass(frozen=True)
class StepCost:
    """One step's cost broken down, in seconds: the roofline's two sides, the linear layers'
    measured time where a :class:`LinearProfile` gives it (then the roofline covers attention
    only), and the overheads."""

    bytes_moved: float
    flops: float
    memory_s: float
    compute_s: float
    overhead_s: float
    linear_s: float = 0.0
    attention_s: float = 0.0  # decode attention, measured (an AttentionProfile)

    @property
    def seconds(self) -> float:
        return self.linear_s + self.attention_s + max(self.memory_s, self.compute_s) + self.overhead_s

    @property
    def bound(self) -> str:
        """What the largest share is: "linear" or "attention" (measured), else the roofline's side."""
        roof = max(self.memory_s, self.compute_s)
        if max(self.linear_s, self.attention_s) > roof:
            return "linear" if self.linear_s >= self.attention_s else "attention"
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

    With a ``linear_profile``, the weights leave both sides: the body's matmuls cost
    ``profile.body(tokens)`` and the head's ``profile.head(seqs)``, measured, and the roofline
    prices what is left (K and V read and written, attention's FLOPs). With an
    ``attention_profile`` too, the decodes' attention (sequences with one new token) is its
    measured time, group by group, and leaves the roofline, which keeps the prefills' attention
    and every K/V write.
    """

    gpu: GPUSpec | str
    model: ModelSpec | str
    calibration: Calibration = field(default_factory=Calibration)
    bandwidth: float | None = None  # bytes/s; default: the GPU's datasheet figure
    peak_flops: float | None = None  # FLOP/s; default: the GPU's datasheet figure
    dtype_bytes: int | None = None  # default: the model's (2, fp16)
    linear_profile: LinearProfile | None = None  # measured matmul times (the CPU validation); None on a GPU spec
    attention_profile: AttentionProfile | None = None  # measured decode attention (the CPU validation)
    fused_decode: FusedDecodeProfile | None = None  # a route whose pure decode steps are one fused call

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
        fd = self.fused_decode
        if fd is not None:
            step = list(step)
            if step and all(n == 1 and start > 0 for start, n in step):
                return self._fused(fd, [start + 1 for start, _ in step])
        tokens = ctx = pairs = seqs = 0
        decodes: list[int] = []
        ap = self.attention_profile
        rest: list[tuple[int, int]] = []
        for start, n in step:
            tokens += n
            seqs += 1
            if ap is not None and n == 1:
                decodes.append(start + 1)  # measured below; its K/V write stays on the roofline
                continue
            if ap is not None and ap.prefill is not None and n > 0:
                rest.append((start, n))  # measured below too
                continue
            ctx += start + n
            pairs += n * start + n * (n + 1) // 2
        if ap is None:
            return self.cost_of_totals(tokens, ctx, pairs, seqs)
        c = self._cost(tokens, ctx, pairs, seqs)
        measured = ap.decode(decodes) + (ap.prefill(tuple(rest)) if rest else 0.0)
        return replace(c, attention_s=measured)

    def _fused(self, fd: FusedDecodeProfile, contexts: list[int]) -> StepCost:
        """A pure decode step on a fused route: the whole step measured at its batch, its attention
        moved from the profile's context to the step's own by the attention profile (where given)."""
        ap, b = self.attention_profile, len(contexts)
        attention = ap.decode(contexts) if ap is not None else 0.0
        at_profile = ap.decode([fd.context] * b) if ap is not None else 0.0
        return StepCost(0.0, 0.0, 0.0, 0.0, 0.0, linear_s=max(fd.at(b) - at_profile, 0.0), attention_s=attention)

    def cost_of_totals(self, tokens: int, ctx: int, pairs: int, seqs: int) -> StepCost:
        """The cost of a step from its totals: new ``tokens``, the contexts read (``ctx``, the sum
        of ``start + num_new``), the (query, key) ``pairs`` attended and the ``seqs`` scheduled.
        :meth:`cost` sums a step's pairs into these; the simulator's skip-ahead calls this
        directly for decode-only steps (the same integers give the same floats)."""
        if self.attention_profile is not None:
            raise ValueError("a measured attention profile prices each group of decodes by its longest context: "
                             "call cost() with the step's (start, num_new) pairs (simulator.run(skip_ahead=False))")
        return self._cost(tokens, ctx, pairs, seqs)

    def _cost(self, tokens: int, ctx: int, pairs: int, seqs: int) -> StepCost:
        if seqs == 0:
            return StepCost(0.0, 0.0, 0.0, 0.0, 0.0)
        c = self.calibration
        overhead = c.step_overhead_s + c.seq_overhead_s * seqs + c.token_overhead_s * tokens
        kv_bytes = (ctx + tokens) * self.kv_per_token
        attn_flops = self.attn_flops_per_pair * pairs
        lp = self.linear_profile
        if lp is not None:
            return StepCost(kv_bytes, attn_flops, kv_bytes / self._bw, attn_flops / self._fl, overhead,
                            lp.body(tokens) + lp.head(seqs))
        nbytes = self.weight_read + kv_bytes
        flops = 2 * self.body_params * tokens + 2 * self.head_params * seqs + attn_flops
        return StepCost(nbytes, flops, nbytes / self._bw, flops / self._fl, overhead)

    def step_time(self, step: Iterable[tuple[int, int]]) -> float:
        """Seconds for one step of ``(start, num_new)`` pairs."""
        return self.cost(step).seconds

    def __call__(self, scheduled: Iterable[Any]) -> float:
        """The clock's step cost (``minipaged.bench.clock.StepSeconds``): seconds for the step of
        these scheduled records (each one's ``start`` and ``num_new_tokens``)."""
        return self.step_time([(s.start, s.num_new_tokens) for s in scheduled])

    def decode_totals_time(self, seqs: int, ctx: int) -> float:
        """Seconds for a decode-only step of ``seqs`` sequences whose contexts sum to ``ctx``
        (each reads ``start + 1`` keys: its ``pairs`` equal its context)."""
        return self.cost_of_totals(seqs, ctx, ctx, seqs).seconds

    def decode_time(self, batch: int, context: int) -> float:
        """Seconds for a pure decode step of ``batch`` sequences with ``context`` tokens each."""
        return self.step_time([(context - 1, 1)] * batch)
