"""Query head h reads KV head h % num_kv_heads instead of h // group."""
CHECK = "minipaged.checks.paged_attention:check_paged_attention"
EXPECT = ["GQA", "h // (num_heads // num_kv_heads)", "not h % num_kv_heads"]

from functools import partial

from _base import attention

my_paged_attention = partial(attention, gqa="mod")
