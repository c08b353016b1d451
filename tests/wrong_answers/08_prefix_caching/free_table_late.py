"""free_table frees a dropped beam's blocks one call late: it keeps the table and frees it at the next drop."""
CHECK = "minipaged.checks.prefix_cache:check_beam_search"
EXPECT = ["AT ONCE"]
HINT = "free_table must give every block back AT ONCE"

from _base import good_copy_on_write, good_fork_table

_later = []


def my_free_table(table):
    for t in _later:  # the beam dropped last time
        for b in t:
            table.allocator.free(b)
    _later[:] = [list(table.blocks)]
    table.blocks = []
    table.num_tokens = 0


def answer():
    _later.clear()
    return good_fork_table, my_free_table, good_copy_on_write
