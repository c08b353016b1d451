"""Sharing KV blocks: the prefix cache (vLLM V1's automatic prefix caching) and copy-on-write.

Owns which *full* block holds which content: a chained hash per full block, the lookup of a
prompt's longest cached prefix, and the cached blocks nobody uses any more (kept, evictable in
LRU order). It sits in front of any block pool (a learner's too) and is itself a block pool,
so block tables and the scheduler use it unchanged. It never touches K/V data: copying a
block's K/V for copy-on-write is ``copy_blocks``, run by whoever owns the cache tensors.

Why this is safe: a full block's K/V depends only on its tokens and every token before them,
and the hash of block ``i`` is ``hash(hash of block i-1, token ids of block i)``, so equal
hashes mean equal prefixes, hence equal K/V. A full block is never written again, so it can be
shared read-only by any number of block tables. A block that someone must still write (the
partial last block of a forked sample) is copied first when it is shared: copy-on-write.
"""
from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from .block_allocator import BlockAllocatorError, OutOfBlocksError
from .interfaces import PROTOCOL_MEMBERS, PrefixCacheProtocol

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from .interfaces import BlockPool, BlockTableProtocol

ROOT_HASH = bytes(32)  # the "parent" of a sequence's first block


# -- the contract: minipaged.interfaces.PrefixCacheProtocol (re-exported here) ----------------
PREFIX_CACHE_MEMBERS = PROTOCOL_MEMBERS[PrefixCacheProtocol]


# -- the hash chain --------------------------------------------------------------------------
def hash_block(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """sha256 over the parent's hash and the block's token ids (stable across processes,
    unlike Python's salted ``hash``)."""
    ids = [int(t) for t in token_ids]
    return hashlib.sha256(bytes(parent) + struct.pack(f"<{len(ids)}q", *ids)).digest()


def block_hashes(token_ids: Sequence[int], block_size: int, parent: bytes = ROOT_HASH, hasher=hash_block) -> list[bytes]:
    """The chained hashes of the *full* blocks of ``token_ids``; a partial tail has none."""
    out = []
    for i in range(len(token_ids) // block_size):
        parent = hasher(parent, token_ids[i * block_size : (i + 1) * block_size])
        out.append(parent)
    return out


# -- the reference prefix cache ---------------------------------------------------------------
class PrefixCache:
    """The reference :class:`PrefixCacheProtocol`, over any block pool.

    Each cached block carries one reference of the cache's own in the inner pool, so the inner
    pool never hands it out while it is cached; ``ref_count`` subtracts it. The evictable
    blocks (cached, no block table holds them) sit in an ordered dict, least recently
    released first.
    """

    def __init__(self, pool: "BlockPool") -> None:
        self.pool = pool
        self.num_blocks = pool.num_blocks
        self.block_size = pool.block_size
        self._block_of: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self.num_evictions = 0

    # -- the block pool, as block tables see it --------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._block_of)

    def ref_count(self, block_id: int) -> int:
        return self.pool.ref_count(block_id) - (1 if block_id in self._hash_of else 0)

    def allocate(self) -> int:
        if self.pool.num_free_blocks > 0:
            return self.pool.allocate()
        if not self._evictable:
            raise OutOfBlocksError(
                f"no free KV block: all {self.num_blocks} blocks are held by block tables "
                f"({self.num_cached_blocks} of them also cached). Free or preempt a sequence, or give "
                "the engine a larger KV budget."
            )
        block_id, _ = self._evictable.popitem(last=False)
        del self._block_of[self._hash_of.pop(block_id)]
        self.num_evictions += 1
        return block_id  # the cache's reference becomes the caller's: ref count 1

    def free(self, block_id: int) -> None:
        if self.ref_count(block_id) <= 0:
            raise BlockAllocatorError(
                f"double free: block {block_id} is held by no block table"
                + (" (it is cached, waiting to be reused or evicted)" if block_id in self._hash_of else "")
                + ". Each block table must free a block once."
            )
        self.pool.free(block_id)
        if block_id in self._hash_of and self.pool.ref_count(block_id) == 1:
            self._evictable[block_id] = None  # most recently released: evicted last

    def incref(self, block_id: int) -> None:
        if block_id in self._evictable:
            del self._evictable[block_id]  # a cache hit revives it
        elif self.ref_count(block_id) <= 0:
            raise BlockAllocatorError(f"cannot share block {block_id}: it is free (ref count 0); allocate it first")
        self.pool.incref(block_id)

    # -- caching ---------------------------------------------------------------------------
    def hash_block(self, parent: bytes, token_ids: Sequence[int]) -> bytes:
        return hash_block(parent, token_ids)

    def match_prefix(self, token_ids: Sequence[int]) -> list[int]:
        usable = list(token_ids)[:-1]  # the last token is always recomputed: it gives the logits
        blocks = []
        for h in block_hashes(usable, self.block_size, hasher=self.hash_block):
            b = self._block_of.get(h)
            if b is None:
                break
            blocks.append(b)
        return blocks

    def cache_blocks(self, token_ids: Sequence[int], blocks: Sequence[int]) -> None:
        bs = self.block_size
        parent = ROOT_HASH
        for i in range(min(len(token_ids) // bs, len(blocks))):
            b = blocks[i]
            known = self._hash_of.get(b)
            # a block cached already is this very block of this sequence: its hash is the parent
            # of the next, no need to hash it again (so a long sequence costs one hash per new block)
            h = known if known is not None else self.hash_block(parent, token_ids[i * bs : (i + 1) * bs])
            if known is None:
                self._insert(h, b)
            parent = h

    def _insert(self, block_hash: bytes, block_id: int) -> None:
        if block_hash in self._block_of:
            return  # the same content is cached in another block already: keep that one
        if self.ref_count(block_id) <= 0:
            raise BlockAllocatorError(f"cannot cache block {block_id}: no block table holds it, so its K/V may be stale")
        self._block_of[block_hash] = block_id
        self._hash_of[block_id] = block_hash
        self.pool.incref(block_id)  # the cache's own hold

    # -- for checks and pictures -----------------------------------------------------------
    def is_cached(self, block_id: int) -> bool:
        return block_id in self._hash_of

    def evictable(self) -> list[int]:
        """Cached blocks at ref count 0, least recently released (the next evicted) first."""
        return list(self._evictable)

    def reset(self) -> bool:
        """Forget every cached block (vLLM's ``reset_prefix_cache``): evictable ones go back to the
        pool. Refused (False, nothing changed) while a block table holds a cached block."""
        if len(self._evictable) != len(self._hash_of):
            return False
        while self._evictable:
            block_id, _ = self._evictable.popitem(last=False)
            del self._block_of[self._hash_of.pop(block_id)]
            self.pool.free(block_id)  # the cache's own hold
        return True

    def _check_internal(self) -> None:
        assert len(self._block_of) == len(self._hash_of), "the hash -> block and block -> hash maps disagree"
        for h, b in self._block_of.items():
            assert self._hash_of.get(b) == h, f"block {b} is cached under two different hashes"
            assert self.pool.ref_count(b) >= 1, f"cached block {b} is free in the inner pool: it could be handed out twice"
        for b in self._evictable:
            assert b in self._hash_of, f"evictable block {b} is not cached"
            assert self.ref_count(b) == 0, f"evictable block {b} is held by {self.ref_count(b)} block table(s)"
        for b in self._hash_of:
            if self.ref_count(b) == 0:
                assert b in self._evictable, f"cached block {b} at ref count 0 is not evictable (it leaked)"
        inner_check = getattr(self.pool, "_check_internal", None)
        if inner_check is not None:
            inner_check()

    def __repr__(self) -> str:
        return (f"PrefixCache(num_blocks={self.num_blocks}, block_size={self.block_size}, free={self.num_free_blocks}, "
                f"cached={self.num_cached_blocks}, evictable={len(self._evictable)}, evictions={self.num_evictions})")


def check_prefix_cache(cache: Any) -> None:
    """The pool's invariants seen through the cache, plus the reference's internal ones."""
    from .parts import check_pool

    check_pool(cache)
    assert cache.num_cached_blocks >= 0 and cache.num_evictions >= 0


# -- what the scheduler does with it ----------------------------------------------------------
@dataclass
class PrefixStats:
    """Hit rate in prompt tokens, counted once per admission (a retry after a full pool is not counted)."""

    queried_tokens: int = 0
    hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


def cache_computed_blocks(cache: Any, token_ids: Sequence[int], blocks: Sequence[int], start: int, end: int) -> None:
    """After a step computed the K/V of positions ``start..end-1``: cache the blocks that became
    full (nothing to do when no block boundary was crossed)."""
    bs = cache.block_size
    if end // bs > start // bs:
        cache.cache_blocks(list(token_ids[: (end // bs) * bs]), list(blocks))


# -- copy-on-write ----------------------------------------------------------------------------
def blocks_to_write(table: "BlockTableProtocol", start: int, end: int) -> list[int]:
    """Logical indices of the table's existing blocks that positions ``start..end-1`` write into."""
    bs = table.block_size
    if end <= start:
        return []
    last = min((end - 1) // bs, len(table.blocks) - 1)
    return list(range(start // bs, last + 1))


def num_cow_blocks(table: "BlockTableProtocol", start: int, end: int) -> int:
    """How many fresh blocks a write of positions ``start..end-1`` needs for copy-on-write."""
    return sum(1 for i in blocks_to_write(table, start, end) if table.allocator.ref_count(table.blocks[i]) > 1)


def copy_on_write(table: "BlockTableProtocol", start: int, end: int) -> list[tuple[int, int]]:
    """Before positions ``start..end-1`` are written: every existing block they touch that
    another table shares (ref count > 1) is replaced by a fresh block, and the shared one loses
    this table's reference. Returns the ``(src, dst)`` pairs whose K/V must be copied (with
    ``copy_blocks``) before the write. All or nothing: raises OutOfBlocksError and changes
    nothing when the pool cannot give every copy."""
    pool = table.allocator
    shared = [i for i in blocks_to_write(table, start, end) if pool.ref_count(table.blocks[i]) > 1]
    if len(shared) > pool.num_free_blocks:
        raise OutOfBlocksError(
            f"copy-on-write needs {len(shared)} fresh block(s) but the pool has {pool.num_free_blocks} free"
        )
    pairs = []
    for i in shared:
        src = table.blocks[i]
        dst = pool.allocate()
        table.blocks[i] = dst
        pool.free(src)  # its other holders keep it
        pairs.append((src, dst))
    return pairs


def copy_blocks(kv_cache: Any, pairs: Sequence[tuple[int, int]]) -> None:
    """Copy K and V of block ``src`` into block ``dst`` in every layer, for each pair."""
    if not pairs:
        return
    import torch

    device = kv_cache.k[0].device
    src = torch.tensor([p[0] for p in pairs], dtype=torch.long, device=device)
    dst = torch.tensor([p[1] for p in pairs], dtype=torch.long, device=device)
    from .kv_quant import copy_blocks as copy_layer_blocks

    for layer in range(len(kv_cache.k)):  # a copied block takes its scales with it (8-bit KV, per block)
        copy_layer_blocks(kv_cache.k[layer], src, dst)
        copy_layer_blocks(kv_cache.v[layer], src, dst)


__all__ = [
    "ROOT_HASH", "PrefixCacheProtocol", "PREFIX_CACHE_MEMBERS", "hash_block", "block_hashes", "PrefixCache",
    "check_prefix_cache", "PrefixStats", "cache_computed_blocks", "blocks_to_write", "num_cow_blocks",
    "copy_on_write", "copy_blocks",
]
