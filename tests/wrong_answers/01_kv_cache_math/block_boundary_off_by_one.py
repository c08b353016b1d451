"""bytes_per_sequence rounds n // block_size + 1 blocks: one too many when n ends a block."""
CHECK = "minipaged.checks.kv_cache_math:check_bytes_per_sequence"
EXPECT = ["num_tokens=1, block_size=1", "off by one block at the boundary"]

from _base import bytes_per_token


def my_bytes_per_sequence(m, num_tokens, block_size):
    return (num_tokens // block_size + 1) * block_size * bytes_per_token(m)
