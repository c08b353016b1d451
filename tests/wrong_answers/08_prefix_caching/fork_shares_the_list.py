"""fork_table gives the child the parent's own list object: a copy-on-write in one table changes the other."""
CHECK = "minipaged.checks.prefix_cache:check_beam_search"
EXPECT = ["the same list object", "list(table.blocks)"]
HINT = "two beams' tables are the same list object"

from _base import good_copy_on_write, good_free_table


def my_fork_table(table):
    child = type(table)(table.allocator)
    for b in table.blocks:
        table.allocator.incref(b)
    child.blocks = table.blocks
    child.num_tokens = table.num_tokens
    return child


def answer():
    return my_fork_table, good_free_table, good_copy_on_write
