"""A correct prefix cache and copy-on-write that the wrong answers here change one method of (not a wrong answer itself)."""
import hashlib
from collections import OrderedDict

from minipaged import BlockAllocatorError, OutOfBlocksError
from minipaged.prefix_cache import ROOT_HASH


class GoodPrefixCache:
    def __init__(self, pool):
        self.pool = pool
        self.num_blocks, self.block_size = pool.num_blocks, pool.block_size
        self.num_evictions = 0
        self.block_of, self.hash_of, self.evictable = {}, {}, OrderedDict()

    def hash_block(self, parent, token_ids):
        return hashlib.sha256(parent + str(list(token_ids)).encode()).digest()

    def chain(self, token_ids, n_blocks):
        bs, parent, out = self.block_size, ROOT_HASH, []
        for i in range(n_blocks):
            parent = self.hash_block(parent, token_ids[i * bs : (i + 1) * bs])
            out.append(parent)
        return out

    def usable(self, token_ids):
        return list(token_ids)[:-1]

    def match_prefix(self, token_ids):
        usable = self.usable(token_ids)
        blocks = []
        for h in self.chain(usable, len(usable) // self.block_size):
            if h not in self.block_of:
                break
            blocks.append(self.block_of[h])
        return blocks

    def num_full(self, token_ids, blocks):
        return min(len(token_ids) // self.block_size, len(blocks))

    def cache_blocks(self, token_ids, blocks):
        for i, h in enumerate(self.chain(token_ids, self.num_full(token_ids, blocks))):
            b = blocks[i]
            if h in self.block_of or b in self.hash_of:
                continue
            self.block_of[h], self.hash_of[b] = b, h
            self.pool.incref(b)

    @property
    def num_cached_blocks(self):
        return len(self.block_of)

    def ref_count(self, b):
        return self.pool.ref_count(b) - (1 if b in self.hash_of else 0)

    @property
    def num_free_blocks(self):
        return self.pool.num_free_blocks + len(self.evictable)

    def evict(self):
        b, _ = self.evictable.popitem(last=False)
        return b

    def allocate(self):
        if self.pool.num_free_blocks > 0:
            return self.pool.allocate()
        if not self.evictable:
            raise OutOfBlocksError("full")
        b = self.evict()
        del self.block_of[self.hash_of.pop(b)]
        self.num_evictions += 1
        return b

    def free(self, b):
        if self.ref_count(b) == 0:
            raise BlockAllocatorError(f"double free of {b}")
        self.pool.free(b)
        if b in self.hash_of and self.ref_count(b) == 0:
            self.evictable[b] = None

    def incref(self, b):
        self.evictable.pop(b, None)
        self.pool.incref(b)


def shared_blocks(table, start, end):
    pool, bs = table.allocator, table.block_size
    if end <= start:
        return []  # a write of no positions touches no block
    last = min((end - 1) // bs, len(table.blocks) - 1)
    return [i for i in range(start // bs, last + 1) if pool.ref_count(table.blocks[i]) > 1]


def good_copy_on_write(table, start, end, shared=shared_blocks):
    pool = table.allocator
    idx = shared(table, start, end)
    if len(idx) > pool.num_free_blocks:
        raise OutOfBlocksError("no room")
    pairs = []
    for i in idx:
        src, dst = table.blocks[i], pool.allocate()
        table.blocks[i] = dst
        pool.free(src)
        pairs.append((src, dst))
    return pairs


def good_fork_table(table):
    child = type(table)(table.allocator)
    for b in table.blocks:
        table.allocator.incref(b)
    child.blocks = list(table.blocks)
    child.num_tokens = table.num_tokens
    return child


def good_free_table(table):
    for b in table.blocks:
        table.allocator.free(b)
    table.blocks = []
    table.num_tokens = 0
