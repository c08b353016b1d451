"""Computes 1/sqrt(head_dim) itself instead of using the `scale` argument: right only while the two agree."""
CHECK = "minipaged.checks.paged_attention:check_paged_attention"
EXPECT = ["a scale that is not 1/sqrt(head_dim)", "as given"]

import math

from _base import attention


def my_paged_attention(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale, out=None):
    return attention(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, 1.0 / math.sqrt(q.shape[-1]))
