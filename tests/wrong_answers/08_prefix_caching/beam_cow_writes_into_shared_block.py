"""copy_on_write copies nothing: a beam writes its token into a block its siblings share (ref count > 1)."""
CHECK = "minipaged.checks.prefix_cache:check_beam_search"
EXPECT = ["did not", "ref_count(b) > 1"]
HINT = "the reference copied a shared block before a beam wrote into it, yours did not"

from _base import good_fork_table, good_free_table


def my_copy_on_write(table, start, end):
    return []


def answer():
    return good_fork_table, good_free_table, my_copy_on_write
