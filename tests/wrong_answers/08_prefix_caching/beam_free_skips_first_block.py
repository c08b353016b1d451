"""free_table gives back every block but the first (a loop over table.blocks[1:]): the block leaks. The hint must name
the block it kept, not the timing of the free (it frees at once)."""
CHECK = "minipaged.checks.prefix_cache:check_beam_search"
EXPECT = ["gave back some of its blocks, but not"]
UNEXPECTED = ["AT ONCE"]
HINT = "give back EVERY block the table holds"

from _base import good_copy_on_write, good_fork_table


def my_free_table(table):
    for b in table.blocks[1:]:  # wrong: the first block too
        table.allocator.free(b)
    table.blocks = []
    table.num_tokens = 0


def answer():
    return good_fork_table, my_free_table, good_copy_on_write
