"""bytes_per_sequence counts only the tokens, not the whole blocks they occupy."""
CHECK = "minipaged.checks.kv_cache_math:check_bytes_per_sequence"
EXPECT = ["is wrong", "whole blocks"]

from _base import bytes_per_token


def my_bytes_per_sequence(m, num_tokens, block_size):
    return num_tokens * bytes_per_token(m)
