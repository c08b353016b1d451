"""The reference attention backend against SDPA on dense tensors, and the choice of backend.

The helpers at the top (make_case, sdpa_oracle, assert_attention_close) are shared with
test_triton_attention.py: every backend is held to the same dense oracle.
"""
from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap
import warnings
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import minipaged.attention as attention
from minipaged.attention import get_backend, triton_available
from minipaged.attention.reference import paged_attention as reference_attention

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


# ----------------------------------------------------------------------------------------------
# Shared helpers: a random paged batch, the dense oracle, a comparison that says where
# ----------------------------------------------------------------------------------------------
@dataclass
class Case:
    q: torch.Tensor  # (num_tokens, num_heads, head_dim)
    k_cache: torch.Tensor  # (num_blocks, block_size, num_kv_heads, head_dim)
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # (num_seqs, max_blocks) int32
    context_lens: torch.Tensor  # (num_seqs,) int32
    query_start_loc: torch.Tensor  # (num_seqs + 1,) int32
    scale: float
    seed: int

    def args(self) -> tuple:
        return (self.q, self.k_cache, self.v_cache, self.block_tables, self.context_lens, self.query_start_loc, self.scale)

    def describe(self) -> str:
        nb, bs, hkv, d = self.k_cache.shape
        return (
            f"seed={self.seed}, {self.q.dtype}, heads {self.q.shape[1]}/{hkv} (q/kv), head_dim {d}, block_size {bs}, "
            f"context_lens {self.context_lens.tolist()}, q_lens {self.query_start_loc.diff().tolist()}"
        )


def fresh_seed() -> int:
    """New inputs every run; the seed goes into every failure message so a failure can be replayed."""
    return random.randrange(2**31)


def make_case(
    context_lens: list[int],
    q_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    *,
    layout: str = "shuffled",
    seed: int | None = None,
) -> Case:
    """A random batch in a paged cache whose blocks are scattered over the pool.

    layout: "shuffled" (physical blocks in random order), "non_contiguous" (the block table is a
    strided view, column stride 2), or "shared" (every sequence's first block(s) are sequence 0's
    blocks, as after a fork or a prefix-cache hit). Block-table entries past a sequence's last
    block hold other valid block ids, which a kernel must not read.
    """
    seed = fresh_seed() if seed is None else seed
    g = torch.Generator().manual_seed(seed)
    num_seqs = len(context_lens)
    assert len(q_lens) == num_seqs and all(1 <= q <= c for q, c in zip(q_lens, context_lens))
    need = [-(-c // block_size) for c in context_lens]
    max_blocks = max(need)
    num_blocks = sum(need) + 3
    perm = torch.randperm(num_blocks, generator=g)
    table = torch.randint(0, num_blocks, (num_seqs, max_blocks), generator=g, dtype=torch.int32)
    used = 0
    for s, n in enumerate(need):
        table[s, :n] = perm[used : used + n].int()
        used += n
    if layout == "shared":
        shared = min(need) if num_seqs > 1 else 0
        shared = max(1, min(shared, need[0]))
        for s in range(1, num_seqs):
            k = min(shared, need[s])
            table[s, :k] = table[0, :k]
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    qsl = torch.zeros(num_seqs + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(q_lens).cumsum(0)
    q = torch.randn(int(qsl[-1]), num_heads, head_dim, generator=g).to(dtype)
    table = table.to(device)
    if layout == "non_contiguous":
        wide = torch.full((num_seqs, 2 * max_blocks), -7, dtype=torch.int32, device=device)
        wide[:, ::2] = table
        table = wide[:, ::2]
        assert not table.is_contiguous()
    return Case(
        q.to(device), k_cache.to(device), v_cache.to(device), table,
        torch.tensor(context_lens, dtype=torch.int32, device=device), qsl.to(device), head_dim**-0.5, seed,
    )


def sdpa_oracle(case: Case) -> torch.Tensor:
    """Attention on dense tensors: gather each sequence's tokens position by position (not through
    the reference's gather), expand KV heads, and run SDPA in float64 with a causal offset mask."""
    q, k_cache, v_cache = case.q, case.k_cache, case.v_cache
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    out = torch.full(q.shape, float("nan"), dtype=torch.float64, device=q.device)
    qsl, ctx = case.query_start_loc.tolist(), case.context_lens.tolist()
    for s, c in enumerate(ctx):
        q0, q1 = qsl[s], qsl[s + 1]
        pos = torch.arange(c, device=q.device)
        blocks = case.block_tables[s].long()[pos // block_size]
        k = k_cache[blocks, pos % block_size].double().repeat_interleave(group, dim=1)  # (C, H, D)
        v = v_cache[blocks, pos % block_size].double().repeat_interleave(group, dim=1)
        q_pos = torch.arange(c - (q1 - q0), c, device=q.device)
        visible = pos[None, :] <= q_pos[:, None]  # (Q, C)
        o = F.scaled_dot_product_attention(
            q[q0:q1].double().transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=visible, scale=case.scale
        )  # (H, Q, D)
        out[q0:q1] = o.transpose(0, 1)
    return out


def assert_attention_close(out: torch.Tensor, expected: torch.Tensor, case: Case, what: str, tol: float | None = None) -> None:
    """||out - expected|| / ||expected|| < tol, or a failure that names the worst sequence, token and head."""
    if tol is None:  # the coarser of q's and the cache's dtype sets the bar
        tol = max(TOLERANCE[case.q.dtype], TOLERANCE[case.k_cache.dtype])
    qsl = case.query_start_loc.tolist()

    def where(token: int, head: int) -> str:
        s = max(i for i in range(len(qsl) - 1) if qsl[i] <= token)
        c, ql = case.context_lens[s].item(), qsl[s + 1] - qsl[s]
        return f"sequence {s} (context {c}, query {token - qsl[s]} of {ql}, position {c - ql + token - qsl[s]}), head {head}"

    got = out.detach().double().cpu()
    exp = expected.detach().double().cpu()
    bad = ~torch.isfinite(got)
    if bad.any():
        t, h, _ = bad.nonzero()[0].tolist()
        pytest.fail(f"{what}: {int(bad.sum())} outputs not finite (NaN = never written), first at {where(t, h)}; {case.describe()}")
    err = ((got - exp).norm() / exp.norm()).item()
    if not err < tol:
        per_row = (got - exp).norm(dim=-1)  # (num_tokens, num_heads)
        t, h = divmod(int(per_row.argmax()), per_row.shape[1])
        pytest.fail(
            f"{what}: relative error {err:.2e} >= {tol:.0e}; worst at {where(t, h)}: "
            f"got {got[t, h, :4].tolist()}..., expected {exp[t, h, :4].tolist()}...; {case.describe()}"
        )


# ----------------------------------------------------------------------------------------------
# The reference against SDPA
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (8, 2), (8, 1)], ids=["gqa1", "gqa3", "gqa4", "gqa8"])
@pytest.mark.parametrize("block_size", [8, 16, 128])
def test_reference_decode_matches_sdpa(dtype, heads, block_size):
    bs = block_size
    case = make_case([1, bs - 1, bs, bs + 1, 3 * bs + 2], [1] * 5, *heads, 64, bs, dtype)
    out = reference_attention(*case.args(), out=torch.full_like(case.q, float("nan")))
    assert_attention_close(out, sdpa_oracle(case), case, "reference decode")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("layout", ["shuffled", "non_contiguous", "shared"])
def test_reference_prefill_mixed_batch_matches_sdpa(dtype, layout):
    """Full prefill, chunked prefill over a cached prefix, and decode rows in one batch."""
    case = make_case([1, 15, 16, 17, 40, 33], [1, 15, 3, 17, 1, 9], 6, 2, 128, 16, dtype, layout=layout)
    out = reference_attention(*case.args(), out=torch.full_like(case.q, float("nan")))
    assert_attention_close(out, sdpa_oracle(case), case, f"reference prefill ({layout})")


@settings(max_examples=40, deadline=None)
@given(
    data=st.data(),
    kv_heads=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 2, 3, 4]),
    head_dim=st.sampled_from([8, 24, 64]),
    block_size=st.sampled_from([1, 4, 16]),
)
def test_reference_matches_sdpa_property(data, kv_heads, group, head_dim, block_size):
    num_seqs = data.draw(st.integers(1, 4))
    ctx = data.draw(st.lists(st.integers(1, 40), min_size=num_seqs, max_size=num_seqs))
    q_lens = [data.draw(st.integers(1, c)) for c in ctx]
    case = make_case(ctx, q_lens, kv_heads * group, kv_heads, head_dim, block_size, seed=data.draw(st.integers(0, 2**31 - 1)))
    out = reference_attention(*case.args())
    assert_attention_close(out, sdpa_oracle(case), case, "reference")


def test_reference_rejects_bad_shapes():
    case = make_case([4], [2], 6, 4, 16, 4)
    with pytest.raises(ValueError, match="not a multiple"):
        reference_attention(*case.args())
    case = make_case([4], [4], 4, 2, 16, 4)
    with pytest.raises(ValueError, match="context_len"):
        reference_attention(case.q, case.k_cache, case.v_cache, case.block_tables, torch.tensor([3], dtype=torch.int32),
                            case.query_start_loc, case.scale)


# ----------------------------------------------------------------------------------------------
# Backend selection
# ----------------------------------------------------------------------------------------------
def test_auto_falls_back_to_torch_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert get_backend("auto").name == "torch"
    from minipaged.attention.torch_sdpa import paged_attention as torch_path

    assert get_backend().paged_attention is torch_path  # the fused path; reference.py is its oracle


def test_auto_falls_back_to_torch_without_triton(monkeypatch):
    monkeypatch.setattr(attention, "triton_available", lambda: False)
    assert get_backend("auto").name == "torch"


@pytest.mark.parametrize("platform, hint", [("linux", "pip install triton"), ("darwin", "attention='torch'")])
def test_triton_without_triton_installed_says_what_to_do(monkeypatch, platform, hint):
    monkeypatch.setattr(attention, "triton_available", lambda: False)
    monkeypatch.setattr(sys, "platform", platform)
    with pytest.raises(ImportError, match="needs the triton package") as info:
        get_backend("triton")
    assert hint in str(info.value)


def test_package_imports_without_triton():
    """As on macOS, where no Triton wheel exists: import works, 'auto' is torch, 'triton' says why not."""
    script = textwrap.dedent(
        """
        import sys
        sys.modules["triton"] = None  # import triton now fails, and find_spec says it is absent
        import minipaged
        from minipaged.attention import get_backend
        assert get_backend("auto").name == "torch"
        try:
            get_backend("triton")
        except ImportError as e:
            print("ImportError:", e)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "needs the triton package" in done.stdout


@pytest.mark.skipif(not triton_available(), reason="needs triton installed")
def test_interpreter_notice_is_given_once():
    """In a fresh interpreter: an earlier test may have imported triton already (transformers does)."""
    pytest.importorskip("triton")
    code = textwrap.dedent("""
        import warnings, torch
        torch.cuda.is_available = lambda: False
        from minipaged import attention
        from minipaged.attention import get_backend
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            backends = [get_backend("triton") for _ in range(3)]
            get_backend("auto")
        notices = [str(w.message) for w in caught if "interpreter" in str(w.message)]
        assert len(notices) == 1, [str(w.message) for w in caught]
        assert "TRITON_INTERPRET=1" in notices[0]
        assert all(b.name == "triton" for b in backends)
        print("OK")
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0 and p.stdout.strip().endswith("OK"), p.stderr[-3000:]


def test_unknown_backend_name_is_rejected():
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_backend("flash")
