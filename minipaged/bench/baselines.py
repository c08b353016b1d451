"""The systems the bench compares, every one built from the engine's seams.

Owns the two memory layouts and the two batching policies of the factorial experiment, and the
driver that serves one request list with any of them:

- layout: ``paged`` (minipaged's BlockTable: a block when the tokens need it) or ``contiguous``
  (:func:`contiguous_table`: a block table that reserves the maximum length at admission, as a
  pre-PagedAttention server's contiguous KV region does);
- batching: ``continuous`` (the engine's scheduler refills a seat the step it frees) or ``static``
  (:func:`serve` hands the engine one batch, as many requests as the layout can hold to
  completion, and waits for the batch to drain before it takes the next).

``naive`` is one request at a time (``max_num_seqs=1``); transformers' ``generate`` on padded
batches is the outside peer. All of them run the same model, attention backend and greedy
sampler, so a measured difference belongs to the policy. The driver keeps a *virtual clock*: it
adds the measured duration of every step and jumps over idle gaps between arrivals, so an
online run costs its compute time, not its wall-clock length. It never touches allocator or
scheduler internals: it talks to the engine through ``add_request`` and ``step``.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Sequence as Seq

import torch

from .. import parts
from ..block_table import BlockTable
from ..sampling import SamplingParams

Request = tuple  # (prompt token ids, number of output tokens)

LAYOUTS = ("contiguous", "paged")
BATCHING = ("static", "continuous")
FACTORIAL = tuple(f"{b}_{lay}" for b in BATCHING for lay in LAYOUTS)  # static_contiguous, ...


class ContiguousBlockTable(BlockTable):
    """A block table that takes ``reserve_tokens`` slots' worth of blocks at its first append.

    The slots stay reserved from admission to the end of the request whether they are used or
    not: the waste the PagedAttention paper measured in earlier servers. Build a class with
    :func:`contiguous_table`; the engine constructs it as any block table, ``cls(allocator)``.
    """

    reserve_tokens: int = 0

    def _reserve_blocks(self) -> int:
        return parts.cdiv(self.reserve_tokens, self.block_size)

    def blocks_needed(self, num_new_tokens: int) -> int:
        total = self.num_tokens + num_new_tokens
        if total > self.reserve_tokens:
            raise ValueError(
                f"a contiguous reservation of {self.reserve_tokens} tokens cannot hold {total}: build the table "
                "class with contiguous_table(n) for n >= the longest prompt + output of the workload"
            )
        return max(0, self._reserve_blocks() - len(self.blocks))

    def append_tokens(self, num_new_tokens: int = 1) -> list[int]:
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        need = self.blocks_needed(num_new_tokens)
        new = parts.allocate_many(self.allocator, need) if need else []
        self.blocks.extend(new)
        self.num_tokens += num_new_tokens
        return new


def contiguous_table(reserve_tokens: int) -> type:
    """A ContiguousBlockTable class reserving ``reserve_tokens`` slots per sequence."""
    if not isinstance(reserve_tokens, int) or reserve_tokens < 1:
        raise ValueError(f"reserve_tokens must be an int >= 1, got {reserve_tokens!r}")
    return type(f"ContiguousTable{reserve_tokens}", (ContiguousBlockTable,), {"reserve_tokens": reserve_tokens})


def table_cls_for(layout: str, reserve_tokens: int) -> type:
    if layout == "paged":
        return BlockTable
    if layout == "contiguous":
        return contiguous_table(reserve_tokens)
    raise ValueError(f"unknown layout {layout!r}: use one of {LAYOUTS}")


def blocks_to_finish(table_cls: type, allocator: Any, prompt_len: int, max_tokens: int) -> int:
    """Blocks a request of this layout holds at its largest (asked of the layout's own table)."""
    return table_cls(allocator).blocks_needed(prompt_len + max_tokens - 1)


# -- the driver ----------------------------------------------------------------------------
@dataclass
class ServeResult:
    """What one system did with one request list. Times are virtual seconds from 0 (see module doc)."""

    system: str
    outputs: dict[int, list[int]] = field(default_factory=dict)
    arrival: dict[int, float] = field(default_factory=dict)
    first_token: dict[int, float] = field(default_factory=dict)
    finish: dict[int, float] = field(default_factory=dict)
    seconds: float = 0.0  # when the last request finished
    busy_seconds: float = 0.0  # time spent in add_request and step (the rest was waiting for arrivals)
    batches: list[list[int]] = field(default_factory=list)  # static: the requests of each batch
    engine: Any = None

    @property
    def trace(self):
        return getattr(self.engine, "trace", None)


def serve(
    engine: Any,
    requests: Seq[Request],
    arrivals: Seq[float] | None = None,
    policy: str = "continuous",
    batch_capacity: Any = None,
    system: str = "",
    progress: bool = False,
    id_prefix: str = "",
) -> ServeResult:
    """Serve ``requests`` (greedy, EOS ignored) on ``engine``; request ``i`` gets request_id ``str(i)``.

    ``id_prefix`` goes before every request_id (to serve twice on one engine).
    ``arrivals[i]``: when request ``i`` arrives, in seconds (default: all at 0, an offline batch).
    ``policy="continuous"`` hands each request to the engine when it arrives. ``policy="static"``
    hands over one batch at a time, only when the engine is empty: the arrived requests in order
    while ``batch_capacity(batch_so_far, i)`` says request ``i`` still fits.
    """
    if policy not in BATCHING:
        raise ValueError(f"unknown policy {policy!r}: use one of {BATCHING}")
    n = len(requests)
    arrivals = [0.0] * n if arrivals is None else [float(a) for a in arrivals]
    if len(arrivals) != n:
        raise ValueError(f"got {len(arrivals)} arrival times for {n} requests: give one per request")
    if policy == "static" and batch_capacity is None:
        raise ValueError("static batching needs batch_capacity(batch, i) -> bool: how many requests fit at once")
    res = ServeResult(system=system or policy, engine=engine)
    pending = deque(sorted(range(n), key=lambda i: (arrivals[i], i)))
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=n, desc=system or policy, unit="req")

    def add(i: int) -> None:
        prompt, n_out = requests[i]
        engine.add_request(list(prompt), SamplingParams(max_tokens=int(n_out), temperature=0.0, ignore_eos=True), request_id=f"{id_prefix}{i}")
        res.arrival[i] = arrivals[i]

    clock = 0.0
    while pending or engine.has_unfinished_requests():
        t = time.perf_counter()
        if policy == "continuous":
            while pending and arrivals[pending[0]] <= clock:
                add(pending.popleft())
        elif not engine.has_unfinished_requests():
            batch: list[int] = []
            while pending and arrivals[pending[0]] <= clock and (not batch or batch_capacity(batch, pending[0])):
                batch.append(pending.popleft())
            if batch:
                if not batch_capacity([], batch[0]):
                    raise ValueError(f"request {batch[0]} alone does not fit the KV budget: give the engine more blocks")
                for i in batch:
                    add(i)
                res.batches.append(batch)
        clock += time.perf_counter() - t
        res.busy_seconds += time.perf_counter() - t
        if not engine.has_unfinished_requests():
            clock = max(clock, arrivals[pending[0]])  # idle until the next arrival
            continue
        t = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t
        clock += dt
        res.busy_seconds += dt
        for o in outs:
            i = int(str(o.request_id)[len(id_prefix):])
            if o.finish_reason in ("rejected", "error", "abort"):
                raise RuntimeError(f"{res.system}: request {i} ended with {o.finish_reason}: {o.error}")
            if o.token_ids and i not in res.first_token:
                res.first_token[i] = clock
            if o.finished:
                res.finish[i] = clock
                res.outputs[i] = list(o.token_ids)
                if bar is not None:
                    bar.update(1)
    res.seconds = clock
    if bar is not None:
        bar.close()
    return res


# -- building the systems ------------------------------------------------------------------
def build_engine(model: Any, layout: str, num_blocks: int, reserve_tokens: int, block_size: int = 16,
                 max_num_seqs: int = 256, max_num_batched_tokens: int = 1024, attention: Any = "auto",
                 gguf_blocks: bool | None = None, engine: dict | None = None) -> Any:
    """An LLMEngine with ``num_blocks`` KV blocks and the layout's block table (no tokenizer: token ids in).
    ``gguf_blocks``: EngineConfig's (False: every matmul on the fp32 copies). ``engine``: more
    EngineConfig settings (``minipaged bench``'s engine flags)."""
    from ..engine import LLMEngine

    return LLMEngine(
        model, None, block_table_cls=table_cls_for(layout, reserve_tokens), attention=attention, block_size=block_size,
        num_blocks=num_blocks, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
        gguf_blocks=gguf_blocks, **(engine or {}),
    )


def static_capacity(requests: Seq[Request], table_cls: type, allocator: Any, max_num_seqs: int):
    """``batch_capacity`` for :func:`serve`: a batch takes requests while all of them, at their
    largest, fit in the pool together (so a static batch never preempts) and a seat is free."""
    need = {}

    def fits(batch: list[int], i: int) -> bool:
        for j in (*batch, i):
            if j not in need:
                need[j] = blocks_to_finish(table_cls, allocator, len(requests[j][0]), requests[j][1])
        return len(batch) + 1 <= max_num_seqs and sum(need[j] for j in batch) + need[i] <= allocator.num_blocks

    return fits


def run_system(model: Any, system: str, requests: Seq[Request], num_blocks: int, reserve_tokens: int,
               arrivals: Seq[float] | None = None, block_size: int = 16, max_num_seqs: int = 256,
               max_num_batched_tokens: int = 1024, attention: Any = "auto", progress: bool = False,
               gguf_blocks: bool | None = None, engine: dict | None = None) -> ServeResult:
    """One cell of the factorial (``static_contiguous``, ..., ``continuous_paged``) or ``naive``.
    ``engine``: more EngineConfig settings for the engine it builds."""
    if system == "naive":
        eng = build_engine(model, "paged", num_blocks, reserve_tokens, block_size, 1, max_num_batched_tokens, attention,
                           gguf_blocks, engine)
        return serve(eng, requests, arrivals, "continuous", system=system, progress=progress)
    if system not in FACTORIAL:
        raise ValueError(f"unknown system {system!r}: use 'naive' or one of {FACTORIAL}")
    policy, layout = system.split("_")
    eng = build_engine(model, layout, num_blocks, reserve_tokens, block_size, max_num_seqs, max_num_batched_tokens, attention,
                       gguf_blocks, engine)
    cap = None
    if policy == "static":
        cap = static_capacity(requests, table_cls_for(layout, reserve_tokens), eng.allocator, max_num_seqs)
    return serve(eng, requests, arrivals, policy, batch_capacity=cap, system=system, progress=progress)


# -- what lesson 01 and 06 call -------------------------------------------------------------
def run_static(model: Any, requests: Seq[Request], batch_size: int, reserve_len: int, block_size: int = 16,
               attention: Any = "auto", progress: bool = False, layout: str = "contiguous") -> ServeResult:
    """Static batching: ``batch_size`` contiguous reservations of ``reserve_len`` tokens, one batch
    at a time (the KV budget is exactly those reservations)."""
    num_blocks = batch_size * parts.cdiv(reserve_len, block_size)
    return run_system(model, f"static_{layout}", requests, num_blocks, reserve_len, block_size=block_size,
                      max_num_seqs=batch_size, attention=attention, progress=progress)


def run_naive(model: Any, requests: Seq[Request], reserve_len: int, block_size: int = 16, attention: Any = "auto",
              progress: bool = False) -> ServeResult:
    """One request at a time over one contiguous reservation of ``reserve_len`` tokens."""
    num_blocks = parts.cdiv(reserve_len, block_size)
    return run_system(model, "static_contiguous", requests, num_blocks, reserve_len, block_size=block_size,
                      max_num_seqs=1, attention=attention, progress=progress)


# -- transformers' generate -------------------------------------------------------------------
def load_hf_peer(model_path: str | None = None):
    """transformers' LlamaForCausalLM on the same weights, or None if transformers is absent."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return None
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    from ..model import default_model_path

    path = Path(model_path) if model_path else default_model_path()
    if path.suffix == ".gguf":
        return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, torch_dtype=torch.float32).eval()
    return AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=torch.float32).eval()


@torch.inference_mode()
def run_hf(hf_model: Any, requests: Seq[Request], batch_size: int, pad_id: int = 0, progress: bool = False) -> ServeResult:
    """``transformers.generate`` on left-padded batches of ``batch_size``, greedy, exactly each
    batch's longest output (``min_new_tokens``): the static-batching peer from outside minipaged."""
    res = ServeResult(system="hf")
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(requests), desc="transformers.generate", unit="req")
    dev = next(hf_model.parameters()).device
    t0 = time.perf_counter()
    for b0 in range(0, len(requests), batch_size):
        batch = list(range(b0, min(b0 + batch_size, len(requests))))
        width = max(len(requests[i][0]) for i in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, i in enumerate(batch):
            p = list(requests[i][0])
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        n = max(requests[i][1] for i in batch)
        start = time.perf_counter() - t0
        gen = hf_model.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev), max_new_tokens=n, min_new_tokens=n,
                                do_sample=False, pad_token_id=pad_id)
        now = time.perf_counter() - t0
        for row, i in enumerate(batch):
            res.outputs[i] = gen[row, width:].tolist()[: requests[i][1]]
            res.arrival[i], res.finish[i] = 0.0, now
            res.first_token[i] = start  # generate returns all at once: the first token is not observable
        res.batches.append(batch)
        if bar is not None:
            bar.update(len(batch))
    if bar is not None:
        bar.close()
    res.seconds = res.busy_seconds = time.perf_counter() - t0
    return res
