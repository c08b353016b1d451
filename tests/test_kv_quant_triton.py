"""The Triton kernels (decode, prefill, the write) on 8-bit KV pages, against the reference.

Without a GPU they run in Triton's CPU interpreter (which has fp8 loads), as in
test_triton_attention.py."""
from __future__ import annotations

import warnings

import pytest
import torch

from minipaged.attention import get_backend, triton_available

if not triton_available():  # not importorskip: triton must not be imported before the interpreter is on
    pytest.skip("Triton is not installed (no wheel for this platform)", allow_module_level=True)
from minipaged.attention.reference import paged_attention as reference_attention  # noqa: E402

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # the once-per-process interpreter notice
    BACKEND = get_backend("triton")
from minipaged.attention import triton_paged as tp  # noqa: E402

from test_kv_quant import QUANTIZED, filled, new_pages, slots_of  # noqa: E402

if tp.INTERPRETED:
    pytestmark = pytest.mark.interpreter


@pytest.mark.parametrize("name", QUANTIZED)
@pytest.mark.parametrize("qsl", [[0, 1, 2], [0, 2, 5], [0, 7, 17]])  # decode, chunks, whole prefill
def test_triton_equals_the_reference_on_quantized_pages(name, qsl):
    k, v, _, _, tables, ctx = filled(name)
    q = torch.randn(qsl[-1], 4, 8)
    qsl = torch.tensor(qsl, dtype=torch.int32)
    out = torch.full_like(q, float("nan"))  # an element the kernel forgets to write fails
    got = BACKEND.paged_attention(q, k, v, tables, ctx, qsl, 8**-0.5, out)
    torch.testing.assert_close(got, reference_attention(q, k, v, tables, ctx, qsl, 8**-0.5), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("name", QUANTIZED)
def test_triton_write_is_the_quantizing_write(name):
    """The backend's write_kv on 8-bit pages stores the same bytes and scales as kv_cache.write_kv."""
    theirs = filled(name, seed=1)[:2]  # written by kv_cache.write_kv
    torch.manual_seed(1)
    k, v = new_pages(name)
    tables = [[3, 5, 1, 0], [2, 7, 8, 9]]
    for seq, start, n in [(0, 0, 5), (1, 0, 6), (0, 5, 1), (1, 6, 1), (0, 6, 1), (1, 7, 3)]:
        kk, vv = torch.randn(n, 2, 8) * (1 + 3 * seq), torch.randn(n, 2, 8)
        BACKEND.write_kv(k, v, kk, vv, slots_of(tables[seq], start, n, 4))
    for mine, other in zip((k, v), theirs):
        assert torch.equal(mine.view(torch.uint8), other.view(torch.uint8))
        assert torch.equal(mine.kv_scales, other.kv_scales)
