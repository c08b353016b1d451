"""The Triton kernels (store K/V, paged decode, paged prefill) against the reference and SDPA.

Without a GPU they run through Triton's CPU interpreter, which get_backend("triton") turns on
before the kernels are defined; shapes are kept small so the file stays quick there. Every
output is poisoned with NaN before the launch, so an element a kernel forgets to write fails.
"""
from __future__ import annotations

import json
import warnings

import pytest
import torch

from minipaged.attention import get_backend, triton_available

if not triton_available():  # not importorskip: triton must not be imported before the interpreter is on
    pytest.skip("Triton is not installed (no wheel for this platform)", allow_module_level=True)
from minipaged.attention.reference import paged_attention as reference_attention  # noqa: E402
from minipaged.kv_cache import write_kv as reference_write_kv  # noqa: E402

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # the once-per-process interpreter notice
    BACKEND = get_backend("triton")
from minipaged.attention import triton_paged as tp  # noqa: E402

# Shared with the reference's tests: the random paged batch, the dense oracle, the comparison.
from test_attention_reference import Case, assert_attention_close, fresh_seed, make_case, sdpa_oracle  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if tp.INTERPRETED:
    pytestmark = pytest.mark.interpreter

BF16 = pytest.param(
    torch.bfloat16,
    marks=pytest.mark.skipif(tp.INTERPRETED, reason="Triton's CPU interpreter has no bfloat16 arithmetic; checked on a GPU"),
)
DTYPES = [torch.float32, torch.float16, BF16]

# (num_heads, num_kv_heads, head_dim, block_size): every GQA ratio (1, 3, 4, 8), head_dim 64 and 128
# (plus two that are no power of two), every block size (8, 16, 32, 128), each at least twice.
SHAPES = [
    (2, 2, 64, 8),
    (6, 2, 128, 16),
    (8, 2, 64, 32),
    (8, 1, 128, 128),
    (4, 1, 128, 8),
    (16, 2, 64, 16),
    (3, 3, 80, 32),
    (3, 1, 48, 128),
]
SHAPE_IDS = [f"h{h}-kv{k}-d{d}-bs{b}" for h, k, d, b in SHAPES]


def decode_case(h: int, kv: int, d: int, bs: int, dtype: torch.dtype, **kw) -> Case:
    """Context lengths at the block edges: 1, bs-1, bs, bs+1, and one over several blocks."""
    return make_case([1, bs - 1, bs, bs + 1, 2 * bs + 5], [1] * 5, h, kv, d, bs, dtype, DEVICE, **kw)


def prefill_case(h: int, kv: int, d: int, bs: int, dtype: torch.dtype, **kw) -> Case:
    """One batch with a decode row, full prefills (q_len == context) and chunks after a cached prefix."""
    ctx = [1, bs - 1, bs, bs + 1, 2 * bs + 5]
    q_lens = [1, bs - 1, 3, bs + 1, 7]
    return make_case(ctx, q_lens, h, kv, d, bs, dtype, DEVICE, **kw)


def nan_like(q: torch.Tensor) -> torch.Tensor:
    return torch.full_like(q, float("nan"))


def check_both_oracles(out: torch.Tensor, case: Case, what: str) -> None:
    ref = reference_attention(*case.args())
    assert_attention_close(out, ref.double(), case, f"{what} vs reference")
    assert_attention_close(out, sdpa_oracle(case), case, f"{what} vs SDPA")


# ----------------------------------------------------------------------------------------------
# Store K/V
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [8, 16, 32, 128])
def test_write_kv_matches_reference(dtype, block_size):
    g = torch.Generator().manual_seed(seed := fresh_seed())
    num_blocks, kv_heads, head_dim, num_tokens = 6, 3, 80, 2 * block_size + 3
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    # k and v as slices of one fused qkv projection: strided, as the model hands them over.
    qkv = torch.randn(num_tokens, 3 * kv_heads, head_dim, generator=g).to(DEVICE)
    k, v = qkv[:, kv_heads : 2 * kv_heads], qkv[:, 2 * kv_heads :]
    caches = [torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype).to(DEVICE) for _ in range(2)]
    expect = [c.clone() for c in caches]
    tp.write_kv(*caches, k, v, slots.to(DEVICE))
    reference_write_kv(*expect, k, v, slots.to(DEVICE))
    for name, got, exp in zip("KV", caches, expect):
        diff = (got != exp).nonzero()
        assert len(diff) == 0, f"{name} cache differs from write_kv at (block, row, head, dim) {diff[0].tolist()}; seed={seed}"


def test_write_kv_skips_negative_slots():
    cache = [torch.zeros(2, 8, 1, 16, device=DEVICE) for _ in range(2)]
    k = torch.ones(3, 1, 16, device=DEVICE)
    tp.write_kv(*cache, k, 2 * k, torch.tensor([3, -1, 9], device=DEVICE))
    assert cache[0].flatten(0, 1)[[3, 9]].eq(1).all() and cache[1].flatten(0, 1)[[3, 9]].eq(2).all()
    assert cache[0].sum() == 2 * 16 and cache[1].sum() == 2 * 2 * 16, "the padding token (slot -1) was written"


# ----------------------------------------------------------------------------------------------
# Paged decode and paged prefill against both oracles
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_decode_matches_oracles(shape, dtype):
    case = decode_case(*shape, dtype)
    ref, dense = reference_attention(*case.args()).double(), sdpa_oracle(case)
    args = case.args()[:5] + (case.scale,)
    # Split-KV into 3 pieces: some sequences' pieces are empty, which the reduce must ignore.
    for splits in (1, 3):
        out = tp.paged_decode(*args, out=nan_like(case.q), num_splits=splits)
        assert_attention_close(out, ref, case, f"decode (num_splits={splits}) vs reference")
        assert_attention_close(out, dense, case, f"decode (num_splits={splits}) vs SDPA")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_prefill_matches_oracles(shape, dtype):
    case = prefill_case(*shape, dtype)
    out = tp.paged_prefill(*case.args(), out=nan_like(case.q))
    check_both_oracles(out, case, "prefill")


@pytest.mark.parametrize("layout", ["non_contiguous", "shared"])
def test_block_table_layouts(layout):
    """A strided block table, and blocks shared between sequences (fork, prefix cache)."""
    case = decode_case(6, 2, 64, 16, torch.float32, layout=layout)
    check_both_oracles(tp.paged_decode(*case.args()[:5], case.scale, out=nan_like(case.q), num_splits=2), case, f"decode ({layout})")
    case = prefill_case(6, 2, 64, 16, torch.float32, layout=layout)
    check_both_oracles(tp.paged_prefill(*case.args(), out=nan_like(case.q)), case, f"prefill ({layout})")


def test_decode_without_head_grouping_matches():
    """The ablation switch (a program per query head) computes the same thing, only slower on a GPU."""
    case = decode_case(8, 2, 64, 16, torch.float32)
    out = tp.paged_decode(*case.args()[:5], case.scale, out=nan_like(case.q), group_heads=False)
    check_both_oracles(out, case, "decode (group_heads=False)")


@pytest.mark.parametrize("q_dtype, cache_dtype", [(torch.float32, torch.float16), (torch.float16, torch.float32)])
def test_query_dtype_may_differ_from_the_cache(q_dtype, cache_dtype):
    """As with an fp32 model over an fp16 KV cache: q is cast to the cache's dtype in the kernel."""
    for build in (decode_case, prefill_case):
        case = build(4, 2, 64, 16, cache_dtype)
        case.q = case.q.to(q_dtype)
        out = tp.paged_attention(*case.args(), out=nan_like(case.q))
        assert out.dtype == q_dtype
        check_both_oracles(out, case, f"{build.__name__}, q {q_dtype}, cache {cache_dtype}")


def test_prefill_kernel_also_serves_a_decode_batch():
    case = decode_case(4, 1, 64, 16, torch.float16)
    check_both_oracles(tp.paged_prefill(*case.args(), out=nan_like(case.q)), case, "prefill kernel on q_len == 1")


def test_kernels_read_nothing_outside_the_context():
    """Every cache slot no sequence owns, and every block-table entry past a sequence's
    blocks, point at NaN: a kernel that reads beyond a context (or forgets a mask) turns NaN."""
    for build, run in [
        (decode_case, lambda c: tp.paged_decode(*c.args()[:5], c.scale, out=nan_like(c.q), num_splits=3)),
        (prefill_case, lambda c: tp.paged_prefill(*c.args(), out=nan_like(c.q))),
    ]:
        case = build(6, 2, 64, 16, torch.float32)
        ref, dense = reference_attention(*case.args()).double(), sdpa_oracle(case)
        bs = case.k_cache.shape[1]
        owned = torch.zeros(case.k_cache.shape[:2], dtype=torch.bool, device=DEVICE)
        for s, c in enumerate(case.context_lens.tolist()):
            pos = torch.arange(c, device=DEVICE)
            owned[case.block_tables[s].long()[pos // bs], pos % bs] = True
        case.k_cache[~owned] = float("nan")
        case.v_cache[~owned] = float("nan")
        out = run(case)
        assert_attention_close(out, ref, case, f"{build.__name__} with NaN outside the contexts vs reference")
        assert_attention_close(out, dense, case, f"{build.__name__} with NaN outside the contexts vs SDPA")


# ----------------------------------------------------------------------------------------------
# A pool past 2**32 elements: offsets must be int64
# ----------------------------------------------------------------------------------------------
def _huge_kv_pool(num_blocks: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype, tmp_path):
    """K and V interleaved in one storage, (num_blocks, 2, block_size, kv_heads, head_dim), as
    vLLM lays them out: K = kv[:, 0], V = kv[:, 1], both non-contiguous.

    On the CPU the storage is a sparse file mapped shared (and unlinked at once): its gigabytes
    are address space only, and only the pages of blocks that are written take memory. On a GPU
    it is real memory, and the test is skipped where there is not enough.
    """
    shape = (num_blocks, 2, block_size, kv_heads, head_dim)
    nbytes = num_blocks * 2 * block_size * kv_heads * head_dim * torch.finfo(dtype).bits // 8
    if DEVICE == "cuda":
        free, _ = torch.cuda.mem_get_info()
        if free < nbytes + 2**30:
            pytest.skip(f"needs {nbytes / 2**30:.1f} GiB of free GPU memory, {free / 2**30:.1f} GiB free")
        kv = torch.zeros(shape, dtype=dtype, device=DEVICE)  # zeros: the reference reads whole blocks
    else:
        path = tmp_path / "pool.bin"
        try:
            kv = torch.from_file(str(path), shared=True, size=nbytes * 8 // torch.finfo(dtype).bits, dtype=dtype).view(shape)
        except (RuntimeError, OSError) as e:  # pragma: no cover - a filesystem without sparse files
            pytest.skip(f"cannot map a sparse {nbytes / 2**30:.1f} GiB file here: {e}")
        path.unlink()  # the mapping lives on; nothing is left on disk
    return kv[:, 0], kv[:, 1]


def test_int64_offsets_in_a_pool_past_2_pow_32(tmp_path):
    """Block ids whose element offset ``block_id * block_stride`` passes 2**32, in an 8 GiB pool.

    An int32 offset wraps there. The pool is large enough that the wrapped offset (true - 2**32)
    still points inside it, so a kernel with that bug reads or writes the wrong block and fails
    the comparison, rather than crashing on an unmapped address. (Offsets between 2**31 and
    2**32 would wrap negative and crash a buggy kernel, so no block of the test sits there.)
    """
    bs, kv_heads, head_dim, dtype = 16, 2, 64, torch.float16
    per_block = 2 * bs * kv_heads * head_dim  # the block stride of K and of V, in elements
    first_big = -(-(2**32) // per_block)
    num_blocks = first_big + 40
    k_cache, v_cache = _huge_kv_pool(num_blocks, bs, kv_heads, head_dim, dtype, tmp_path)
    assert k_cache.stride(0) * first_big >= 2**32

    g = torch.Generator().manual_seed(seed := fresh_seed())
    ctx, q_lens = [1, bs, bs + 1, 3 * bs + 2], [1, bs, 2, 5]
    need = [-(-c // bs) for c in ctx]
    # Mostly blocks far out in the pool, a few near its start, in random order.
    candidates = torch.cat([torch.arange(3), torch.arange(first_big, num_blocks)])
    ids = candidates[torch.randperm(len(candidates), generator=g)[: sum(need)]]
    table = torch.zeros(len(ctx), max(need), dtype=torch.int32)
    used = 0
    for s, n in enumerate(need):
        table[s, :n] = ids[used : used + n].int()
        table[s, n:] = ids[0].int()
        used += n
    assert int(table.max()) >= first_big

    # Store K/V for every context token through the Triton write, and check it where it must land.
    slots, keys, vals = [], [], []
    for s, c in enumerate(ctx):
        pos = torch.arange(c)
        slots.append(table[s].long()[pos // bs] * bs + pos % bs)
        keys.append(torch.randn(c, kv_heads, head_dim, generator=g).to(dtype))
        vals.append(torch.randn(c, kv_heads, head_dim, generator=g).to(dtype))
    slots, keys, vals = (torch.cat(x).to(DEVICE) for x in (slots, keys, vals))
    tp.write_kv(k_cache, v_cache, keys, vals, slots)
    assert torch.equal(k_cache[slots // bs, slots % bs], keys), f"write_kv put K in the wrong place; seed={seed}"
    assert torch.equal(v_cache[slots // bs, slots % bs], vals), f"write_kv put V in the wrong place; seed={seed}"

    for name, lens, run in [
        ("decode", [1] * len(ctx), lambda c: tp.paged_decode(*c.args()[:5], c.scale, out=nan_like(c.q), num_splits=2)),
        ("prefill", q_lens, lambda c: tp.paged_prefill(*c.args(), out=nan_like(c.q))),
    ]:
        qsl = torch.zeros(len(ctx) + 1, dtype=torch.int32)
        qsl[1:] = torch.tensor(lens).cumsum(0)
        q = torch.randn(int(qsl[-1]), 4 * kv_heads, head_dim, generator=g).to(dtype)
        case = Case(q.to(DEVICE), k_cache, v_cache, table.to(DEVICE), torch.tensor(ctx, dtype=torch.int32, device=DEVICE),
                    qsl.to(DEVICE), head_dim**-0.5, seed)
        check_both_oracles(run(case), case, f"{name} in a {k_cache.untyped_storage().nbytes() / 2**30:.1f} GiB pool")


# ----------------------------------------------------------------------------------------------
# The engine's entry point: dispatch and errors
# ----------------------------------------------------------------------------------------------
def test_paged_attention_dispatches_on_shapes(monkeypatch):
    calls = []
    monkeypatch.setattr(tp, "paged_decode", lambda *a, **k: calls.append("decode") or a[0])
    monkeypatch.setattr(tp, "paged_prefill", lambda *a, **k: calls.append("prefill") or a[0])
    tp.paged_attention(*decode_case(4, 2, 16, 8, torch.float32).args())
    tp.paged_attention(*prefill_case(4, 2, 16, 8, torch.float32).args())
    assert calls == ["decode", "prefill"]
    assert BACKEND.paged_attention is tp.paged_attention and BACKEND.write_kv is tp.write_kv


def test_paged_attention_end_to_end_with_out():
    for case in (decode_case(6, 2, 64, 8, torch.float16), prefill_case(6, 2, 64, 8, torch.float16)):
        out = nan_like(case.q)
        assert tp.paged_attention(*case.args(), out=out) is out
        check_both_oracles(out, case, "paged_attention")


def test_a_smaller_tile_is_tried_when_the_gpu_lacks_shared_memory(monkeypatch):
    """A T4 has 64 KiB of shared memory per block: fp32 prefill at head_dim 128 needs a smaller
    tile than an A100 or H100 takes. Simulated: configs above a size raise OutOfResources."""
    from triton.runtime.errors import OutOfResources

    tried = []

    class SmallGpu:
        def __init__(self, kernel, limit):
            self.kernel, self.limit = kernel, limit

        def __getitem__(self, grid):
            def launch(*args, **kw):
                tried.append((kw.get("BLOCK_M"), kw["TILE"]))
                if kw["TILE"] > self.limit:
                    raise OutOfResources(2 * 65536, 65536, "shared memory")
                return self.kernel[grid](*args, **kw)

            return launch

    monkeypatch.setattr(tp, "_fitting", {})
    monkeypatch.setattr(tp, "_paged_prefill_kernel", SmallGpu(tp._paged_prefill_kernel, 32))
    monkeypatch.setattr(tp, "_paged_decode_kernel", SmallGpu(tp._paged_decode_kernel, 16))
    for _ in range(2):  # the second call starts from the config that fitted
        case = prefill_case(4, 2, 64, 16, torch.float32)
        check_both_oracles(tp.paged_prefill(*case.args(), out=nan_like(case.q)), case, "prefill on a small GPU")
        case = decode_case(4, 2, 64, 16, torch.float32)
        check_both_oracles(tp.paged_decode(*case.args()[:5], case.scale, out=nan_like(case.q)), case, "decode on a small GPU")
    assert tried == [(64, 64), (64, 32), (None, 64), (None, 32), (None, 16), (64, 32), (None, 16)]


def test_clear_errors():
    case = decode_case(6, 2, 16, 8, torch.float32)
    with pytest.raises(TypeError, match="share a dtype"):
        tp.paged_attention(case.q, case.k_cache, case.v_cache.half(), *case.args()[3:])
    with pytest.raises(TypeError, match="not torch.int64"):
        tp.paged_attention(case.q.long(), *case.args()[1:])
    with pytest.raises(ValueError, match="not a multiple"):
        tp.paged_attention(case.q[:, :5], *case.args()[1:])
    if tp.INTERPRETED:
        bf = [t.bfloat16() for t in case.args()[:3]]
        with pytest.raises(TypeError, match="no bfloat16"):
            tp.paged_attention(*bf, *case.args()[3:])


# ----------------------------------------------------------------------------------------------
# The GPU benchmark: its CPU path, and one case run through the interpreter with faked timing
# ----------------------------------------------------------------------------------------------
def test_kernel_benchmark_without_gpu_says_so(monkeypatch, tmp_path, capsys):
    from minipaged.bench.commands import main as bench_main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench_main(["kernels", "--json", str(tmp_path / "k.json")]) == 0
    said = capsys.readouterr().out
    assert "no CUDA GPU is present" in said and "Nothing was measured" in said
    assert json.loads((tmp_path / "k.json").read_text())["device"] is None


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_kernel_benchmark_case_and_table(monkeypatch):
    """Everything in a benchmark case but the CUDA timing: the pool, the rotated block tables,
    the dense copies, the correctness check, every peer's call, the ratios and the table."""
    from minipaged.bench import kernels as kb

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (2**40, 2**40))
    rotations = []

    def fake_time(fn, n, **kw):
        for i in range(n):
            fn(i)
        rotations.append(n)
        return 0.5 if len(rotations) == 1 else 1.0  # paged 0.5 ms, every peer 1 ms

    monkeypatch.setattr(kb, "time_cuda", fake_time)
    monkeypatch.setattr(kb, "ROTATE_BYTES", 2 * kb.kv_bytes(2, 32, elem=4))
    try:
        from torch.nn.attention.flex_attention import flex_attention
    except ImportError:  # pragma: no cover - torch < 2.5
        flex_attention = None
    case = kb.run_case(2, 32, torch.float32, 100.0, tp, flex_attention, "no flex", True, torch.device(DEVICE), float("inf"))
    assert case["paged_vs_sdpa_rel_err"] < 1e-5
    assert rotations[0] == 2
    assert case["results"]["paged"]["GBps"] == pytest.approx(kb.kv_bytes(2, 32, elem=4) / 0.5e-3 / 1e9)
    assert case["ratios"]["sdpa_over_paged"] == pytest.approx(2.0)
    report = {"device": "test", "copy_GBps": 100.0, "peers": list(kb.PEER_LABELS), "cases": [case],
              "config": {"dtype": "float32", "num_heads": 32, "num_kv_heads": 8, "head_dim": 128, "block_size": 16}}
    report["cases"].append({"batch": 256, "context": 16384, "kv_bytes": kb.kv_bytes(256, 16384),
                            "results": {"paged": {"name": "paged", "skipped": "needs 40 GiB"}}})
    table = kb.format_table(report)
    assert "skipped: needs 40 GiB" in table and "2.00" in table, table
    json.dumps(report)  # the report is plain JSON


# ----------------------------------------------------------------------------------------------
# The engine on a tiny random Llama: the same greedy tokens with either backend
# ----------------------------------------------------------------------------------------------
def test_engine_greedy_tokens_match_the_torch_backend(tiny_model, monkeypatch):
    """A tiny random Llama served by the engine: chunked prefills mixed with decodes in one step
    (a small token budget), block size 8; attention="triton" must pick the very same greedy tokens."""
    from minipaged.engine import LLMEngine
    from minipaged.sampling import SamplingParams

    model, tok = tiny_model
    g = torch.Generator().manual_seed(seed := fresh_seed())
    prompts = [torch.randint(3, model.config.vocab_size, (n,), generator=g).tolist() for n in (1, 7, 8, 9, 30)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    launches = {"decode": 0, "prefill": 0}
    for name in launches:
        kernel = getattr(tp, f"paged_{name}")
        monkeypatch.setattr(tp, f"paged_{name}", lambda *a, _k=kernel, _n=name, **kw: launches.__setitem__(_n, launches[_n] + 1) or _k(*a, **kw))
    tokens = {}
    for attention in ("torch", "triton"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            engine = LLMEngine(model, tok, attention=attention, block_size=8, num_blocks=48, max_num_batched_tokens=24, record_trace=False)
        assert engine.backend.name == attention
        ids = [engine.add_request(p, params) for p in prompts]
        done = engine.run()
        tokens[attention] = [done[i].token_ids for i in ids]
    assert launches["decode"] > 0 and launches["prefill"] > 0, launches
    for i, (want, got) in enumerate(zip(tokens["torch"], tokens["triton"])):
        assert got == want, f"prompt {i} ({len(prompts[i])} tokens): triton {got} vs torch {want}; seed={seed}"
