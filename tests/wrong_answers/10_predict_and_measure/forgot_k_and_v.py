"""kv_capacity counts one vector a token, not a key and a value."""
CHECK = "minipaged.checks.predict:check_kv_capacity"
EXPECT = ["kv_capacity", "2 (K and V)"]


def my_kv_capacity(m, kv_cache_bytes, block_size, num_tokens):
    per_block = block_size * m.num_layers * m.num_kv_heads * m.head_dim * m.dtype_bytes
    n = kv_cache_bytes // per_block
    return n, n // -(-num_tokens // block_size)
