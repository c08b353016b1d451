"""gather_kv returns every slot of the last block instead of the first context_len tokens."""
CHECK = "minipaged.checks.paged_attention:check_gather_kv"
EXPECT = ["wrong shape", "[:context_len]"]


def my_gather_kv(cache, block_table, context_len):
    n_blocks = -(-context_len // cache.shape[1])
    return cache[block_table[:n_blocks].long()].reshape(-1, *cache.shape[2:])
