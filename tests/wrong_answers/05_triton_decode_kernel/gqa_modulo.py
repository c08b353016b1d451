"""The kernel maps query head h to KV head h % num_kv_heads."""
CHECK = "minipaged.checks.triton_decode:check_decode"
EXPECT = ["GQA: 4 query heads over 2 KV heads", "not h % num_kv_heads"]

from _base import make

my_paged_decode = make(gqa_div=False)
