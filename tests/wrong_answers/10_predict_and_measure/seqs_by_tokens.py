"""kv_capacity divides the slots by the tokens, as if a sequence took no whole blocks."""
CHECK = "minipaged.checks.predict:check_kv_capacity"
EXPECT = ["num_blocks is right", "whole blocks"]


def my_kv_capacity(m, kv_cache_bytes, block_size, num_tokens):
    per_block = block_size * 2 * m.num_layers * m.num_kv_heads * m.head_dim * m.dtype_bytes
    n = kv_cache_bytes // per_block
    return n, n * block_size // num_tokens
