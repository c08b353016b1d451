"""Maps query head h to KV head min(h, num_kv_heads - 1): a head-mapping error that must get a GQA hint, never a block-boundary one."""
CHECK = "minipaged.checks.paged_attention:check_paged_attention"
EXPECT = ["a head mapping error, not the blocks or the mask", "reads KV head h // 2"]
UNEXPECTED = ["block boundary", "whole blocks"]

from _base import attention


def my_paged_attention(*args, out=None):
    return attention(*args, gqa="first_kv_head_last")
