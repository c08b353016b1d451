"""free() puts a block that became free at the FRONT of the free list: the block freed last is reused first."""
CHECK = "minipaged.checks.block_allocator:check_allocate_free"
EXPECT = ["returned a different block", "FRONT of the free list", "at the BACK"]
HINT = "your free() puts a block that became free at the FRONT"

from collections import deque

from minipaged import BlockAllocatorError, OutOfBlocksError


class MyBlockAllocator:
    def __init__(self, num_blocks, block_size=16):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.counts = [0] * num_blocks
        self.free_blocks = deque(range(num_blocks))

    @property
    def num_free_blocks(self):
        return len(self.free_blocks)

    def allocate(self):
        if not self.free_blocks:
            raise OutOfBlocksError("full")
        b = self.free_blocks.popleft()
        self.counts[b] = 1
        return b

    def free(self, block_id):
        if self.counts[block_id] == 0:
            raise BlockAllocatorError(f"block {block_id} is already free")
        self.counts[block_id] -= 1
        if self.counts[block_id] == 0:
            self.free_blocks.appendleft(block_id)  # wrong: the back (append), so it is reused last

    def incref(self, block_id):
        if self.counts[block_id] == 0:
            raise BlockAllocatorError(f"block {block_id} is free")
        self.counts[block_id] += 1

    def ref_count(self, block_id):
        return self.counts[block_id]
