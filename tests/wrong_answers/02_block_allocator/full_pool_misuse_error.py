"""allocate() checks for an empty free list, but raises BlockAllocatorError (the misuse error) instead of OutOfBlocksError:
the scheduler catches only OutOfBlocksError. The hint must not tell the learner to check for an empty free list (they
did) or talk of popleft()'s IndexError."""
CHECK = "minipaged.checks.block_allocator:check_allocate_free"
EXPECT = ["on a full pool raised the wrong exception", "BlockAllocatorError"]
UNEXPECTED = ["IndexError", "popleft"]
HINT = "a full pool is not a misuse of a block"

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
        if not self.free_list:
            raise BlockAllocatorError("no free block left")  # wrong: OutOfBlocksError
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
        if self.ref_counts[block_id] == 0:
            raise BlockAllocatorError("free")
        self.ref_counts[block_id] += 1

    def ref_count(self, block_id):
        return self.ref_counts[block_id]
