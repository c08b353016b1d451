"""allocate() searches for a free block in a loop that never ends once the pool is full."""
CHECK = "minipaged.checks.block_allocator:check_allocate_free"
KWARGS = {"timeout": 2}
EXPECT = ["stopped after 2 s", "a.allocate()", "loop that never ends"]
ERROR = "CheckTimeout"
HINT = "look for a loop that never ends"


class MyBlockAllocator:
    def __init__(self, num_blocks, block_size=16):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.ref_counts = [0] * num_blocks

    @property
    def num_free_blocks(self):
        return self.ref_counts.count(0)

    def allocate(self):
        b = 0
        while self.ref_counts[b % self.num_blocks] != 0:
            b += 1
        b %= self.num_blocks
        self.ref_counts[b] = 1
        return b

    def free(self, block_id):
        self.ref_counts[block_id] -= 1

    def incref(self, block_id):
        self.ref_counts[block_id] += 1

    def ref_count(self, block_id):
        return self.ref_counts[block_id]
