"""This machine's ceilings: memory bandwidth, GEMM rate, and the roofline of a decode step.

Owns the measurements a roofline needs and the arithmetic that predicts from them:

- bandwidth, STREAM-like: a read (a sum over a buffer far larger than the caches) and a copy
  into a preallocated buffer (``dst.copy_(src)``: no allocation inside the timing, unlike
  ``clone()``), best of several runs;
- GEMM FLOP/s, best of several runs;
- a decode step's arithmetic intensity against batch size: ``B`` sequences each use every
  weight once (2 flops per weight per sequence) while the weights are read once per step;
- the batch where decode turns compute-bound, predicted (where the intensity reaches the
  machine's ridge point) and measured (timing the model's own linear layers at each batch).

It never runs the engine; ``minipaged.bench.serving`` reads these figures.
"""
from __future__ import annotations

import os
import time
from typing import Any, Callable

import torch


def _best(fn: Callable[[], Any], repeats: int) -> float:
    fn()  # warm-up: first-touch page faults and lazy init stay out of the timing
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _median(fn: Callable[[], Any], repeats: int) -> float:
    """The median of ``repeats`` timed runs after one warm-up: the statistic an engine's step
    times are reported in, so a profile that prices them is not biased to the best case."""
    import statistics

    fn()
    times = []
    for _ in range(max(1, repeats)):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def bandwidth(mib: int = 256, repeats: int = 5) -> dict[str, float]:
    """GB/s of a STREAM-like read and copy over ``mib`` MiB of fp32, best of ``repeats`` runs.

    read: ``src.sum()`` touches every byte once. copy: ``dst.copy_(src)`` into a buffer allocated
    before the clock starts, counted as bytes read + bytes written (STREAM's convention).
    """
    n = mib * 2**20 // 4
    src = torch.rand(n)
    dst = torch.empty_like(src)
    nbytes = src.numel() * src.element_size()
    read = _best(lambda: src.sum(), repeats)
    copy = _best(lambda: dst.copy_(src), repeats)
    return {"read_GBps": nbytes / read / 1e9, "copy_GBps": 2 * nbytes / copy / 1e9, "buffer_mib": float(mib)}


def gemm_gflops(n: int = 1024, repeats: int = 8, dtype: torch.dtype = torch.float32) -> float:
    """Square matmul rate of this machine (GFLOP/s), best of ``repeats`` runs."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    out = torch.empty(n, n, dtype=dtype)
    return 2 * n**3 / _best(lambda: torch.matmul(a, b, out=out), repeats) / 1e9


# How long ceilings measured with cache_s=CEILINGS_TTL_S are kept on disk: one sitting of lessons (a
# `make notebooks` run, a learner's evening) reads one roofline instead of one per process.
CEILINGS_TTL_S = 3600.0


def _ceilings_file(quick: bool) -> Any:
    import platform

    from ..cpu.build import cache_dir

    sig = f"{platform.node()}-{os.cpu_count()}-{torch.get_num_threads()}-{torch.__version__}-{'quick' if quick else 'full'}"
    import hashlib

    return cache_dir() / f"ceilings-{hashlib.sha1(sig.encode()).hexdigest()[:12]}.json", sig


def ceilings(quick: bool = True, cache_s: float | None = None) -> dict[str, float]:
    """This machine's two ceilings, measured as ``minipaged bench`` measures them (``quick``: its
    ``--quick`` sizes), so lesson 01, lesson 07 and the bench read one roofline: GEMM FLOP/s,
    read and copy bandwidth, the ridge point (flops per byte read) and the batch where an fp32
    decode step's weight traffic stops being the bottleneck (B* = 2 x ridge).

    ``cache_s``: one roofline for a sitting. Lessons run in separate processes, and a shared
    host's bandwidth moves by a third from one moment to the next, so each would print its own.
    With ``cache_s``, the ceilings are still measured, then merged with the ones this machine
    (same host, cores, threads and torch) kept in minipaged's cache folder, whose newest reading is
    less than ``cache_s`` seconds old (a sitting lasts while lessons keep reading it), keeping each
    ceiling's best reading (a busy moment only ever lowers a ceiling),
    and the merge is kept for the next process. ``None`` (the default): this measurement alone,
    nothing kept. ``measured_at`` (``time.time()`` of the oldest reading used) and ``kept`` (how
    many earlier readings were merged) say which."""
    import json

    bw = bandwidth(mib=128 if quick else 256, repeats=3 if quick else 5)
    gf = gemm_gflops(repeats=4 if quick else 8)
    now = time.time()
    best = {"gemm_gflops": gf, "read_GBps": bw["read_GBps"], "copy_GBps": bw["copy_GBps"]}
    since, kept = now, 0
    if cache_s:
        path, sig = _ceilings_file(quick)
        try:
            old = json.loads(path.read_text())
            # a sitting lasts while its readings keep coming: expired cache_s after its newest one,
            # so a run of lessons never starts a new roofline halfway through
            if old.get("signature") == sig and 0 <= now - float(old.get("last_at", old["measured_at"])) < cache_s:
                best = {k: max(v, float(old["ceilings"][k])) for k, v in best.items()}
                since, kept = float(old["measured_at"]), int(old.get("readings", 1))
        except (OSError, ValueError, KeyError, TypeError):
            pass  # no file, another machine's, or unreadable: this reading starts a new sitting
        try:
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"signature": sig, "measured_at": since, "last_at": now, "readings": kept + 1,
                                       "ceilings": best}))
            os.replace(tmp, path)
        except OSError:
            pass  # a read-only cache folder: this reading is still returned, only not kept
    gf, read = best["gemm_gflops"], best["read_GBps"]
    return {**best, "ridge_flops_per_byte": gf / read, "fp32_compute_bound_batch": predicted_compute_bound_batch(gf, read, 4.0),
            "measured_at": since, "kept": kept}


def linear_weights(model: torch.nn.Module) -> list[torch.Tensor]:
    """The 2-D weights a decode step multiplies by (every linear layer and the LM head, not the
    embedding lookup, which reads one row per token)."""
    ws = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    head = getattr(model, "lm_head", None)
    if head is None or not isinstance(head, torch.nn.Linear):
        emb = getattr(model, "embed_tokens", None)
        if emb is not None and getattr(model.config, "tie_word_embeddings", False):
            ws.append(emb.weight)  # the tied LM head multiplies by the embedding matrix
    return ws


def decode_intensity(num_params: int, batch: int, bytes_per_param: float = 4.0, kv_bytes_per_seq: float = 0.0) -> float:
    """Flops per byte of one decode step: 2 * params * batch flops over the weights read once
    plus each sequence's KV (read once, used for a handful of flops per byte)."""
    return 2.0 * num_params * batch / (num_params * bytes_per_param + batch * kv_bytes_per_seq)


def predicted_compute_bound_batch(gflops: float, gbps: float, bytes_per_param: float = 4.0) -> float:
    """The batch at which the weight traffic stops being the bottleneck: intensity = ridge.

    With weights only, intensity = 2 * B / bytes_per_param, so B* = ridge * bytes_per_param / 2
    (fp32: B* = 2 x ridge; fp16: B* = ridge).
    """
    ridge = gflops / gbps
    return ridge * bytes_per_param / 2.0


@torch.inference_mode()
def time_linear_layers(weights: list[torch.Tensor], batch: int, repeats: int = 3) -> float:
    """Seconds for one decode step's matmuls at ``batch`` sequences: x (batch, in) @ W.T for every W."""
    xs = [torch.randn(batch, w.shape[1], dtype=w.dtype, device=w.device) for w in weights]  # where the weights are
    outs = [torch.empty(batch, w.shape[0], dtype=w.dtype, device=w.device) for w in weights]

    def step() -> None:
        for x, w, o in zip(xs, weights, outs):
            torch.matmul(x, w.t(), out=o)

    return _best(step, repeats)


def split_head(model: torch.nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """:func:`linear_weights` parted into the body's (every layer's) and the LM head's (the
    matrix with one row per vocabulary entry)."""
    vocab = model.config.vocab_size
    ws = linear_weights(model)
    return [w for w in ws if w.shape[0] != vocab], [w for w in ws if w.shape[0] == vocab]


PROFILE_ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 20, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)


def linear_profile(model: torch.nn.Module, rows: tuple[int, ...] = PROFILE_ROWS, repeats: int = 5) -> dict[str, Any]:
    """The model's matmuls timed on its own weights at each row count (median of ``repeats``):
    ``body_s``, one step's matmuls of every layer but the LM head at that many tokens; ``head_s``,
    the LM head at that many sampled sequences. What a GEMM library does at 2 rows is not what a
    roofline says (here PyTorch's fp32 matmul is slower at 2-4 rows than at 8), so a cost model
    that has to be right at every batch reads these instead of one GEMM rate
    (``minipaged.bench.gpu.cost.LinearProfile``)."""
    body, head = split_head(model)
    if not body or not head:
        raise ValueError("linear_profile needs a model with linear layers and an LM head (nn.Linear or tied embedding)")
    return {"rows": list(rows), "body_s": [_time_f_linear(body, r, repeats) for r in rows],
            "head_s": [_time_f_linear(head, r, repeats) for r in rows], "repeats": repeats,
            "threads": torch.get_num_threads()}


@torch.inference_mode()
def _time_f_linear(weights: list[torch.Tensor], rows: int, repeats: int) -> float:
    """Seconds for ``F.linear(x, W)`` over every W at ``rows`` rows: the op the plain model runs."""
    import torch.nn.functional as F

    xs = [torch.randn(rows, w.shape[1], dtype=w.dtype, device=w.device) for w in weights]
    return _median(lambda: [F.linear(x, w) for x, w in zip(xs, weights)], repeats)


class attention_timer:
    """Times ``backend``'s attention (an ``AttentionBackend``: the engine's own, ``engine.backend``)
    for one step's sequences, on demand: called with a tuple of ``(start, num_new)`` pairs
    (decodes, one new token each, first, as the runner orders them), it returns the seconds of
    ``num_layers`` calls over them: ``calls`` calls timed, each with its own block table scattered
    through a cache larger than the CPU's caches (each layer reads its own pages), median of
    ``repeats``, scaled to ``num_layers``. Each distinct tuple is timed once (kept in ``timed``):
    for the steps a simulation cannot know in advance (chunked prefills of every length)."""

    def __init__(self, backend: Any, num_layers: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 block_size: int = 16, calls: int = 4, repeats: int = 3, num_blocks: int = 4096,
                 dtype: torch.dtype = torch.float32, seed: int = 0) -> None:
        self.backend, self.num_layers, self.block_size = backend, num_layers, block_size
        self.num_heads, self.head_dim, self.calls, self.repeats, self.dtype = num_heads, head_dim, calls, repeats, dtype
        self.g = torch.Generator().manual_seed(seed)
        self.k = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, generator=self.g)
        self.v = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, generator=self.g)
        self.timed: dict[tuple, float] = {}

    @torch.inference_mode()
    def __call__(self, pairs: tuple) -> float:
        import itertools

        pairs = tuple((int(a), int(n)) for a, n in pairs)
        if pairs in self.timed:
            return self.timed[pairs]
        from ..attention import AttentionMetadata

        ctx = [a + n for a, n in pairs]
        nb = -(-max(ctx) // self.block_size)
        total = len(pairs) * nb
        num_blocks = self.k.shape[0]
        if total > num_blocks:
            raise ValueError(f"attention_timer: {len(pairs)} sequences of up to {max(ctx)} tokens need {total} blocks; "
                             f"the timer has {num_blocks} (raise num_blocks)")
        n_tok = sum(n for _, n in pairs)
        num_decodes = next((i for i, (_, n) in enumerate(pairs) if n != 1), len(pairs))
        q = torch.randn(n_tok, self.num_heads, self.head_dim, dtype=self.dtype, generator=self.g)
        out = torch.empty_like(q)
        qsl = torch.tensor([0, *itertools.accumulate(n for _, n in pairs)], dtype=torch.int32)
        cl = torch.tensor(ctx, dtype=torch.int32)
        metas = [AttentionMetadata(torch.zeros(n_tok, dtype=torch.long),
                                   torch.randperm(num_blocks, generator=self.g)[:total].view(len(pairs), nb).to(torch.int32),
                                   cl, qsl, num_decodes=num_decodes) for _ in range(self.calls)]
        t = _median(lambda: [self.backend.forward(q, self.k, self.v, m, self.head_dim ** -0.5, out) for m in metas],
                    self.repeats)
        self.timed[pairs] = t * self.num_layers / self.calls
        return self.timed[pairs]


ATTENTION_BATCHES = (1, 2, 4, 8, 16, 32, 64)
ATTENTION_CONTEXTS = (32, 64, 128, 256, 512, 1024)


def attention_profile(backend: Any, num_layers: int, num_heads: int, num_kv_heads: int, head_dim: int,
                      block_size: int = 16, batches: tuple[int, ...] = ATTENTION_BATCHES,
                      contexts: tuple[int, ...] = ATTENTION_CONTEXTS, repeats: int = 5,
                      dtype: torch.dtype = torch.float32, seed: int = 0) -> dict[str, Any]:
    """Decode attention as ``backend`` runs it, on a grid: ``seconds[i][j]``, one step (all
    ``num_layers`` calls, each layer its own pages) over ``batches[i]`` sequences of ``contexts[j]``
    keys, timed by :class:`attention_timer` (median of ``repeats``;
    ``minipaged.bench.gpu.cost.AttentionProfile``)."""
    per_seq = -(-max(contexts) // block_size)
    timer = attention_timer(backend, num_layers, num_heads, num_kv_heads, head_dim, block_size, calls=num_layers,
                            repeats=repeats, num_blocks=max(max(batches) * per_seq, 4096), dtype=dtype, seed=seed)
    seconds = [[timer(((c - 1, 1),) * b) for c in contexts] for b in batches]
    return {"batches": list(batches), "contexts": list(contexts), "seconds": seconds, "backend": backend.name,
            "layers": num_layers, "repeats": repeats, "threads": torch.get_num_threads()}


def measured_knee(batches: list[int], seconds: list[float]) -> float | None:
    """Where the flat (memory-bound) part of time-vs-batch meets its compute-bound growth.

    The roofline's construction applied to data: the floor is the time at the smallest batch, the
    compute slope is the marginal cost per sequence between the two largest batches, and the knee
    is the batch where that slope alone costs the floor. None while the largest batch has not yet
    doubled the floor's time (still memory-bound within the batches measured).
    """
    floor = seconds[0]
    if len(batches) < 2 or seconds[-1] < 2 * floor:
        return None
    slope = (seconds[-1] - seconds[-2]) / (batches[-1] - batches[-2])
    return floor / slope if slope > 0 else None


def roofline(model: torch.nn.Module, batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128),
             bw: dict[str, float] | None = None, gflops: float | None = None, repeats: int = 3) -> dict[str, Any]:
    """The model's decode roofline on this machine: predicted and measured compute-bound batch."""
    bw = bw or bandwidth()
    gflops = gflops or gemm_gflops()
    weights = linear_weights(model)
    num_params = sum(w.numel() for w in weights)
    bpp = float(weights[0].element_size())
    gbps = bw["read_GBps"]
    secs = [time_linear_layers(weights, b, repeats) for b in batches]
    rows = []
    for b, s in zip(batches, secs):
        flops = 2.0 * num_params * b
        rows.append({
            "batch": b, "seconds": s, "gflops": flops / s / 1e9, "tokens_per_s": b / s,
            "intensity": decode_intensity(num_params, b, bpp),
            "roofline_seconds": max(num_params * bpp / (gbps * 1e9), flops / (gflops * 1e9)),
        })
    return {
        "gemm_gflops": gflops, "bandwidth": bw, "ridge_flops_per_byte": gflops / gbps,
        "linear_params": num_params, "bytes_per_param": bpp,
        "weights_read_seconds": num_params * bpp / (gbps * 1e9),
        "predicted_compute_bound_batch": predicted_compute_bound_batch(gflops, gbps, bpp),
        "measured_compute_bound_batch": measured_knee(list(batches), secs),
        "by_batch": rows,
        "note": "decode matmuls only (every linear layer and the LM head); attention reads each sequence's own "
                "KV once for ~1 flop per byte at any batch, so it stays memory-bound",
    }
