"""paged attention over int8 pages that reads the stored int8 numbers as they are: it ignores the scales."""
CHECK = "minipaged.checks.kv_int8:check_paged_attention_int8"
EXPECT = ["differs from the reference reading the same int8 pages", "your attention ignores the scales"]

from _int8 import SOLVED


def my_paged_attention_int8(q, k_cache, v_cache, k_scales, v_scales, block_tables, context_lens, query_start_loc, scale,
                            out=None):
    return SOLVED["paged_attention"](q, k_cache.float(), v_cache.float(), block_tables, context_lens, query_start_loc, scale)
