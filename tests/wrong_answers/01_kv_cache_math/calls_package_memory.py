"""bytes_per_token that calls minipaged's own reference arithmetic: delegation, refused."""
CHECK = "minipaged.checks.kv_cache_math:check_bytes_per_token"
EXPECT = ["called minipaged.checks.kv_cache_math.ref_bytes_per_token", "minipaged's own implementation"]


def my_bytes_per_token(m):
    from minipaged.checks import kv_cache_math

    return kv_cache_math.ref_bytes_per_token(m)
