"""Prefill and decode on separate engines: a KV connector that moves a prompt's blocks over torch.distributed.

Owns the transfer connector (:class:`TorchDistributedConnector`, named in ``kv_transfer_config``
as vLLM's connectors are), its link between two engines, the handshake, and what a fault does.

- ``kv_producer`` (rank 0) prefills: when a step finishes a request's prompt, ``save_kv`` sends the
  prompt's full blocks (their chained hashes and K/V) to the consumer and waits for its
  acknowledgement, within ``transfer_timeout_s``.
- ``kv_consumer`` (rank 1) decodes: a receiver thread stores every block it receives in a host
  store keyed by hash (the host tier's :class:`minipaged.kv_connector.HostKVStore`, LRU); when the
  same prompt arrives, ``get_num_new_matched_tokens`` finds its blocks there and the engine loads
  them instead of computing them: only the last prompt token is computed (for the logits).
- ``kv_both``: sends what it prefills and receives what its peer sends (``kv_rank`` says which of
  the two ranks it is).

The link: rank 0 hosts a ``torch.distributed.TCPStore`` on ``kv_ip:kv_port``; each consumer that
connects writes its handshake (model, block size, dtype, KV shape) there, and rank 0 answers with a
verdict: a mismatch is refused, naming both values. The data then goes over a two-rank gloo process
group (``ProcessGroupGloo``, NCCL's place on GPUs) built on that store, under a fresh prefix each time
a consumer connects, so a restarted consumer is taken back. No hand-written socket protocol.

Faults lose nothing: a producer that dies mid-transfer leaves the consumer without those blocks
(nothing partial is stored), so it prefills locally; a transfer that times out closes the link and
the producer goes on serving (its blocks are freed as usual) and waits for a consumer again; the
requests of a consumer whose link is down are prefilled locally. ``stats()`` counts each case.
"""
from __future__ import annotations

import atexit
import datetime
import json
import os
import threading
import time
import weakref
from typing import Any

import torch

from .kv_connector import ConnectorDriver, HostKVStore, HostOffloadConnector, KVLayout, full_block_hashes, gather_blocks

ROLES = ("kv_producer", "kv_consumer", "kv_both")
DEFAULTS = {"kv_ip": "127.0.0.1", "kv_port": 14579, "kv_buffer_size": 2**28}
TIMEOUT_S = 10.0  # transfer_timeout_s: one request's blocks, sent and acknowledged
CONNECT_TIMEOUT_S = 30.0  # connect_timeout_s: a consumer waits this long for its producer
KEYS = ("kv_connector", "kv_role", "kv_rank", "kv_ip", "kv_port", "kv_buffer_size", "kv_connector_extra_config",
        "kv_parallel_size")
_DATA_TAG, _ACK_TAG = 11, 12


def check_transfer_config(cfg: Any) -> dict:
    """``kv_transfer_config`` with its defaults filled in; a clear error for a bad one."""
    if not isinstance(cfg, dict):
        raise ValueError(f"kv_transfer_config must be a JSON object like "
                         f'{{"kv_connector": "TorchDistributedConnector", "kv_role": "kv_producer"}}, got {cfg!r}')
    unknown = [k for k in cfg if k not in KEYS]
    if unknown:
        raise ValueError(f"kv_transfer_config: unknown key(s) {unknown}; known: {', '.join(KEYS)}")
    if cfg.get("kv_connector") not in CONNECTORS:
        raise ValueError(f"kv_transfer_config: kv_connector {cfg.get('kv_connector')!r} is not one of minipaged's: "
                         f"{', '.join(CONNECTORS)}")
    if cfg.get("kv_role") not in ROLES:
        raise ValueError(f"kv_transfer_config: kv_role must be one of {', '.join(ROLES)}, got {cfg.get('kv_role')!r}")
    out = {**DEFAULTS, **cfg}
    rank = out.get("kv_rank")
    if rank is None:
        if out["kv_role"] == "kv_both":
            raise ValueError("kv_transfer_config: kv_role kv_both needs kv_rank 0 (hosts the link) or 1 (joins it)")
        rank = 0 if out["kv_role"] == "kv_producer" else 1
    if rank not in (0, 1):
        raise ValueError(f"kv_transfer_config: kv_rank must be 0 or 1 (two engines, one link), got {rank!r}")
    if out.get("kv_parallel_size", 2) != 2:
        raise ValueError("kv_transfer_config: kv_parallel_size must be 2 (one producer, one consumer)")
    out["kv_rank"] = rank
    extra = out.get("kv_connector_extra_config") or {}
    if not isinstance(extra, dict):
        raise ValueError("kv_transfer_config: kv_connector_extra_config must be a JSON object")
    out["extra"] = {"transfer_timeout_s": TIMEOUT_S, "connect_timeout_s": CONNECT_TIMEOUT_S, **extra}
    return out


def handshake_of(layout: KVLayout) -> dict:
    """What two engines must agree on before a block can move between them."""
    return {"model": layout.model_name, "block_size": layout.block_size, "dtype": str(layout.dtype).replace("torch.", ""),
            "num_layers": layout.num_layers, "num_kv_heads": layout.num_kv_heads, "head_dim": layout.head_dim}


def handshake_mismatch(producer: dict, consumer: dict) -> str | None:
    """None when the two agree, else the refusal, naming both values of every difference."""
    diffs = [f"{k}: producer {producer.get(k)!r}, consumer {consumer.get(k)!r}"
             for k in producer if producer.get(k) != consumer.get(k)]
    if not diffs:
        return None
    return ("KV transfer refused at the handshake, the two engines' KV blocks differ (" + "; ".join(diffs)
            + "): start both with the same model, block size and dtype")


class _Link:
    """One connection between the two ranks: a gloo process group over the shared store."""

    def __init__(self, store: Any, generation: int, rank: int, timeout_s: float) -> None:
        self.rank, self.peer, self.generation = rank, 1 - rank, generation
        pg_store = torch.distributed.PrefixStore(f"gen{generation}/pg/", store)
        self.pg = torch.distributed.ProcessGroupGloo(pg_store, rank, 2, datetime.timedelta(days=1))
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.up = True

    def send(self, tensors: list[torch.Tensor]) -> None:
        for t in tensors:
            self.pg.send([t.contiguous()], self.peer, _DATA_TAG).wait(self.timeout)

    def recv_into(self, t: torch.Tensor, timeout: datetime.timedelta | None = None) -> None:
        w = self.pg.recv([t], self.peer, _DATA_TAG)
        if timeout is None:
            w.wait()
        else:
            w.wait(timeout)


class TorchDistributedConnector(HostOffloadConnector):
    """The disaggregated-prefill :class:`minipaged.interfaces.KVConnector` (see the module's docstring).

    Built by the engine from ``EngineConfig.kv_transfer_config``; the scheduler side and the loads
    are the host tier's, over the store the receiver fills."""

    def __init__(self, layout: KVLayout, config: Any) -> None:
        cfg = check_transfer_config(getattr(config, "kv_transfer_config", None))
        capacity = max(1, int(cfg["kv_buffer_size"]) // layout.bytes_per_block)
        super().__init__(layout, config, capacity_blocks=capacity)
        self.cfg, self.role, self.rank = cfg, cfg["kv_role"], cfg["kv_rank"]
        self.sends = self.role in ("kv_producer", "kv_both")
        self.receives = self.role in ("kv_consumer", "kv_both")
        self.timeout_s = float(cfg["extra"]["transfer_timeout_s"])
        self.fault = cfg["extra"].get("fault")  # planted by the tests: "die_mid_transfer", "no_ack"
        self.hello = handshake_of(layout)
        self._lock = threading.RLock()  # the store: the receiver writes it, the engine thread reads it
        self.link: _Link | None = None
        self.last_error: str | None = None
        self.counts.update(sent_requests=0, sent_blocks=0, received_requests=0, received_blocks=0, transfer_failures=0,
                           link_generation=0)
        _LIVE.add(self)
        self._store_lock = threading.Lock()
        if self.rank == 0:
            self.tcp_store = torch.distributed.TCPStore(cfg["kv_ip"], int(cfg["kv_port"]), None, True,
                                                    datetime.timedelta(seconds=float(cfg["extra"]["connect_timeout_s"])),
                                                    wait_for_workers=False)
            self._generation = 0
            self._listen()
        else:
            self._connect()

    # -- the link ---------------------------------------------------------------------------
    def _listen(self) -> None:
        """Rank 0: wait, in a thread, for the next consumer to connect (a fresh generation)."""
        with self._store_lock:  # one client connection is never used by two threads at once
            self._generation += 1
            gen = self._generation
            self.tcp_store.set("generation", str(gen))

        def accept() -> None:
            try:  # this thread's own connection to the store
                store = torch.distributed.TCPStore(self.cfg["kv_ip"], self.port, None, False,
                                                   datetime.timedelta(seconds=60))
                store.wait([f"gen{gen}/hello"], datetime.timedelta(days=1))
            except Exception:  # noqa: BLE001 - the store closed: the engine is going away
                return
            peer = json.loads(store.get(f"gen{gen}/hello").decode())
            why = handshake_mismatch(self.hello, peer)
            if why is not None:  # refused; the next consumer gets a fresh generation, set before the verdict
                self.last_error = why
                self._listen()
                store.set(f"gen{gen}/verdict", why)
                return
            store.set(f"gen{gen}/verdict", "ok")
            try:
                link = _Link(store, gen, 0, self.timeout_s)
            except Exception as e:  # noqa: BLE001 - the consumer went away during the setup
                self.last_error = f"link setup failed: {e}"
                self._listen()
                return
            self._up(link)
            store.set(f"gen{gen}/ready", "1")  # the consumer's engine starts only now

        threading.Thread(target=accept, name="kv-transfer-accept", daemon=True).start()

    def _connect(self) -> None:
        """Rank 1: join rank 0's store, hand over the handshake, take the verdict, build the link."""
        cfg = self.cfg
        timeout = float(cfg["extra"]["connect_timeout_s"])
        try:
            store = torch.distributed.TCPStore(cfg["kv_ip"], int(cfg["kv_port"]), None, False,
                                               datetime.timedelta(seconds=timeout))
            gen = int(store.get("generation").decode())
        except Exception as e:  # noqa: BLE001
            raise RuntimeError(f"kv_transfer_config: no producer answered at {cfg['kv_ip']}:{cfg['kv_port']} within "
                               f"{timeout:.0f} s ({type(e).__name__}): start the kv_producer first") from None
        self.tcp_store = store
        store.set(f"gen{gen}/hello", json.dumps(self.hello))
        store.wait([f"gen{gen}/verdict"], datetime.timedelta(seconds=timeout))
        verdict = store.get(f"gen{gen}/verdict").decode()
        if verdict != "ok":
            raise ValueError(verdict)
        self._up(_Link(store, gen, 1, self.timeout_s))
        store.wait([f"gen{gen}/ready"], datetime.timedelta(seconds=timeout))  # the producer sends from now on

    def _up(self, link: _Link) -> None:
        self.link = link
        self.counts["link_generation"] = link.generation
        if self.receives:
            threading.Thread(target=self._receive, args=(link,), name="kv-transfer-recv", daemon=True).start()

    def _down(self, link: _Link, why: str) -> None:
        """The link failed: close it; rank 0 waits for a consumer again."""
        if not link.up:
            return
        link.up = False
        self.last_error = why
        self.counts["transfer_failures"] += 1
        if self.link is link:
            self.link = None
            if self.rank == 0:
                self._listen()

    # -- the receiver (consumer side) -------------------------------------------------------
    def _receive(self, link: _Link) -> None:
        shape = self.layout.block_shape
        while link.up:
            head = torch.zeros(1, dtype=torch.int64)
            try:
                link.recv_into(head)  # idle until the next request's blocks
                n = int(head[0])
                hashes = torch.zeros((n, 32), dtype=torch.uint8)
                data = torch.empty((n, *shape), dtype=self.layout.dtype)
                link.recv_into(hashes, link.timeout)
                link.recv_into(data, link.timeout)
            except Exception as e:  # noqa: BLE001 - the producer died or timed out mid-transfer: nothing is stored
                self._down(link, f"receiving blocks failed ({type(e).__name__}: {str(e)[:200]}); requests prefill locally")
                return
            with self._lock:
                for h, block in zip(hashes, data):
                    self.store.data[self.store.put(bytes(h.tolist()))] = block
                self.counts["received_requests"] += 1
                self.counts["received_blocks"] += n
            if self.fault == "no_ack":
                continue  # planted: the producer's wait for the acknowledgement times out
            try:
                link.pg.send([torch.tensor([n], dtype=torch.int64)], link.peer, _ACK_TAG).wait(link.timeout)
            except Exception as e:  # noqa: BLE001
                self._down(link, f"acknowledging failed ({type(e).__name__}); requests prefill locally")
                return

    # -- the producer side ------------------------------------------------------------------
    def _send_prompt(self, link: _Link, seq: Any, kv_cache: Any) -> None:
        n = min(seq.num_prompt_tokens // self.block_size, len(seq.block_table.blocks))
        if n == 0:
            return
        hashes = full_block_hashes(seq.prompt_token_ids, self.block_size)[:n]
        data = gather_blocks(kv_cache, seq.block_table.blocks[:n]).to("cpu")
        hash_t = torch.tensor([list(h) for h in hashes], dtype=torch.uint8)
        t = time.perf_counter()
        try:
            link.send([torch.tensor([n], dtype=torch.int64), hash_t])
            if self.fault == "die_mid_transfer":
                os._exit(17)  # planted: the producer's process dies between the hashes and the K/V
            link.send([data])
            ack = torch.zeros(1, dtype=torch.int64)
            link.pg.recv([ack], link.peer, _ACK_TAG).wait(link.timeout)
        except Exception as e:  # noqa: BLE001 - the consumer is gone or slow: the request goes on here
            self._down(link, f"sending {seq.seq_id!r}'s blocks failed ({type(e).__name__}: {str(e)[:200]}); "
                             "waiting for a consumer again")
            return
        self.counts["sent_requests"] += 1
        self.counts["sent_blocks"] += n
        self.counts["save_seconds"] += time.perf_counter() - t

    # -- the connector's members ------------------------------------------------------------
    def get_num_new_matched_tokens(self, seq: Any, num_computed_tokens: int) -> int:
        if not self.receives:
            return 0
        with self._lock:
            return super().get_num_new_matched_tokens(seq, num_computed_tokens)

    def update_state_after_alloc(self, seq: Any, block_ids: list, num_external_tokens: int) -> None:
        with self._lock:
            super().update_state_after_alloc(seq, block_ids, num_external_tokens)

    def start_load_kv(self, kv_cache: Any) -> None:
        with self._lock:
            super().start_load_kv(kv_cache)

    def save_kv(self, kv_cache: Any, scheduled: Any) -> None:
        link = self.link
        if not self.sends or link is None or not link.up:
            return
        for sch in scheduled:
            seq = sch.seq
            end = sch.start + sch.num_new_tokens
            if sch.start < seq.num_prompt_tokens <= end and not seq.is_finished and seq.block_table is not None:
                self._send_prompt(link, seq, kv_cache)  # the prompt is computed: its blocks go to the consumer
                if not link.up:
                    return

    def close(self) -> None:
        """Close the link (the receiver stops); idempotent. Called by ``engine.shutdown()`` and at exit."""
        link, self.link = self.link, None
        self.sends = False
        if link is not None and link.up:
            link.up = False
            try:
                link.pg.shutdown()
            except Exception:  # noqa: BLE001 - an older torch, or closed already
                pass

    @property
    def port(self) -> int:
        """The port the link's store listens on (``kv_port``; with 0, the one the system gave)."""
        return int(self.tcp_store.port)

    def describe(self) -> str:
        return (f"{type(self).__name__} ({self.role}, rank {self.rank} of 2, gloo over {self.cfg['kv_ip']}:{self.port}): "
                + ("sends each prompt's blocks after its prefill" if self.sends else "")
                + ("; " if self.sends and self.receives else "")
                + (f"loads received blocks (a store of {self.store.capacity} blocks) before the schedule" if self.receives else ""))

    def stats(self) -> dict:
        with self._lock:
            return {**super().stats(), "role": self.role, "link_up": bool(self.link and self.link.up),
                    "last_error": self.last_error}


CONNECTORS = {"TorchDistributedConnector": TorchDistributedConnector}


def build_any_connector(parts: Any, config: Any, layout: KVLayout) -> Any:
    """The engine's connector: the one ``config.kv_transfer_config`` names, else
    :func:`minipaged.kv_connector.build_connector`'s (a learner's, the host tier, or None)."""
    from dataclasses import replace

    from .kv_connector import build_connector

    transfer = getattr(config, "kv_transfer_config", None)
    if transfer is None:
        return build_connector(parts, config, layout)
    if getattr(parts, "kv_connector", None) is not None or getattr(config, "kv_offloading_size", None) is not None:
        raise ValueError("one KV connector at a time: kv_transfer_config names its own connector, so leave "
                         "kv_offloading_size and kv_connector out")
    cls = CONNECTORS[check_transfer_config(transfer)["kv_connector"]]
    return build_connector(replace(parts, kv_connector=cls), config, layout)
_LIVE: "weakref.WeakSet[TorchDistributedConnector]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:  # a receiver blocked in gloo must not outlive the interpreter
    for conn in list(_LIVE):
        conn.close()

def build_driver(engine: Any) -> "ConnectorDriver | None":
    """The engine's KV connector driver, or None when there is no connector (LLMEngine.__init__ calls it)."""
    conn = build_any_connector(engine.parts, engine.config, KVLayout.of_cache(engine.kv_cache, getattr(engine.model.config, "name", "")))
    if conn is not None and engine.config.kv_cache_dtype != "auto":
        raise ValueError(f"kv_cache_dtype={engine.config.kv_cache_dtype!r} with the KV connector {type(conn).__name__}: "
                         f"connectors copy pages without their 8-bit scales. Use kv_cache_dtype='auto' with a connector")
    return None if conn is None else ConnectorDriver(conn, engine.allocator, engine.scheduler, engine.config.max_num_seqs)


__all__ = ["build_driver", "TorchDistributedConnector", "CONNECTORS", "build_any_connector", "ROLES", "check_transfer_config", "handshake_of",
           "handshake_mismatch"]
