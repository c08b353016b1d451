"""The learner renamed MyBlockAllocator in workbook 02."""
CHECK = "minipaged.checks.assemble:load_parts"
EDIT = {"02_block_allocator": ("class MyBlockAllocator:", "class BlockPool:")}
EXPECT = ["02_block_allocator.ipynb defines no MyBlockAllocator", "keep the names"]
