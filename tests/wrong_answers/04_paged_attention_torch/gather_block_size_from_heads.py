"""Takes the block size from the wrong dimension of the cache (num_kv_heads): right while block_size >= num_kv_heads."""
CHECK = "minipaged.checks.paged_attention:check_gather_kv"
EXPECT = ["wrong shape", "context_len=7"]


def my_gather_kv(cache, block_table, context_len):
    n_blocks = -(-context_len // cache.shape[2])
    return cache[block_table[:n_blocks].long()].reshape(-1, *cache.shape[2:])[:context_len]
