"""copy_on_write that calls minipaged's own (minipaged.prefix_cache.copy_on_write) from inside a function of its own."""
CHECK = "minipaged.checks.prefix_cache:check_copy_on_write"
EXPECT = ["called minipaged.prefix_cache.copy_on_write", "minipaged's own implementation"]
HINT = None  # a refusal: the message says what to do, with no hint

from minipaged import prefix_cache


def my_copy_on_write(table, start, end):
    return list(prefix_cache.copy_on_write(table, start, end))
