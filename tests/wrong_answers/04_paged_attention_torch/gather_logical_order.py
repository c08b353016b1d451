"""gather_kv reads blocks 0, 1, 2, ... instead of looking them up in the block table."""
CHECK = "minipaged.checks.paged_attention:check_gather_kv"
EXPECT = ["is the wrong one", "logical order"]


def my_gather_kv(cache, block_table, context_len):
    n_blocks = -(-context_len // cache.shape[1])
    return cache[:n_blocks].reshape(-1, *cache.shape[2:])[:context_len]
