"""allocate() on a full pool lets deque.popleft()'s IndexError escape."""
CHECK = "minipaged.checks.block_allocator:check_allocate_free"
EXPECT = ["on a full pool raised the wrong exception", "OutOfBlocksError", "IndexError"]
HINT = "the IndexError came from taking a block off an empty free list"

from collections import deque

from minipaged import BlockAllocatorError


class MyBlockAllocator:
    def __init__(self, num_blocks, block_size=16):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.ref_counts = [0] * num_blocks
        self.free_list = deque(range(num_blocks))

    @property
    def num_free_blocks(self):
        return len(self.free_list)

    def allocate(self):
        b = self.free_list.popleft()
        self.ref_counts[b] = 1
        return b

    def free(self, block_id):
        if self.ref_counts[block_id] == 0:
            raise BlockAllocatorError("already free")
        self.ref_counts[block_id] -= 1
        if self.ref_counts[block_id] == 0:
            self.free_list.append(block_id)

    def incref(self, block_id):
        self.ref_counts[block_id] += 1

    def ref_count(self, block_id):
        return self.ref_counts[block_id]
