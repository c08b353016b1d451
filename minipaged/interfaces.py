"""The contracts between the engine and its parts: what a learner's piece must offer.

Owns the *seams*, nothing else: five ``typing.Protocol``s (the block pool, the block table,
the scheduler, the prefix cache, the KV connector) and the paged-attention function's signature. The records
the parts hand each other (``Sequence``, ``SchedulerOutput``, ...) live one floor down, in
:mod:`minipaged.data`, which is all this module imports of the package. Each Protocol holds exactly the
members a learner writes in the workbooks; everything else the engine, trace, viz or the
invariant checks need is a free function over those members (see ``parts.py``), so a learner's
class with only these members serves a real model.

Constructors are part of the contract:

- ``allocator_cls(num_blocks, block_size)`` -> a ``BlockPool``
- ``block_table_cls(allocator)`` -> a ``BlockTableProtocol`` (one per sequence)
- ``scheduler_cls(allocator, block_table_cls, config)`` -> a ``SchedulerProtocol``, where
  ``config`` is the engine's :class:`minipaged.config.EngineConfig`
- ``prefix_cache_cls(pool)`` -> a ``PrefixCacheProtocol`` in front of the block pool (when
  prefix caching is on)
- ``attention``: a ``PagedAttentionFn`` (or a name, see ``minipaged.attention.get_backend``)
- ``proposer``: a ``ProposerFn`` (speculative decoding's draft source, used with ``speculative_config``)
- ``fork_table``, ``copy_on_write``, ``free_table``: how block tables share blocks (``SharingFns``;
  minipaged's scheduler and beam search call them)
- ``kv_connector(layout, config)`` -> a ``KVConnector`` (another place a block's K/V lives: the host
  tier, another engine; used with ``kv_offloading_size`` or when given)

A part says which non-default settings it supports with a class attribute ``supports``
(a set of strings, e.g. ``{"chunked_prefill_off"}``), read from the class that defines the
method the setting changes. The engine refuses a setting that the part does not declare,
when it is built: nothing is silently ignored.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Protocol, Sequence as Seq, runtime_checkable

from .data import FinishReason, SchedulerOutput, Sequence

if TYPE_CHECKING:  # pragma: no cover
    import torch


@runtime_checkable
class BlockPool(Protocol):
    """A fixed pool of ``num_blocks`` physical KV blocks of ``block_size`` token slots.

    A block is free (ref count 0) or used (ref count >= 1). ``allocate`` hands out free blocks
    in free-list order (least recently freed first) and raises ``OutOfBlocksError`` when none
    is left; ``free`` drops one reference and raises ``BlockAllocatorError`` on a double free;
    ``incref`` adds a sharer to a used block.
    """

    num_blocks: int
    block_size: int

    @property
    def num_free_blocks(self) -> int: ...

    def allocate(self) -> int: ...

    def free(self, block_id: int) -> None: ...

    def incref(self, block_id: int) -> None: ...

    def ref_count(self, block_id: int) -> int: ...


@runtime_checkable
class BlockTableProtocol(Protocol):
    """One sequence's page table: logical block ``i`` lives in physical block ``blocks[i]``.

    ``num_tokens`` counts the token slots in use; ``len(blocks) == ceil(num_tokens / block_size)``.
    ``append_tokens`` is all or nothing: when the pool cannot cover the new tokens it raises
    ``OutOfBlocksError`` and leaves the table as it was.

    Optional member (see ``OPTIONAL_MEMBERS``), used with ``speculative_config``:
    ``truncate(num_tokens)`` rolls the table back to its first ``num_tokens`` token slots after a
    verifying step rejected drafts: ``num_tokens`` becomes ``num_tokens``, the first
    ``ceil(num_tokens / block_size)`` blocks stay, every other block goes back with
    ``allocator.free(b)``, last block first (a shared block loses this table's reference only); a
    ``num_tokens`` outside ``0..self.num_tokens`` raises ``ValueError`` and changes nothing. A
    table class without it is rolled back by ``minipaged.spec_decode.truncate_table`` over the
    members above, to the same state. Workbook 09 has you write it.
    """

    allocator: Any
    block_size: int
    blocks: list
    num_tokens: int

    def blocks_needed(self, num_new_tokens: int) -> int: ...

    def append_tokens(self, num_new_tokens: int = 1) -> list: ...

    def slot_mapping(self, start: int, end: int) -> "torch.Tensor": ...

    def free(self) -> None: ...


@runtime_checkable
class SchedulerProtocol(Protocol):
    """Who runs each step, and how many new tokens each.

    The workbook has you write ``add_request`` and ``schedule`` (the policy). ``update``,
    ``finish`` and ``abort`` are the bookkeeping every policy shares; a learner's scheduler
    inherits them from :class:`minipaged.Scheduler`.
    """

    waiting: Any  # a deque of Sequence, in arrival order
    running: list  # in admission order: the last one is preempted first

    def add_request(self, seq: "Sequence") -> bool: ...

    def schedule(self) -> "SchedulerOutput": ...

    def update(self, out: "SchedulerOutput", sampled: dict) -> list: ...

    def finish(self, seq: "Sequence", reason: "FinishReason") -> None: ...

    def abort(self, seq_id: Any) -> "Optional[Sequence]": ...

    def has_unfinished(self) -> bool: ...


@runtime_checkable
class PrefixCacheProtocol(BlockPool, Protocol):
    """A block pool in front of a block pool, that remembers full blocks by content: every
    :class:`BlockPool` member, with the meanings below, and the caching members.

    Constructor: ``prefix_cache_cls(pool)`` with any :class:`BlockPool`; the reference is
    :class:`minipaged.prefix_cache.PrefixCache`.

    Block-pool members, as seen by block tables and the scheduler:

    - ``ref_count(b)``: how many block tables hold ``b`` (the cache's own hold is not counted);
    - ``num_free_blocks``: blocks nobody uses: never-cached free blocks plus cached blocks at
      ref count 0 (those are *evictable*);
    - ``allocate()``: a never-cached free block if there is one, else the least recently
      released cached block at ref count 0, whose hash is dropped (an eviction); raises
      ``OutOfBlocksError`` when neither exists;
    - ``free(b)``: one reference fewer; a cached block reaching 0 stays cached, and becomes the
      most recently used evictable block; ``BlockAllocatorError`` on a block at ref count 0;
    - ``incref(b)``: one more sharer; a cached block at 0 is revived (no longer evictable).

    Caching members:

    - ``hash_block(parent, token_ids)``: the chained hash of one full block (``parent`` is the
      previous block's hash, ``minipaged.prefix_cache.ROOT_HASH`` for the first block);
    - ``match_prefix(token_ids)``: the cached blocks holding the longest prefix of
      ``token_ids`` made of whole blocks, never including the last token (it is always
      recomputed, so that there are logits to sample from). Changes nothing;
    - ``cache_blocks(token_ids, blocks)``: ``token_ids`` are a sequence's tokens whose K/V is
      computed, ``blocks`` its block table's blocks: every *full* block among them becomes
      findable by its chained hash (a partial block is still being written: never cached). A
      hash cached already keeps its block;
    - ``num_cached_blocks``: blocks findable by hash now; ``num_evictions``: hashes dropped so far.
    """

    num_evictions: int

    @property
    def num_cached_blocks(self) -> int: ...

    def hash_block(self, parent: bytes, token_ids: Seq[int]) -> bytes: ...

    def match_prefix(self, token_ids: Seq[int]) -> list[int]: ...

    def cache_blocks(self, token_ids: Seq[int], blocks: Seq[int]) -> None: ...


class PagedAttentionFn(Protocol):
    """``paged_attention(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale, out=None)``.

    q: (num_tokens, num_heads, head_dim), the new tokens of every sequence packed;
    k_cache, v_cache: (num_blocks, block_size, num_kv_heads, head_dim), new K/V already written;
    block_tables: (num_seqs, max_blocks) int32; context_lens: (num_seqs,) int32 (cached + new);
    query_start_loc: (num_seqs + 1,) int32, cumulative query lengths from 0.
    Returns (num_tokens, num_heads, head_dim), written into ``out`` when it is given.
    See ``minipaged.attention.reference`` for the exact maths.
    """

    def __call__(
        self,
        q: "torch.Tensor",
        k_cache: "torch.Tensor",
        v_cache: "torch.Tensor",
        block_tables: "torch.Tensor",
        context_lens: "torch.Tensor",
        query_start_loc: "torch.Tensor",
        scale: float,
        out: "Optional[torch.Tensor]" = None,
    ) -> "torch.Tensor": ...


class ProposerFn(Protocol):
    """``proposer(token_ids, num_tokens, min_n, max_n) -> list[int]``: up to ``num_tokens`` draft
    tokens for a sequence whose tokens so far are ``token_ids`` (a list of ints, never changed),
    looked up as an n-gram of ``min_n..max_n`` tokens; ``[]`` for none. The engine verifies every
    draft, so a proposer can only change speed, never the greedy tokens.
    See ``minipaged.spec_decode.propose_ngram`` for the reference rule.
    """

    def __call__(self, token_ids: "Seq[int]", num_tokens: int, min_n: int, max_n: int) -> "list[int]": ...


class SharingFns(Protocol):
    """Three functions over block tables (each an engine part of its own name; minipaged's are
    ``parts.fork_table``, ``prefix_cache.copy_on_write`` and ``parts.free_table``):

    - ``fork_table(table) -> table``: a new table of the same class over the same allocator that
      shares every block of ``table`` (each ref count up by one), with its own list and ``num_tokens``;
    - ``copy_on_write(table, start, end) -> [(src, dst), ...]``: before positions ``start..end-1`` are
      written, each block they fall in that another table shares (ref count > 1) is replaced by a
      fresh one; the pairs are copied before the write; all or nothing (OutOfBlocksError);
    - ``free_table(table) -> None``: a beam that falls out gives every block back at once (one
      reference each), and the table holds nothing.
    """

    def fork_table(self, table: BlockTableProtocol) -> BlockTableProtocol: ...

    def copy_on_write(self, table: BlockTableProtocol, start: int, end: int) -> "list[tuple[int, int]]": ...

    def free_table(self, table: BlockTableProtocol) -> None: ...


@runtime_checkable
class KVConnector(Protocol):
    """Where a block's K/V comes from besides the device pool, and where it goes after a step
    (vLLM V1's ``KVConnectorBase_V1``, with only what a host tier and disaggregated prefill need).

    Constructor: ``kv_connector_cls(layout, config)``: a :class:`minipaged.kv_connector.KVLayout`
    (layers, block size, KV heads, head dim, dtype, device) and the engine's EngineConfig. The
    reference is :class:`minipaged.kv_connector.HostOffloadConnector`. The engine calls it at fixed
    points of every step (``minipaged.kv_connector`` draws them), with prefix caching on.

    Scheduler side:

    - ``get_num_new_matched_tokens(seq, num_computed_tokens)``: how many tokens after the first
      ``num_computed_tokens`` (the device prefix cache's hit, whole blocks) this connector can
      provide: whole blocks, never the last token of ``seq.token_ids`` (it is recomputed for the
      logits); 0 for none. Changes nothing;
    - ``update_state_after_alloc(seq, block_ids, num_external_tokens)``: the engine allocated device
      blocks for them: ``block_ids`` are the blocks of the request's prefix, and the last
      ``num_external_tokens // block_size`` of them are this connector's to fill;
    - ``request_finished(seq)``: the sequence left the engine (finished, aborted or failed): forget it.

    Worker side:

    - ``start_load_kv(kv_cache)``: copy every block promised in ``update_state_after_alloc`` into
      ``kv_cache`` (its ``k[layer]`` / ``v[layer]`` tensors), now: before the step's schedule and
      forward pass. The engine registers those blocks in the prefix cache only after it returns; if
      it raises, the blocks are freed and the requests compute their prompts themselves;
    - ``save_kv(kv_cache, scheduled)``: after the forward pass; ``scheduled`` is the step's list of
      ``ScheduledSeq`` (positions ``start .. start + num_new_tokens - 1`` were computed).
    """

    def get_num_new_matched_tokens(self, seq: "Sequence", num_computed_tokens: int) -> int: ...

    def update_state_after_alloc(self, seq: "Sequence", block_ids: list, num_external_tokens: int) -> None: ...

    def request_finished(self, seq: "Sequence") -> None: ...

    def start_load_kv(self, kv_cache: Any) -> None: ...

    def save_kv(self, kv_cache: Any, scheduled: Seq[Any]) -> None: ...


_POOL_MEMBERS = ("num_blocks", "block_size", "num_free_blocks", "allocate", "free", "incref", "ref_count")
PROTOCOL_MEMBERS: dict[type, tuple[str, ...]] = {
    BlockPool: _POOL_MEMBERS,
    BlockTableProtocol: ("allocator", "block_size", "blocks", "num_tokens", "blocks_needed", "append_tokens", "slot_mapping", "free"),
    SchedulerProtocol: ("waiting", "running", "add_request", "schedule", "update", "finish", "abort", "has_unfinished"),
    PrefixCacheProtocol: _POOL_MEMBERS + ("hash_block", "match_prefix", "cache_blocks", "num_cached_blocks",
                                          "num_evictions"),
    KVConnector: ("get_num_new_matched_tokens", "update_state_after_alloc", "request_finished", "start_load_kv",
                  "save_kv"),
}

# Members a part may define, and the setting that uses them when it does: the engine asks the part
# (``type(part).member``) and otherwise does the same with the Protocol's members alone.
OPTIONAL_MEMBERS: dict[type, dict[str, str]] = {
    BlockTableProtocol: {"truncate": "speculative_config"},
}

__all__ = ["BlockPool", "BlockTableProtocol", "SchedulerProtocol", "PrefixCacheProtocol", "PagedAttentionFn", "ProposerFn", "SharingFns",
           "KVConnector",
           "PROTOCOL_MEMBERS", "OPTIONAL_MEMBERS"]
