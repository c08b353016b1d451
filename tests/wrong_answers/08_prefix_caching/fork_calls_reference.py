"""fork_table that calls minipaged's own (minipaged.parts.fork_table) from inside a function of its own."""
CHECK = "minipaged.checks.prefix_cache:check_beam_search"
EXPECT = ["called minipaged.parts.fork_table", "minipaged's own implementation"]
HINT = None  # a refusal: the message says what to do, with no hint

from minipaged import parts

from _base import good_copy_on_write, good_free_table


def my_fork_table(table):
    return parts.fork_table(table)


def answer():
    return my_fork_table, good_free_table, good_copy_on_write
