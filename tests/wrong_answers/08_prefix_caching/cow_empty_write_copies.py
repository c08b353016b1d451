"""copy_on_write of an empty range (start == end) still copies the block that start falls in."""
CHECK = "minipaged.checks.prefix_cache:check_copy_on_write"
EXPECT = ["copy_on_write(children[0], 5, 5)", "a write of no positions"]
HINT = "a write of no positions (start == end) touches no block"

from _base import good_copy_on_write


def _shared(table, start, end):
    pool, bs = table.allocator, table.block_size
    last = min((end - 1) // bs, len(table.blocks) - 1)
    return [i for i in range(start // bs, last + 1) if pool.ref_count(table.blocks[i]) > 1]


def my_copy_on_write(table, start, end):
    return good_copy_on_write(table, start, end, shared=_shared)
