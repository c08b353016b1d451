"""minipaged's own BlockAllocator under the learner's name: refused, and the message says so."""
CHECK = "minipaged.checks.block_allocator:check_allocate_free"
EXPECT = ["is minipaged's own minipaged.block_allocator.BlockAllocator"]
HINT = None  # a refusal: the message says what to do, with no hint

from minipaged import BlockAllocator as MyBlockAllocator  # noqa: F401
