"""fork_table shares the blocks but leaves the child's num_tokens at 0."""
CHECK = "minipaged.checks.prefix_cache:check_beam_search"
EXPECT = ["the block invariants break", "child.num_tokens = table.num_tokens"]
HINT = "the child must have the parent's tokens"

from _base import good_copy_on_write, good_free_table


def my_fork_table(table):
    child = type(table)(table.allocator)
    for b in table.blocks:
        table.allocator.incref(b)
    child.blocks = list(table.blocks)
    return child


def answer():
    return my_fork_table, good_free_table, good_copy_on_write
