"""bytes_per_token counts only the keys (no factor 2 for K and V)."""
CHECK = "minipaged.checks.kv_cache_math:check_bytes_per_token"
EXPECT = ["bytes_per_token is wrong for SmolLM2", "1/2 of the answer", "K and V are two tensors"]
UNEXPECTED = ["dtype_bytes: the count is in bytes"]


def my_bytes_per_token(m):
    return m.num_layers * m.num_kv_heads * m.head_dim * m.dtype_bytes
