"""Copies shared blocks one by one until the pool runs out: the blocks copied before the error stay changed."""
CHECK = "minipaged.checks.prefix_cache:check_copy_on_write"
EXPECT = ["the pool is short", "all or nothing"]
HINT = "raise OutOfBlocksError BEFORE replacing any block"

from _base import shared_blocks


def my_copy_on_write(table, start, end):
    pool, pairs = table.allocator, []
    for i in shared_blocks(table, start, end):
        src, dst = table.blocks[i], pool.allocate()  # raises OutOfBlocksError when the pool is empty
        table.blocks[i] = dst
        pool.free(src)
        pairs.append((src, dst))
    return pairs
