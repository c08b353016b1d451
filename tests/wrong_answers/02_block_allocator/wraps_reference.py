"""Every method forwards to a minipaged BlockAllocator kept inside: delegation, refused."""
CHECK = "minipaged.checks.block_allocator:check_sharing"
EXPECT = ["called minipaged.BlockAllocator.__init__", "minipaged's own implementation"]
HINT = None  # a refusal: the message says what to do, with no hint

from minipaged import BlockAllocator


class MyBlockAllocator:
    def __init__(self, num_blocks, block_size=16):
        self.num_blocks, self.block_size = num_blocks, block_size
        self._inner = BlockAllocator(num_blocks, block_size)

    @property
    def num_free_blocks(self):
        return self._inner.num_free_blocks

    def allocate(self):
        return self._inner.allocate()

    def free(self, block_id):
        self._inner.free(block_id)

    def incref(self, block_id):
        self._inner.incref(block_id)

    def ref_count(self, block_id):
        return self._inner.ref_count(block_id)
