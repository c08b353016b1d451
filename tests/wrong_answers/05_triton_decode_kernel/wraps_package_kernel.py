"""paged_decode that launches minipaged's own Triton decode: delegation, refused."""
CHECK = "minipaged.checks.triton_decode:check_decode"
EXPECT = ["minipaged's own implementation", "minipaged.attention.triton_paged"]


def my_paged_decode(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale, out=None):
    from minipaged.attention import triton_paged

    return triton_paged.paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale)
