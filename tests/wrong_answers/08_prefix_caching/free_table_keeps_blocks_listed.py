"""free_table gives the blocks back but leaves them listed in the table."""
CHECK = "minipaged.checks.prefix_cache:check_beam_search"
EXPECT = ["still lists blocks", "table.blocks = []"]
HINT = "after giving its blocks back the table holds nothing"

from _base import good_copy_on_write, good_fork_table


def my_free_table(table):
    for b in table.blocks:
        table.allocator.free(b)
    table.num_tokens = 0


def answer():
    return good_fork_table, my_free_table, good_copy_on_write
