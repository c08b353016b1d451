"""paged_attention that calls minipaged's own reference: delegation, refused with a message that says so."""
CHECK = "minipaged.checks.paged_attention:check_paged_attention"
EXPECT = ["called minipaged.attention.reference.paged_attention", "minipaged's own implementation"]

from minipaged.attention import reference


def my_paged_attention(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale, out=None):
    return reference.paged_attention(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale, out)
