"""A subclass of minipaged's BlockTable that writes none of the four methods: refused."""
CHECK = "minipaged.checks.block_table:check_growth"
EXPECT = ["MyBlockTable.blocks_needed is minipaged's own", "inherited from minipaged's BlockTable"]
HINT = None  # a refusal: the message says what to do, with no hint

from minipaged import BlockTable


class MyBlockTable(BlockTable):
    pass
