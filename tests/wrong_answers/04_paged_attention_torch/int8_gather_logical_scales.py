"""gather_kv_int8 that reads the right blocks but takes the scales of the logical blocks (0, 1, 2, ...)."""
CHECK = "minipaged.checks.kv_int8:check_gather_kv_int8"
EXPECT = ["differs from minipaged's read", "that block's scales, not the logical block's"]


def my_gather_kv_int8(cache, scales, block_table, context_len):
    n = -(-context_len // cache.shape[1])
    ids = block_table[:n].long()
    blocks = cache[ids].float() * scales[:n][:, None, :, None]
    return blocks.reshape(-1, *cache.shape[2:])[:context_len]
