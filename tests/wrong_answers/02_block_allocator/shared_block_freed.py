"""free() puts a block back in the free list even while another table still holds it."""
CHECK = "minipaged.checks.block_allocator:check_sharing"
EXPECT = ["of a shared block", "free() drops one reference"]
HINT = "another block table still holds it. free() drops one reference"

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
        b = self.free_list.popleft()
        self.ref_counts[b] = 1
        return b

    def free(self, block_id):
        if self.ref_counts[block_id] == 0:
            raise BlockAllocatorError(f"block {block_id} is already free")
        self.ref_counts[block_id] = 0  # wrong: drops every reference at once
        self.free_list.append(block_id)

    def incref(self, block_id):
        if self.ref_counts[block_id] == 0:
            raise BlockAllocatorError(f"block {block_id} is free")
        self.ref_counts[block_id] += 1

    def ref_count(self, block_id):
        return self.ref_counts[block_id]
