"""allocate() takes from the back of the free list (list.pop()), not the front."""
CHECK = "minipaged.checks.block_allocator:check_allocate_free"
EXPECT = ["returned a different block", "Take the FRONT instead"]
HINT = "your allocate() takes the block at the back"

from minipaged import BlockAllocatorError, OutOfBlocksError


class MyBlockAllocator:
    def __init__(self, num_blocks, block_size=16):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.ref_counts = [0] * num_blocks
        self.free_list = list(range(num_blocks))

    @property
    def num_free_blocks(self):
        return len(self.free_list)

    def allocate(self):
        if not self.free_list:
            raise OutOfBlocksError("full")
        b = self.free_list.pop()
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
