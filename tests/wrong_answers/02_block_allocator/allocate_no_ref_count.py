"""allocate() takes the block off the free list but never sets its ref count to 1.

The ref counts differ right after allocate(), so the hint must be about allocate(), not free().
"""
CHECK = "minipaged.checks.block_allocator:check_allocate_free"
EXPECT = ["ref counts differ after a.allocate() -> 0", "allocate() must set the new block's ref count to 1"]
UNEXPECTED = ["free() drops one reference", "free() must lower"]
HINT = "allocate() must set the new block's ref count to 1"

from collections import deque

from minipaged import BlockAllocatorError, OutOfBlocksError


class MyBlockAllocator:
    def __init__(self, num_blocks, block_size=16):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.ref_counts = [0] * num_blocks
        self.free_list = deque(range(num_blocks))

    @property
    def num_free_blocks(self):
        return len(self.free_list)

    def allocate(self):
        if not self.free_list:
            raise OutOfBlocksError("full")
        return self.free_list.popleft()  # forgot: self.ref_counts[b] = 1

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
