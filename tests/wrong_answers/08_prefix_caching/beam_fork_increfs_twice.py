"""fork_table increfs every block of the parent twice (once in a loop, once more "for the child"): the blocks are
counted for a holder that does not exist. The hint must name fork_table, not free_table (nothing was dropped yet)."""
CHECK = "minipaged.checks.prefix_cache:check_beam_search"
EXPECT = ["fork_table(table) of a table of blocks", "by more than one"]
UNEXPECTED = ["free_table must"]
HINT = "incref each block of the parent exactly once"

from _base import good_copy_on_write, good_fork_table, good_free_table


def my_fork_table(table):
    child = good_fork_table(table)
    for b in table.blocks:
        table.allocator.incref(b)  # wrong: good_fork_table increfs them already
    return child


def answer():
    return my_fork_table, good_free_table, good_copy_on_write
