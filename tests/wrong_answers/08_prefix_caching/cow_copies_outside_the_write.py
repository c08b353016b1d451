"""copy_on_write() copies every shared block of the table, not only those that positions start..end-1 fall in. The
hint must name the write's range, not blocks held alone (every block it copied is shared)."""
CHECK = "minipaged.checks.prefix_cache:check_copy_on_write"
EXPECT = ["the tables or ref counts differ after copy_on_write"]
UNEXPECTED = ["holds alone"]
HINT = "do not fall in: only the blocks the write touches"

from minipaged import OutOfBlocksError


def my_copy_on_write(table, start, end):
    pool = table.allocator
    shared = [i for i in range(len(table.blocks)) if pool.ref_count(table.blocks[i]) > 1] if end > start else []
    if len(shared) > pool.num_free_blocks:
        raise OutOfBlocksError("short")
    pairs = []
    for i in shared:
        src, dst = table.blocks[i], pool.allocate()
        table.blocks[i] = dst
        pool.free(src)
        pairs.append((src, dst))
    return pairs
