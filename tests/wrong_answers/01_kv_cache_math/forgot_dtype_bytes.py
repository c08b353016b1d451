"""bytes_per_token counts numbers, not bytes (no dtype_bytes factor).

On SmolLM2 (dtype_bytes=2) that is exactly half, like a missing K-and-V factor: the hint
must still name dtype_bytes, not K and V.
"""
CHECK = "minipaged.checks.kv_cache_math:check_bytes_per_token"
EXPECT = ["bytes_per_token is wrong for SmolLM2", "1/2 of the answer", "multiply by dtype_bytes"]
UNEXPECTED = ["K and V are two tensors"]


def my_bytes_per_token(m):
    return 2 * m.num_layers * m.num_kv_heads * m.head_dim
