"""Where KV lives besides the device pool: the KV connector seam and the host-memory tier.

Owns the seam (:class:`minipaged.interfaces.KVConnector`, after vLLM V1's ``KVConnectorBase_V1``,
with only the members the host tier and disaggregated prefill need), the engine's side of it
(:class:`ConnectorDriver`: the fixed points of a step where the engine calls the connector, the
blocks it holds while a load is in flight, the hits counted per tier) and the reference
connector, :class:`HostOffloadConnector`: a host store of whole blocks, keyed by the same chained
hash the prefix cache uses, with its own LRU.

One engine step, with a connector (``engine.step()``)::

    ConnectorDriver.before_schedule   scheduler side: for each waiting request, after the device prefix
                                      cache's hit, ``get_num_new_matched_tokens``; the engine allocates
                                      that many blocks and calls ``update_state_after_alloc``;
                                      worker side: ``start_load_kv(kv_cache)`` copies the blocks in;
                                      then the engine registers them in the prefix cache
    Scheduler.schedule()              admits the request: its prefix now hits the device cache
    model forward                     computes the rest of the prompt
    ConnectorDriver.save              worker side: ``save_kv(kv_cache, scheduled)`` after the forward
    Scheduler.update()                tokens appended, finished requests freed
    ConnectorDriver.finish            scheduler side: ``request_finished`` for every retired sequence;
                                      the blocks held for loads are released

Why this is safe: a full block's K/V depends only on its tokens and the tokens before them, so a
block saved under its chained hash can be loaded into any free device block for any request whose
prefix has the same hash. The last prompt token is never loaded (it is recomputed for the
logits), exactly as with the device prefix cache.

The host tier saves every full block once, right after the step that computed it (vLLM's native
offloading stores on compute too), so a block evicted from the device pool later is still in the
host store; a full host store evicts its least recently used block and never fails a request.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence as Seq

import torch

from .prefix_cache import ROOT_HASH, hash_block


@dataclass(frozen=True)
class KVLayout:
    """The shape of one engine's KV blocks, what every connector is built with: a block holds
    ``num_layers`` x (K, V) x ``block_size`` x ``num_kv_heads`` x ``head_dim`` values of ``dtype``."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: Any = "cpu"
    model_name: str = ""

    @property
    def block_shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def bytes_per_block(self) -> int:
        n = 1
        for d in self.block_shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()

    @classmethod
    def of_cache(cls, kv_cache: Any, model_name: str = "") -> "KVLayout":
        k = kv_cache.k[0]
        return cls(len(kv_cache.k), int(k.shape[1]), int(k.shape[2]), int(k.shape[3]), k.dtype, k.device, model_name)


# -- the two copies every connector makes -----------------------------------------------------------
def gather_blocks(kv_cache: Any, block_ids: Seq[int], out: torch.Tensor | None = None) -> torch.Tensor:
    """The K/V of device blocks ``block_ids`` as one tensor (n, layers, 2, block_size, kv_heads, head_dim)."""
    idx = torch.tensor(list(block_ids), dtype=torch.long, device=kv_cache.k[0].device)
    parts = [torch.stack((k[idx], v[idx]), dim=1) for k, v in zip(kv_cache.k, kv_cache.v)]
    data = torch.stack(parts, dim=1)
    if out is not None:
        out.copy_(data)
        return out
    return data


def scatter_blocks(kv_cache: Any, block_ids: Seq[int], data: torch.Tensor) -> None:
    """Write ``data`` (n, layers, 2, block_size, kv_heads, head_dim) into device blocks ``block_ids``."""
    device = kv_cache.k[0].device
    idx = torch.tensor(list(block_ids), dtype=torch.long, device=device)
    data = data.to(device, non_blocking=True)
    for layer, (k, v) in enumerate(zip(kv_cache.k, kv_cache.v)):
        k[idx] = data[:, layer, 0].to(k.dtype)
        v[idx] = data[:, layer, 1].to(v.dtype)


def full_block_hashes(token_ids: Seq[int], block_size: int, known: list[bytes] | None = None) -> list[bytes]:
    """The chained hashes of the full blocks of ``token_ids`` (the prefix cache's own chain);
    ``known`` (a list, extended in place) holds those hashed already, so each block is hashed once."""
    hashes = known if known is not None else []
    parent = hashes[-1] if hashes else ROOT_HASH
    for i in range(len(hashes), len(token_ids) // block_size):
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size])
        hashes.append(parent)
    return hashes


def newly_full_blocks(sch: Any, block_size: int) -> list[tuple[int, int]]:
    """(logical index, device block) of each block of a scheduled sequence that this step filled:
    full after the step and not before it (draft positions past the sequence's tokens never count)."""
    seq = sch.seq
    table = seq.block_table
    if table is None:
        return []
    end = min(sch.start + sch.num_new_tokens, seq.num_tokens)
    first, last = sch.start // block_size, end // block_size
    return [(i, table.blocks[i]) for i in range(first, min(last, len(table.blocks)))]


# -- the host store ---------------------------------------------------------------------------------
class HostKVStore:
    """``capacity`` whole blocks in host memory (pinned where the device is a GPU), found by chained
    hash, with their own LRU: ``put`` on a full store drops the least recently used block."""

    def __init__(self, layout: KVLayout, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"a host KV store needs room for at least one block of {layout.bytes_per_block} bytes")
        pin = torch.device(layout.device).type == "cuda"
        self.layout, self.capacity = layout, capacity
        self.data = torch.empty((capacity, *layout.block_shape), dtype=layout.dtype, pin_memory=pin)
        self._slot_of: OrderedDict[bytes, int] = OrderedDict()  # least recently used first
        self._free = list(range(capacity - 1, -1, -1))
        self.num_evictions = 0

    def __len__(self) -> int:
        return len(self._slot_of)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._slot_of

    def get(self, block_hash: bytes) -> int | None:
        """The slot holding ``block_hash`` (now the most recently used), or None."""
        slot = self._slot_of.get(block_hash)
        if slot is not None:
            self._slot_of.move_to_end(block_hash)
        return slot

    def put(self, block_hash: bytes) -> int:
        """A slot to write ``block_hash``'s K/V into: its own if stored already, else a free one,
        else the least recently used block's (evicted)."""
        if block_hash in self._slot_of:
            self._slot_of.move_to_end(block_hash)
            return self._slot_of[block_hash]
        if self._free:
            slot = self._free.pop()
        else:
            _, slot = self._slot_of.popitem(last=False)
            self.num_evictions += 1
        self._slot_of[block_hash] = slot
        return slot

    def lru_order(self) -> list[bytes]:
        return list(self._slot_of)


def host_capacity_blocks(layout: KVLayout, size_gib: float) -> int:
    """How many whole blocks ``size_gib`` GiB of host memory holds; a clear error when none."""
    if isinstance(size_gib, bool) or not isinstance(size_gib, (int, float)) or size_gib <= 0:
        raise ValueError(f"kv_offloading_size is the host store's size in GiB (a number > 0), got {size_gib!r}")
    n = int(size_gib * 2**30) // layout.bytes_per_block
    if n < 1:
        raise ValueError(f"kv_offloading_size={size_gib} GiB holds no KV block: one block is {layout.bytes_per_block} "
                         f"bytes ({layout.bytes_per_block / 2**30:.6f} GiB); give a larger size")
    return n


class HostOffloadConnector:
    """The reference :class:`minipaged.interfaces.KVConnector`: a host-memory tier under the device pool.

    Constructor: ``HostOffloadConnector(layout, config)`` (a :class:`KVLayout`, the engine's
    EngineConfig: its ``kv_offloading_size`` in GiB sizes the store; ``capacity_blocks=`` instead
    gives the size in blocks).
    Scheduler side: ``get_num_new_matched_tokens`` counts the blocks after the device hit that the
    store holds (never the last prompt token); ``update_state_after_alloc`` records which device
    blocks they go to. Worker side: ``start_load_kv`` copies them in; ``save_kv`` stores every block
    the step filled that the store does not hold yet.
    """

    def __init__(self, layout: KVLayout, config: Any = None, capacity_blocks: int | None = None) -> None:
        if capacity_blocks is None:
            capacity_blocks = host_capacity_blocks(layout, getattr(config, "kv_offloading_size", None))
        self.layout, self.block_size = layout, layout.block_size
        self.store = HostKVStore(layout, capacity_blocks)
        self._hashes: dict[Any, list[bytes]] = {}  # seq id -> its full blocks' hashes so far
        self._loads: list[tuple[int, int]] = []  # (host slot, device block) to copy in before the forward
        self.counts = {"saved_blocks": 0, "loaded_blocks": 0, "save_seconds": 0.0, "load_seconds": 0.0}

    def _hashes_of(self, seq: Any) -> list[bytes]:
        return full_block_hashes(seq.token_ids, self.block_size, self._hashes.setdefault(seq.seq_id, []))

    # -- scheduler side -----------------------------------------------------------------------
    def get_num_new_matched_tokens(self, seq: Any, num_computed_tokens: int) -> int:
        usable = (seq.num_tokens - 1) // self.block_size  # whole blocks before the last token
        hashes = self._hashes_of(seq)
        n = 0
        for i in range(num_computed_tokens // self.block_size, usable):
            if hashes[i] not in self.store:
                break
            n += 1
        return n * self.block_size

    def update_state_after_alloc(self, seq: Any, block_ids: list[int], num_external_tokens: int) -> None:
        hashes = self._hashes_of(seq)
        n = num_external_tokens // self.block_size
        first = len(block_ids) - n  # block_ids: the prefix's blocks; the last n are this connector's
        for i in range(first, len(block_ids)):
            slot = self.store.get(hashes[i])
            if slot is None:  # evicted since it was matched: nothing saves between the two calls
                raise RuntimeError(f"host block {i} of request {seq.seq_id!r} was evicted between match and alloc")
            self._loads.append((slot, block_ids[i]))

    def request_finished(self, seq: Any) -> None:
        self._hashes.pop(seq.seq_id, None)

    # -- worker side --------------------------------------------------------------------------
    def start_load_kv(self, kv_cache: Any) -> None:
        if not self._loads:
            return
        t = time.perf_counter()
        loads, self._loads = self._loads, []
        slots = torch.tensor([s for s, _ in loads], dtype=torch.long)
        scatter_blocks(kv_cache, [b for _, b in loads], self.store.data[slots])
        self.counts["loaded_blocks"] += len(loads)
        self.counts["load_seconds"] += time.perf_counter() - t

    def save_kv(self, kv_cache: Any, scheduled: Seq[Any]) -> None:
        t = time.perf_counter()
        slots, blocks = [], []
        for sch in scheduled:
            if sch.seq.is_finished:
                continue  # failed in this step: what it wrote is not trusted
            hashes = self._hashes_of(sch.seq)
            for i, block in newly_full_blocks(sch, self.block_size):
                if hashes[i] in self.store:
                    self.store.get(hashes[i])  # recently used again
                    continue
                slots.append(self.store.put(hashes[i]))
                blocks.append(block)
        if blocks:
            self.store.data[torch.tensor(slots, dtype=torch.long)] = gather_blocks(kv_cache, blocks).to("cpu")
            self.counts["saved_blocks"] += len(blocks)
            self.counts["save_seconds"] += time.perf_counter() - t

    # -- for stats and pictures ---------------------------------------------------------------
    def describe(self) -> str:
        gib = self.store.capacity * self.layout.bytes_per_block / 2**30
        return (f"{type(self).__name__}: host store of {self.store.capacity} blocks ({gib:.2f} GiB"
                f"{', pinned' if self.store.data.is_pinned() else ''}), LRU; loads before the schedule, saves after the forward")

    def stats(self) -> dict:
        return {**self.counts, "host_blocks": len(self.store), "host_capacity_blocks": self.store.capacity,
                "host_evictions": self.store.num_evictions}


# -- the engine's side of the seam -----------------------------------------------------------------
class ConnectorDriver:
    """Calls one engine's connector at the step's fixed points (see the module's docstring), holds
    the device blocks a load is filling until the step ends, and counts prefix hits per tier."""

    def __init__(self, connector: Any, allocator: Any, scheduler: Any, max_num_seqs: int) -> None:
        self.connector, self.allocator, self.scheduler = connector, allocator, scheduler
        self.max_num_seqs = max_num_seqs
        self.block_size = allocator.block_size
        self._held: list[int] = []  # one reference each, released when the step ends
        self._loaded: dict[Any, int] = {}  # seq id -> tokens loaded for it, until it is first scheduled
        self._queried: set = set()
        self.load_failures, self.last_load_error = 0, None
        self.tiers = {"device_hit_tokens": 0, "host_hit_tokens": 0, "external_queries": 0, "external_hits": 0}

    # -- before the schedule: scheduler side, then worker side -------------------------------------
    def before_schedule(self, kv_cache: Any) -> None:
        """Ask the connector about each waiting request the step may admit, allocate device blocks for
        what it can provide, have it load them (``start_load_kv``), and register them in the prefix
        cache, so that the scheduler's prefix lookup finds them. A load that raises frees its blocks
        (the requests recompute) and is counted in ``load_failures``."""
        sched, pool, bs = self.scheduler, self.allocator, self.block_size
        room = self.max_num_seqs - len(sched.running)
        reserve = len(sched.running)  # a block each for the running sequences' next tokens
        pending = []  # (seq, hit blocks, new blocks, external tokens)
        for seq in list(sched.waiting)[: max(room, 0)]:
            if seq.block_table is not None:
                continue
            hit = pool.match_prefix(seq.token_ids)
            computed = len(hit) * bs
            n_ext = int(self.connector.get_num_new_matched_tokens(seq, computed))
            if seq.seq_id not in self._queried:
                self._queried.add(seq.seq_id)
                self.tiers["external_queries"] += seq.num_tokens - computed
            if n_ext <= 0:
                continue
            if n_ext % bs or computed + n_ext > seq.num_tokens - 1:
                raise ValueError(f"{type(self.connector).__name__}.get_num_new_matched_tokens returned {n_ext}: it must be "
                                 f"whole blocks of {bs} tokens, and never reach the last prompt token "
                                 f"({seq.num_tokens - 1 - computed} tokens at most here)")
            need = n_ext // bs
            revived = sum(1 for b in hit if pool.ref_count(b) == 0)
            if need + revived + reserve > pool.num_free_blocks:
                break  # memory is short: the request recomputes, or waits
            for b in hit:  # held, so that allocating the new blocks cannot evict the hit itself
                pool.incref(b)
            self._held += hit
            new = [pool.allocate() for _ in range(need)]
            self._held += new
            self.connector.update_state_after_alloc(seq, hit + new, n_ext)
            pending.append((seq, hit, new, n_ext))
        if not pending:
            return
        try:
            self.connector.start_load_kv(kv_cache)
        except Exception as e:  # nothing is registered: the blocks go back now, the requests recompute
            self.load_failures += 1
            self.last_load_error = f"{type(e).__name__}: {e}"
            self.release()
            return
        for seq, hit, new, n_ext in pending:
            pool.cache_blocks(list(seq.token_ids[: (len(hit) + len(new)) * bs]), hit + new)
            self._loaded[seq.seq_id] = self._loaded.get(seq.seq_id, 0) + n_ext
            self.tiers["external_hits"] += n_ext

    def admitted(self, out: Any) -> None:
        """After the schedule: each request scheduled for the first time, its prefix hit per tier."""
        for sch in out.scheduled:
            seq = sch.seq
            if getattr(seq, "first_scheduled_time", None) is None and sch.start == seq.num_computed_tokens:
                host = min(self._loaded.pop(seq.seq_id, 0), seq.num_computed_tokens)
                self.tiers["host_hit_tokens"] += host
                self.tiers["device_hit_tokens"] += seq.num_computed_tokens - host

    # -- after the forward: worker side -----------------------------------------------------------
    def save(self, kv_cache: Any, out: Any) -> None:
        """After the forward pass: the connector saves what the step computed."""
        self.connector.save_kv(kv_cache, out.scheduled)

    # -- the end of a step ------------------------------------------------------------------------
    def finished(self, seq: Any) -> None:
        self._loaded.pop(seq.seq_id, None)
        self._queried.discard(seq.seq_id)
        self.connector.request_finished(seq)

    def release(self) -> None:
        """The step is over: the blocks held for loads go back (cached, evictable at ref count 0)."""
        held, self._held = self._held, []
        for b in held:
            self.allocator.free(b)

    def close(self) -> None:
        close = getattr(self.connector, "close", None)
        if callable(close):
            close()

    def stats(self) -> dict:
        inner = getattr(self.connector, "stats", None)
        return {"connector": type(self.connector).__name__, **self.tiers, "load_failures": self.load_failures,
                **(inner() if callable(inner) else {})}


def plan_with_connector(plan: Any, connector: Any) -> Any:
    """``plan`` with a ``kv_connector`` stage naming the connector and what it does."""
    from dataclasses import replace

    describe = getattr(connector, "describe", None)
    text = describe() if callable(describe) else f"{type(connector).__name__} (a learner's connector)"
    return replace(plan, stages={**plan.stages, "kv_connector": text})


def build_connector(parts: Any, config: Any, layout: KVLayout) -> Any:
    """The engine's connector (None: none): ``parts.kv_connector`` (a class, built with ``(layout,
    config)``) if given, else the host tier when ``config.kv_offloading_size`` is set. (The one
    ``config.kv_transfer_config`` names is disagg.py's :func:`minipaged.disagg.build_any_connector`'s.)"""
    cls = getattr(parts, "kv_connector", None)
    if cls is None and getattr(config, "kv_offloading_size", None) is None:
        return None
    if config.tensor_parallel_size > 1:
        raise ValueError("a KV connector (kv_offloading_size, kv_connector) needs tensor_parallel_size=1: the KV "
                         "pages live in the worker processes there")
    if config.enable_prefix_caching is False:
        raise ValueError("a KV connector finds blocks by the prefix cache's hashes: turn prefix caching on "
                         "(enable_prefix_caching=True or None), or leave kv_offloading_size / kv_connector out")
    from .interfaces import KVConnector
    from .parts import check_part

    if cls is None:
        cls = HostOffloadConnector
    check_part(cls, KVConnector, "KV connector")
    conn = cls(layout, config)
    check_part(conn, KVConnector, "KV connector")
    return conn


__all__ = ["KVLayout", "HostKVStore", "HostOffloadConnector", "ConnectorDriver", "build_connector", "gather_blocks",
           "scatter_blocks", "full_block_hashes", "newly_full_blocks", "host_capacity_blocks", "plan_with_connector"]

