"""fork_table shares the parent's blocks without raising their ref counts."""
CHECK = "minipaged.checks.prefix_cache:check_beam_search"
EXPECT = ["the block invariants break", "incref"]
HINT = "fork_table must raise the ref count of every block it shares"

from _base import good_copy_on_write, good_free_table


def my_fork_table(table):
    child = type(table)(table.allocator)
    child.blocks = list(table.blocks)
    child.num_tokens = table.num_tokens
    return child


def answer():
    return my_fork_table, good_free_table, good_copy_on_write
