"""copy_on_write copies every shared block of the table, not only the last, partly filled one the beam writes into."""
CHECK = "minipaged.checks.prefix_cache:check_beam_search"
EXPECT = ["copied more blocks than the reference", "LAST block"]
HINT = "your copy_on_write copied more blocks than the reference"

from _base import good_copy_on_write, good_fork_table, good_free_table


def my_copy_on_write(table, start, end):
    every = lambda t, s, e: [i for i in range(len(t.blocks)) if t.allocator.ref_count(t.blocks[i]) > 1] if e > s else []
    return good_copy_on_write(table, start, end, shared=every)


def answer():
    return good_fork_table, good_free_table, my_copy_on_write
