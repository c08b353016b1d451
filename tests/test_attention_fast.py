"""The engine's attention backends give the oracle's answer on every kind of batch.

Every shape the reference tests use (GQA, block sizes 1/16/64, lengths on and off block
boundaries, decode + prefill + chunked prefill, no decode at all), both prefill strategies
(one padded call, one call per sequence), decodes first (``num_decodes`` given) or scattered
(``num_decodes=None``), and the batching contract itself: one call for all decodes.
Every test runs twice: through the "cpu" backend (cpu/attention.py: decodes, and prefills over
short contexts, through the C kernel that reads pages in place), and through the pure PyTorch
"torch" backend (attention/torch_sdpa.py: a padded gather and SDPA).
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minipaged.attention import REFERENCE, TORCH, get_backend
from minipaged.attention import torch_sdpa
from minipaged.attention.reference import paged_attention as reference
from minipaged.cpu import build, kernels
from test_attention_reference import assert_attention_close, make_case, sdpa_oracle

_IMPL: list = [torch_sdpa.paged_attention]  # the implementation under test (set per test below)


def fast(*args, **kwargs):
    return _IMPL[0](*args, **kwargs)


@pytest.fixture(autouse=True, params=["c_kernel", "sdpa"])
def decode_path(request):
    if request.param == "c_kernel":
        if build.library() is None:
            pytest.skip(f"the CPU decode kernel cannot be built here: {build.info()['why_not']}")
        from minipaged.cpu.attention import CPUAttention

        _IMPL[0] = CPUAttention().paged_attention
    else:
        _IMPL[0] = torch_sdpa.paged_attention
    yield request.param
    _IMPL[0] = torch_sdpa.paged_attention


def edge_lengths(bs: int) -> list[int]:
    """Context lengths on and either side of block boundaries."""
    return sorted({1, max(1, bs - 1), bs, bs + 1, 2 * bs, 3 * bs + 2})


def check(case, what: str, **kw) -> torch.Tensor:
    out = torch.full_like(case.q, float("nan"))  # NaN shows any row never written
    got = fast(*case.args(), out=out, **kw)
    assert got is out
    assert_attention_close(out, reference(*case.args()), case, f"{what}: torch_sdpa vs reference")
    assert_attention_close(out, sdpa_oracle(case).to(out.dtype), case, f"{what}: torch_sdpa vs dense SDPA")
    return out


@pytest.fixture(params=["padded", "per_sequence"])
def prefill_mode(request, monkeypatch):
    """Run a test under each strategy: prefills padded into one call and decodes in one call, or
    prefills one call per sequence and decodes cut into groups whenever their lengths differ."""
    padded = request.param == "padded"
    monkeypatch.setattr(torch_sdpa, "PREFILL_PAD_LIMIT", float("inf") if padded else 0.0)
    monkeypatch.setattr(torch_sdpa, "DECODE_PAD_LIMIT", float("inf") if padded else 1.0)
    return request.param


@pytest.mark.parametrize("layout", ["shuffled", "non_contiguous", "shared"])
@pytest.mark.parametrize(
    "heads, kv_heads, head_dim, block_size",
    [(4, 4, 32, 8), (9, 3, 64, 16), (8, 2, 64, 1), (8, 1, 64, 16), (8, 1, 128, 64), (6, 2, 24, 16)],
)
def test_mixed_batch_decodes_first(layout, heads, kv_heads, head_dim, block_size, prefill_mode):
    """Decodes first (as the runner orders them), then full prefills and chunks over a cached prefix."""
    dec = edge_lengths(block_size) * 2
    ctx = dec + [40, 23, 9, 2 * block_size + 1]
    q_lens = [1] * len(dec) + [40, 7, 9, block_size + 1]
    case = make_case(ctx, q_lens, heads, kv_heads, head_dim, block_size, layout=layout)
    check(case, f"decodes first, given ({prefill_mode})", num_decodes=len(dec))
    check(case, f"decodes first, found ({prefill_mode})")


@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_decodes_scattered_among_prefills(block_size, prefill_mode):
    """num_decodes=None: one-query sequences anywhere in the batch are still found and batched."""
    ctx = [30, 1, block_size + 1, 17, block_size, 5, 2 * block_size]
    q_lens = [30, 1, 1, 4, 1, 5, 1]
    case = make_case(ctx, q_lens, 9, 3, 64, block_size)
    check(case, f"scattered decodes ({prefill_mode})")


@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_no_decode_at_all(block_size, prefill_mode):
    ctx = [block_size + 1, block_size + 2, 33, 2]
    case = make_case(ctx, [block_size + 1, 2, 33, 2], 8, 2, 64, block_size)
    check(case, f"prefill only ({prefill_mode})", num_decodes=0)
    check(case, f"prefill only, found ({prefill_mode})")


@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_decode_only(block_size):
    case = make_case(edge_lengths(block_size) * 4, [1] * len(edge_lengths(block_size)) * 4, 9, 3, 64, block_size)
    check(case, "decode only", num_decodes=case.context_lens.numel())


def test_single_prefill_and_single_token_prompt(prefill_mode):
    """A one-token prompt is a decode in all but name: same maths."""
    case = make_case([1, 12], [1, 12], 4, 2, 32, 16)
    check(case, f"one-token prompt ({prefill_mode})")
    check(make_case([12], [12], 4, 2, 32, 16), f"one prefill ({prefill_mode})")


def _count_sdpa_calls(monkeypatch) -> list:
    calls = []
    real = torch_sdpa._sdpa

    def counting(q, k, v, mask, scale):
        calls.append(tuple(q.shape))
        return real(q, k, v, mask, scale)

    monkeypatch.setattr(torch_sdpa, "_sdpa", counting)
    return calls


def _count_kernel_calls(monkeypatch) -> list:
    calls = []
    real = kernels.paged_decode

    def counting(q, *args, **kwargs):
        calls.append(tuple(q.shape))
        return real(q, *args, **kwargs)

    monkeypatch.setattr(kernels, "paged_decode", counting)  # counts the calls; the route is the backend's
    return calls


@pytest.mark.parametrize("decode_path", ["c_kernel"], indirect=True)
def test_all_decodes_in_one_kernel_call(monkeypatch, decode_path):
    """With the C kernel, any decode batch (equal lengths or not, first or scattered) is one call."""
    calls = _count_kernel_calls(monkeypatch)
    for ctx, q_lens, nd in (([35, 40, 64, 90, 110, 47, 100, 36] * 8, [1] * 64, 64),
                            ([1, 3, 16, 17, 90, 200, 5, 64] * 5, [1] * 40, None),
                            ([30, 1, 17, 17, 16, 5], [30, 1, 4, 1, 1, 5], None)):
        calls.clear()
        case = make_case(ctx, q_lens, 9, 3, 64, 16)
        check(case, "decodes through the C kernel", num_decodes=nd)
        assert calls == [(q_lens.count(1), 9, 64)], f"expected one kernel call for the decodes, got {calls}"


@pytest.mark.parametrize("decode_path", ["c_kernel"], indirect=True)
def test_short_prefills_are_decode_queries_in_one_kernel_call_and_long_ones_use_sdpa(monkeypatch, decode_path):
    """With the C kernel, prefills whose contexts are all at most PREFILL_AS_DECODES_MAX_CONTEXT
    long go through it as one query per new token over its causal prefix (one call for all of
    them, after the decodes' call); a longer context sends the prefills to SDPA, and so does
    ``prefill_as_decodes=False`` (the engine's setting) for every prefill."""
    from minipaged.cpu.attention import PREFILL_AS_DECODES_MAX_CONTEXT as limit
    from minipaged.cpu.attention import CPUAttention

    kernel, sdpa = _count_kernel_calls(monkeypatch), _count_sdpa_calls(monkeypatch)
    for longest, pad, via_kernel in ((limit, True, True), (limit + 1, True, False), (limit, False, False)):
        _IMPL[0] = CPUAttention(prefill_as_decodes=pad).paged_attention
        kernel.clear(), sdpa.clear()
        ctx = [17, 40, 3, 33, longest, 9]  # two decodes, then full prompts and chunks over cached prefixes
        q_lens = [1, 1, 3, 33, 20, 9]
        case = make_case(ctx, q_lens, 9, 3, 64, 16)
        out = check(case, f"prefills with a context of {longest}, prefill_as_decodes={pad}", num_decodes=2)
        assert torch.isfinite(out).all()
        if via_kernel:
            assert kernel == [(2, 9, 64), (sum(q_lens[2:]), 9, 64)] and sdpa == [], (kernel, sdpa)
        else:
            assert kernel == [(2, 9, 64)] and sdpa, (kernel, sdpa)
    # a chunk of one sequence that continues a long cached prefix: its queries see all of it
    _IMPL[0] = CPUAttention().paged_attention
    kernel.clear()
    case = make_case([200, 5], [64, 5], 4, 2, 32, 16)
    check(case, "a chunk over a cached prefix", num_decodes=0)
    assert kernel == [(69, 4, 32)]


@pytest.mark.parametrize("decode_path", ["c_kernel"], indirect=True)
def test_a_step_reused_by_every_layer_is_planned_afresh_when_its_tables_change(decode_path):
    """The backend makes each prefill token's table row once per step (every layer gets the same
    metadata tensors): the same tensor changed in place, or another step, is planned afresh."""
    from minipaged.cpu.attention import CPUAttention

    attn = CPUAttention()
    case = make_case([20, 20], [20, 20], 4, 2, 32, 16)  # equal lengths: only the tables tell the steps apart
    first = None
    for _ in range(2):  # the second call reuses the step's rows
        got = attn.paged_attention(*case.args(), num_decodes=0)
        assert_attention_close(got, reference(*case.args()), case, "a step's rows, reused")
        first = got if first is None else first
    case.block_tables[[0, 1]] = case.block_tables[[1, 0]].clone()  # in place: each sequence reads the other's pages
    got = attn.paged_attention(*case.args(), num_decodes=0)
    assert_attention_close(got, reference(*case.args()), case, "the same tables tensor, changed in place")
    assert not torch.allclose(got, first), "the swap made no difference: the test proves nothing"
    # a cache whose pages are not contiguous: PyTorch's SDPA serves it
    wide_k = torch.zeros(*case.k_cache.shape[:-1], 2 * case.k_cache.shape[-1])
    wide_k[..., ::2] = case.k_cache
    k_view = wide_k[..., ::2]
    assert not k_view.is_contiguous()
    got = attn.paged_attention(case.q, k_view, case.v_cache, case.block_tables, case.context_lens, case.query_start_loc,
                               case.scale)
    assert_attention_close(got, reference(*case.args()), case, "pages that are not contiguous")


@pytest.mark.parametrize("decode_path", ["c_kernel"], indirect=True)
def test_c_kernel_refuses_a_block_outside_the_cache(decode_path):
    case = make_case([20, 5], [1, 1], 4, 2, 32, 16)
    tables = case.block_tables.clone()
    tables[0, 1] = case.k_cache.shape[0] + 3
    with pytest.raises(IndexError, match="outside the cache"):
        kernels.paged_decode(case.q, case.k_cache, case.v_cache, tables, case.context_lens, 0.1)


@pytest.mark.parametrize("decode_path", ["sdpa"], indirect=True)
def test_all_decodes_in_one_attention_call(monkeypatch, decode_path):
    """The batching contract: a decode batch is one SDPA call, not a loop over sequences."""
    calls = _count_sdpa_calls(monkeypatch)
    ctx = [35, 40, 64, 90, 110, 47, 100, 36] * 8  # a chat batch: lengths within 2x of each other
    case = make_case(ctx, [1] * len(ctx), 9, 3, 64, 16)
    check(case, "sixty-four decodes", num_decodes=len(ctx))
    assert calls == [(len(ctx), 9, 1, 64)], f"expected one SDPA call for {len(ctx)} decodes, got {calls}"
    calls.clear()
    case = make_case([10, 20, 30, 12, 11], [1, 1, 10, 12, 3], 9, 3, 64, 16)
    monkeypatch.setattr(torch_sdpa, "PREFILL_PAD_LIMIT", float("inf"))
    check(case, "decodes + prefills", num_decodes=2)
    assert len(calls) == 2, f"expected one call for the decodes and one for the padded prefills, got {calls}"


@pytest.mark.parametrize("decode_path", ["sdpa"], indirect=True)
def test_very_unequal_decodes_take_a_few_calls_at_most(monkeypatch, decode_path):
    calls = _count_sdpa_calls(monkeypatch)
    ctx = [1, 3, 16, 17, 90, 200, 5, 64] * 5
    case = make_case(ctx, [1] * len(ctx), 9, 3, 64, 16)
    check(case, "forty unequal decodes", num_decodes=len(ctx))
    assert 1 < len(calls) <= torch_sdpa.DECODE_MAX_GROUPS, calls
    assert sum(c[0] for c in calls) == len(ctx)


@pytest.mark.parametrize("lens", [[5], [7] * 9, [1, 3, 16, 17, 90, 200, 5, 64] * 5, [500, 20, 20, 20], [1, 1000] * 30])
@pytest.mark.parametrize("limit, most", [(2.0, 4), (1.0, 2), (1.5, 8)])
def test_decode_groups_cover_each_sequence_once_within_the_limits(lens, limit, most):
    groups = torch_sdpa.decode_groups(lens, limit, most)
    assert sorted(i for g in groups for i in g) == list(range(len(lens)))
    assert 1 <= len(groups) <= most
    if len(lens) * max(lens) <= limit * sum(lens):
        assert len(groups) == 1
    for g in groups[:-1]:  # the last group takes the rest; the others keep within the limit
        assert len(g) * max(lens[i] for i in g) <= limit * sum(lens[i] for i in g)
    assert torch_sdpa.decode_groups([], limit, most) == []


def test_out_none_and_dtype():
    case = make_case([5, 9, 17], [1, 1, 17], 4, 2, 32, 16)
    got = fast(*case.args(), num_decodes=2)
    assert got.shape == case.q.shape
    assert_attention_close(got, reference(*case.args()), case, "out=None")


def test_bad_num_decodes_is_a_clear_error():
    case = make_case([5, 9, 17], [1, 4, 17], 4, 2, 32, 16)
    with pytest.raises(ValueError, match="first num_decodes sequences must have exactly one query"):
        fast(*case.args(), num_decodes=2)
    with pytest.raises(ValueError, match="num_decodes=4"):
        fast(*case.args(), num_decodes=4)
    with pytest.raises(ValueError, match="num_decodes=-1"):
        fast(*case.args(), num_decodes=-1)


def test_more_queries_than_context_is_a_clear_error():
    case = make_case([5, 9], [1, 9], 4, 2, 32, 16)
    bad = case.context_lens.clone()
    bad[1] = 4
    with pytest.raises(ValueError, match="sequence 1: 9 new tokens but context_len is only 4"):
        fast(case.q, case.k_cache, case.v_cache, case.block_tables, bad, case.query_start_loc, case.scale)


def test_gqa_not_a_multiple_is_a_clear_error():
    case = make_case([5], [1], 4, 2, 32, 16)
    q = torch.randn(1, 3, 32)
    with pytest.raises(ValueError, match="num_heads=3 is not a multiple of num_kv_heads=2"):
        fast(q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, case.query_start_loc, case.scale)


@settings(max_examples=40, deadline=None)
@given(
    data=st.data(),
    kv_heads=st.sampled_from([1, 3]),
    group=st.sampled_from([1, 3]),
    block_size=st.sampled_from([1, 16, 64]),
    pad_limit=st.sampled_from([0.0, 2.0, float("inf")]),
)
def test_fast_matches_reference_property(data, kv_heads, group, block_size, pad_limit):
    num_seqs = data.draw(st.integers(1, 6))
    ctx = data.draw(st.lists(st.integers(1, 140), min_size=num_seqs, max_size=num_seqs))
    q_lens = [data.draw(st.sampled_from([1, c, data.draw(st.integers(1, c))])) for c in ctx]
    order = sorted(range(num_seqs), key=lambda s: q_lens[s] != 1) if data.draw(st.booleans()) else list(range(num_seqs))
    ctx, q_lens = [ctx[s] for s in order], [q_lens[s] for s in order]
    nd = next((i for i, n in enumerate(q_lens) if n != 1), num_seqs)
    case = make_case(ctx, q_lens, kv_heads * group, kv_heads, 32, block_size, seed=data.draw(st.integers(0, 2**31 - 1)))
    old = torch_sdpa.PREFILL_PAD_LIMIT
    torch_sdpa.PREFILL_PAD_LIMIT = pad_limit
    try:
        out = fast(*case.args(), num_decodes=data.draw(st.sampled_from([None, nd])))
    finally:
        torch_sdpa.PREFILL_PAD_LIMIT = old
    assert_attention_close(out, reference(*case.args()), case, f"torch_sdpa (pad limit {pad_limit}) vs reference")


def test_backend_names(decode_path):
    assert get_backend("torch") is TORCH and get_backend("reference") is REFERENCE
    assert TORCH.paged_attention is torch_sdpa.paged_attention and REFERENCE.paged_attention is reference
    if decode_path == "c_kernel":
        from minipaged.cpu.attention import CPUAttention

        cpu = CPUAttention().backend()
        assert cpu.name == "cpu" and cpu.takes_num_decodes
    with pytest.raises(ValueError, match="reference"):
        get_backend("nope")
