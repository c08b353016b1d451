"""The engine's PyTorch path (torch_sdpa.py) gives the oracle's answer on every kind of batch."""
from __future__ import annotations

import pytest
import torch

from minipaged.attention import REFERENCE, TORCH, get_backend
from minipaged.attention.reference import paged_attention as reference
from minipaged.attention.torch_sdpa import DECODE_GROUP, paged_attention as fast
from test_attention_reference import assert_attention_close, make_case, sdpa_oracle


@pytest.mark.parametrize("layout", ["shuffled", "non_contiguous", "shared"])
@pytest.mark.parametrize(
    "heads, kv_heads, head_dim, block_size",
    [(4, 4, 32, 8), (9, 3, 64, 16), (8, 2, 64, 1), (8, 1, 128, 32)],
)
def test_fast_path_equals_reference_and_sdpa(layout, heads, kv_heads, head_dim, block_size):
    # decode rows with edge lengths (more than one decode group), plus prefill and chunked prefill
    ctx = [1, block_size - 1 or 1, block_size, block_size + 1, 3 * block_size + 2] * 3 + [40, 23, 9]
    q_lens = [1] * 15 + [40, 7, 9]
    assert sum(q == 1 for q in q_lens) > DECODE_GROUP
    case = make_case(ctx, q_lens, heads, kv_heads, head_dim, block_size, layout=layout)
    out = torch.full_like(case.q, float("nan"))
    fast(*case.args(), out=out)
    assert_attention_close(out, reference(*case.args()), case, "torch_sdpa vs reference")
    assert_attention_close(out, sdpa_oracle(case).to(out.dtype), case, "torch_sdpa vs dense SDPA")


def test_backend_names():
    assert get_backend("torch") is TORCH and get_backend("reference") is REFERENCE
    assert TORCH.paged_attention is fast and REFERENCE.paged_attention is reference
    with pytest.raises(ValueError, match="reference"):
        get_backend("nope")
