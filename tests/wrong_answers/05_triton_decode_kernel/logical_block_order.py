"""The kernel ignores the block table and reads physical block i for logical block i."""
CHECK = "minipaged.checks.triton_decode:check_decode"
EXPECT = ["decode through an out-of-order block table", "logical order", "block_tables[s, i]"]

from _base import make

my_paged_decode = make(use_table=False)
