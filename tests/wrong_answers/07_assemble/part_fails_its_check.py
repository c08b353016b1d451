"""The learner's 03 workbook was edited after it passed: free() no longer gives blocks back."""
CHECK = "minipaged.checks.assemble:load_parts"
EDIT = {"03_block_table": ("            self.allocator.free(b)\n", "            pass\n")}
EXPECT = ["03_block_table.ipynb: does not pass its own check yet", "the pool differs after"]
