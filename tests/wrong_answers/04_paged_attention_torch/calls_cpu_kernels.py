"""Hands the work to minipaged's CPU decode kernel (minipaged.cpu.kernels): delegation through another module."""
CHECK = "minipaged.checks.paged_attention:check_paged_attention"
EXPECT = ["called minipaged.cpu.kernels.paged_decode", "minipaged's own implementation"]

import torch

from minipaged.cpu import kernels


def my_paged_attention(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale, out=None):
    # every new token is one decode query over its causal prefix
    rows, lens = [], []
    for s in range(len(context_lens)):
        q0, q1, c = int(query_start_loc[s]), int(query_start_loc[s + 1]), int(context_lens[s])
        for i in range(q1 - q0):
            rows.append(s)
            lens.append(c - (q1 - q0) + i + 1)
    res = kernels.paged_decode(q.float(), k_cache.float(), v_cache.float(), block_tables[rows],
                               torch.tensor(lens, dtype=torch.int32), scale)
    return res.to(q.dtype)
