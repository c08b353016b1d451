"""copy_on_write copies every block the write touches, also those the table holds alone."""
CHECK = "minipaged.checks.prefix_cache:check_copy_on_write"
EXPECT = ["differ after copy_on_write", "a block this table holds alone is written in place"]
HINT = "you copied a block that needs no copy"

from _base import good_copy_on_write


def my_copy_on_write(table, start, end):
    bs = table.block_size
    return good_copy_on_write(table, start, end,
                              shared=lambda t, s, e: list(range(s // bs, min((e - 1) // bs, len(t.blocks) - 1) + 1)) if e > s else [])
