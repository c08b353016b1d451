"""copy_on_write never copies: the sample writes straight into a block another table shares."""
CHECK = "minipaged.checks.prefix_cache:check_copy_on_write"
EXPECT = ["differ after copy_on_write", "another table shares", "would change the other sequence"]
HINT = "the write touches a block that another table shares"

from _base import good_copy_on_write


def my_copy_on_write(table, start, end):
    return good_copy_on_write(table, start, end, shared=lambda t, s, e: [])
