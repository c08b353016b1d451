"""The prefix cache and copy-on-write, without a model.

Examples pin the rules (the chain, whole blocks only, the last token recomputed, LRU eviction,
a double free refused); a hypothesis state machine runs block tables over a PrefixCache in
front of a BlockAllocator (admission through match_prefix, appends, inserts, forks with
copy-on-write, frees) against a plain model of who holds what, with check_pool after every step.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from minipaged import parts
from minipaged.block_allocator import BlockAllocator, BlockAllocatorError, OutOfBlocksError
from minipaged.block_table import BlockTable
from minipaged.kv_cache import KVCache
from minipaged.prefix_cache import (
    PREFIX_CACHE_MEMBERS,
    ROOT_HASH,
    PrefixCache,
    PrefixCacheProtocol,
    block_hashes,
    check_prefix_cache,
    copy_blocks,
    copy_on_write,
    hash_block,
    num_cow_blocks,
)


def _cache(num_blocks=8, block_size=4) -> PrefixCache:
    return PrefixCache(BlockAllocator(num_blocks, block_size))


def _admit(cache: PrefixCache, tokens: list[int]) -> tuple[BlockTable, int]:
    """What the scheduler does: share the matched prefix, allocate the rest, cache what is full."""
    hit = cache.match_prefix(tokens)
    t = BlockTable(cache)
    for b in hit:
        cache.incref(b)
    t.blocks = list(hit)
    t.num_tokens = len(hit) * cache.block_size
    computed = t.num_tokens
    t.append_tokens(len(tokens) - computed)
    cache.cache_blocks(tokens, t.blocks)
    return t, computed


# -- the hash chain ---------------------------------------------------------------------------
def test_hash_is_stable_and_chained():
    a = hash_block(ROOT_HASH, [1, 2, 3, 4])
    assert a == hash_block(ROOT_HASH, (1, 2, 3, 4)) and len(a) == 32
    # the same tokens after a different parent are a different block: K/V depends on every earlier token
    assert hash_block(a, [1, 2, 3, 4]) != a
    assert hash_block(ROOT_HASH, [1, 2, 3, 5]) != a
    # a fixed value: the hash does not depend on the process (Python's hash() is salted per process)
    assert a.hex()[:16] == hash_block(ROOT_HASH, [1, 2, 3, 4]).hex()[:16]
    assert hash_block(ROOT_HASH, [1]) != hash_block(ROOT_HASH, [256])


def test_block_hashes_cover_full_blocks_only():
    toks = list(range(10))
    hs = block_hashes(toks, 4)
    assert len(hs) == 2, "10 tokens in blocks of 4: two full blocks, the tail of 2 has no hash"
    assert hs[0] == hash_block(ROOT_HASH, [0, 1, 2, 3]) and hs[1] == hash_block(hs[0], [4, 5, 6, 7])
    assert block_hashes(toks[:8], 4) == hs


# -- lookup, insert, eviction -----------------------------------------------------------------
def test_reference_fits_the_protocol():
    c = _cache()
    assert isinstance(c, PrefixCacheProtocol)
    assert all(hasattr(c, m) for m in PREFIX_CACHE_MEMBERS)
    parts.check_part(c, parts.BlockPool)


def test_shared_prefix_is_found_and_shared():
    c = _cache(8, 4)
    t1, hit1 = _admit(c, list(range(10)))
    assert hit1 == 0 and c.num_cached_blocks == 2
    t2, hit2 = _admit(c, list(range(8)) + [99, 98, 97])
    assert hit2 == 8 and t2.blocks[:2] == t1.blocks[:2]
    assert [c.ref_count(b) for b in t1.blocks[:2]] == [2, 2] and c.ref_count(t1.blocks[2]) == 1
    check_prefix_cache(c)


def test_the_last_prompt_token_is_always_recomputed():
    c = _cache(8, 4)
    _admit(c, list(range(8)))
    assert c.num_cached_blocks == 2
    # an 8-token prompt that is fully cached: only the first block may be used, so that the
    # 8th token runs through the model and gives the logits of the next token
    assert len(c.match_prefix(list(range(8)))) == 1
    assert len(c.match_prefix(list(range(9)))) == 2


def test_a_different_first_block_matches_nothing():
    c = _cache(8, 4)
    _admit(c, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    # block 2 has the same tokens, but after another first block: no match at all
    assert c.match_prefix([0, 2, 3, 4, 5, 6, 7, 8, 9]) == []


def test_released_blocks_stay_cached_and_are_evicted_lru():
    c = _cache(4, 2)
    t1, _ = _admit(c, [1, 2, 3, 4, 5])  # blocks: [1,2] [3,4] cached, [5] partial
    full = t1.blocks[:2]
    t1.free()
    assert c.num_free_blocks == 4 and c.num_cached_blocks == 2
    assert all(c.ref_count(b) == 0 for b in range(4))
    check_prefix_cache(c)
    # still findable after the request ended
    assert c.match_prefix([1, 2, 3, 4, 0]) == full
    # never-cached free blocks are used before any cached one is evicted
    fresh = [c.allocate(), c.allocate()]
    assert not any(c.is_cached(b) for b in fresh) and c.num_evictions == 0
    # then the least recently released cached block goes first: t1 freed its blocks last to first
    order = c.evictable()
    b = c.allocate()
    assert b == order[0] and c.num_evictions == 1 and c.num_cached_blocks == 1
    check_prefix_cache(c)


def test_a_hit_revives_an_evictable_block():
    c = _cache(3, 2)
    t1, _ = _admit(c, [1, 2, 3])
    t1.free()
    cached = c.match_prefix([1, 2, 3])
    assert len(cached) == 1 and c.ref_count(cached[0]) == 0
    c.incref(cached[0])
    assert c.ref_count(cached[0]) == 1 and cached[0] not in c.evictable()
    # a revived block is never evicted: allocate everything else, then the pool is dry
    c.allocate(), c.allocate()
    with pytest.raises(OutOfBlocksError):
        c.allocate()
    check_prefix_cache(c)


def test_misuse_is_refused_and_changes_nothing():
    c = _cache(3, 2)
    t, _ = _admit(c, [1, 2, 3])
    t.free()
    b = c.evictable()[0]
    before = (parts.ref_counts(c), c.num_free_blocks, c.evictable())
    with pytest.raises(BlockAllocatorError, match="double free"):
        c.free(b)  # cached but held by nobody
    free_b = next(x for x in range(3) if not c.is_cached(x))
    with pytest.raises(BlockAllocatorError, match="no block table holds it"):
        c.cache_blocks([9, 9], [free_b])  # nobody holds it: its K/V may be stale
    with pytest.raises(BlockAllocatorError):
        c.incref(free_b)
    assert (parts.ref_counts(c), c.num_free_blocks, c.evictable()) == before
    check_prefix_cache(c)


def test_a_known_hash_keeps_its_first_block():
    c = _cache(6, 2)
    a, b = BlockTable(c), BlockTable(c)
    a.append_tokens(3), b.append_tokens(3)  # the same tokens computed twice (one step, before any was cached)
    c.cache_blocks([1, 2, 3], a.blocks)
    c.cache_blocks([1, 2, 3], b.blocks)
    assert c.num_cached_blocks == 1 and c.is_cached(a.blocks[0]) and not c.is_cached(b.blocks[0])
    assert not c.is_cached(a.blocks[1]), "a partial block is never cached"
    c.cache_blocks([1, 2, 3, 4], a.blocks)
    assert c.num_cached_blocks == 2 and c.is_cached(a.blocks[1])
    assert c.match_prefix([1, 2, 3, 4, 5]) == a.blocks[:2]


def test_prefix_cache_over_a_learner_style_pool():
    """Only the BlockPool Protocol's members: the cache needs nothing else of the pool."""
    from collections import deque

    class Pool:
        def __init__(self, num_blocks, block_size=16):
            self.num_blocks, self.block_size = num_blocks, block_size
            self.rc = [0] * num_blocks
            self.fl = deque(range(num_blocks))

        @property
        def num_free_blocks(self):
            return len(self.fl)

        def allocate(self):
            if not self.fl:
                raise OutOfBlocksError("full")
            b = self.fl.popleft()
            self.rc[b] = 1
            return b

        def free(self, b):
            if self.rc[b] == 0:
                raise BlockAllocatorError("double free")
            self.rc[b] -= 1
            if self.rc[b] == 0:
                self.fl.append(b)

        def incref(self, b):
            if self.rc[b] == 0:
                raise BlockAllocatorError("free")
            self.rc[b] += 1

        def ref_count(self, b):
            return self.rc[b]

    c = PrefixCache(Pool(6, 2))
    t1, _ = _admit(c, [5, 6, 7, 8, 9])
    t2, hit = _admit(c, [5, 6, 7, 8, 1])
    assert hit == 4 and t2.blocks[:2] == t1.blocks[:2]
    t1.free(), t2.free()
    check_prefix_cache(c)
    assert c.num_free_blocks == 6


# -- copy-on-write ----------------------------------------------------------------------------
def test_copy_on_write_copies_only_shared_blocks():
    c = _cache(8, 4)
    kv = KVCache(2, 8, 4, 1, 2)
    parent = BlockTable(c)
    parent.append_tokens(6)  # blocks [full, partial]
    for layer in range(2):
        kv.k[layer][parent.blocks[1]] = 7.0 + layer
        kv.v[layer][parent.blocks[1]] = -7.0
    child = parts.fork_table(parent)
    assert num_cow_blocks(child, 6, 7) == 1 and num_cow_blocks(child, 2, 3) == 1 and num_cow_blocks(child, 8, 9) == 0
    shared = child.blocks[1]
    child.append_tokens(1)
    pairs = copy_on_write(child, 6, 7)
    assert len(pairs) == 1 and pairs[0][0] == shared and child.blocks[1] == pairs[0][1] != shared
    assert c.ref_count(shared) == 1 and c.ref_count(child.blocks[1]) == 1
    copy_blocks(kv, pairs)
    for layer in range(2):
        assert torch.equal(kv.k[layer][child.blocks[1]], kv.k[layer][shared])
        assert torch.equal(kv.v[layer][child.blocks[1]], kv.v[layer][shared])
    # the last holder writes in place: nothing left to copy
    assert copy_on_write(parent, 6, 7) == []
    # the full first block stays shared: a write never touches it
    assert c.ref_count(parent.blocks[0]) == 2
    parent.free(), child.free()
    check_prefix_cache(c)
    assert c.num_free_blocks == 8


def test_copy_on_write_is_all_or_nothing():
    c = _cache(3, 2)
    parent = BlockTable(c)
    parent.append_tokens(3)
    child = parts.fork_table(parent)
    c.allocate()  # the pool is now dry
    before = (list(child.blocks), parts.ref_counts(c))
    with pytest.raises(OutOfBlocksError):
        copy_on_write(child, 0, 4)
    assert (list(child.blocks), parts.ref_counts(c)) == before


# -- everything together, against a plain model -----------------------------------------------
class SharingMachine(RuleBasedStateMachine):
    """Tables admitted through the cache, grown, forked, written (CoW) and freed."""

    @initialize(num_blocks=st.integers(2, 14), block_size=st.sampled_from([1, 2, 3, 4]))
    def setup(self, num_blocks, block_size):
        self.c = PrefixCache(BlockAllocator(num_blocks, block_size))
        self.bs = block_size
        self.tables: list[tuple[BlockTable, list[int]]] = []  # (table, its tokens)

    def _cache_full(self, t, toks):
        self.c.cache_blocks(toks[: t.num_tokens], t.blocks)

    @rule(toks=st.lists(st.integers(0, 3), min_size=1, max_size=12))
    def admit(self, toks):
        hit = self.c.match_prefix(toks)
        assert len(hit) * self.bs <= len(toks) - 1, "the last prompt token must be recomputed"
        expect = block_hashes(toks[:-1], self.bs)[: len(hit)]
        assert [self.c._hash_of[b] for b in hit] == expect, "a hit must hold exactly that prefix"
        need = parts.cdiv(len(toks), self.bs) - len(hit)
        revived = sum(1 for b in hit if self.c.ref_count(b) == 0)
        if need > self.c.num_free_blocks - revived:
            return  # would not fit: the scheduler waits
        t = BlockTable(self.c)
        for b in hit:
            self.c.incref(b)
        t.blocks, t.num_tokens = list(hit), len(hit) * self.bs
        t.append_tokens(len(toks) - t.num_tokens)
        self._cache_full(t, toks)
        self.tables.append((t, list(toks)))

    @precondition(lambda self: self.tables)
    @rule(data=st.data(), tok=st.integers(0, 3))
    def decode(self, data, tok):
        t, toks = data.draw(st.sampled_from(self.tables))
        pos = t.num_tokens
        need = t.blocks_needed(1) + num_cow_blocks(t, pos, pos + 1)
        if need > self.c.num_free_blocks:
            return  # the scheduler would preempt someone first
        copy_on_write(t, pos, pos + 1)
        t.append_tokens(1)
        for i in range(pos // self.bs, len(t.blocks)):
            assert self.c.ref_count(t.blocks[i]) == 1, "a block written to must be this table's alone"
        toks.append(tok)
        self._cache_full(t, toks)

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def fork(self, data):
        t, toks = data.draw(st.sampled_from(self.tables))
        self.tables.append((parts.fork_table(t), list(toks)))

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def free(self, data):
        t, _ = self.tables.pop(data.draw(st.integers(0, len(self.tables) - 1)))
        t.free()

    @invariant()
    def consistent(self):
        if not hasattr(self, "c"):
            return
        check_prefix_cache(self.c)
        holders: dict[int, int] = {}
        for t, toks in self.tables:
            parts.check_table(t)
            for b in t.blocks:
                holders[b] = holders.get(b, 0) + 1
        for b in range(self.c.num_blocks):
            assert self.c.ref_count(b) == holders.get(b, 0), f"block {b}: leaked or over-freed"
        # a cached block that a live table holds is one of its full blocks, under that block's chained hash
        for t, toks in self.tables:
            chain = block_hashes(toks, self.bs)
            for i, b in enumerate(t.blocks):
                if self.c.is_cached(b):
                    assert i < len(chain) and self.c._hash_of[b] == chain[i], f"block {b} is cached with the wrong content"

    def teardown(self):
        if not hasattr(self, "c"):
            return
        for t, _ in self.tables:
            t.free()
        check_prefix_cache(self.c)
        assert self.c.num_free_blocks == self.c.num_blocks, "a block leaked after every table was freed"


SharingMachine.TestCase.settings = settings(
    max_examples=80, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_sharing_state_machine = SharingMachine.TestCase


# -- workbook 08's checks pass the reference, played by a subclass (the checks refuse minipaged's own) --
class _RefCache(PrefixCache):
    def hash_block(self, parent, token_ids):
        return super().hash_block(parent, token_ids)

    def match_prefix(self, token_ids):
        return super().match_prefix(token_ids)

    def cache_blocks(self, token_ids, blocks):
        return super().cache_blocks(token_ids, blocks)

    def allocate(self):
        return super().allocate()

    def free(self, b):
        return super().free(b)

    def incref(self, b):
        return super().incref(b)

    def ref_count(self, b):
        return super().ref_count(b)

    num_free_blocks = property(lambda self: PrefixCache.num_free_blocks.fget(self))
    num_cached_blocks = property(lambda self: PrefixCache.num_cached_blocks.fget(self))


def test_workbook_08_checks_refuse_the_reference_in_the_learners_place(capsys):
    """Handing in minipaged's own prefix cache (even wrapped in a subclass) is delegation, not an
    answer: every check refuses it (the solved workbook passes: tests/test_grading.py)."""
    from minipaged.checks import CheckFailed
    from minipaged.checks import prefix_cache as pc

    with pytest.raises(CheckFailed, match="minipaged's own"):
        pc.check(_RefCache, lambda table, start, end: copy_on_write(table, start, end))
    with pytest.raises(CheckFailed, match="minipaged's own"):
        pc.check_copy_on_write(copy_on_write)
    with pytest.raises(CheckFailed, match="minipaged's own"):
        pc.check_hash_chain(PrefixCache)
