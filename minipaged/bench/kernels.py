"""`python -m minipaged.bench kernels`: the paged decode kernel against the memory system and dense peers.

Owns the GPU measurement: the device's copy bandwidth, then for each batch x context the paged
decode kernel, SDPA on contiguous tensors and flex attention, each as time, achieved GB/s (the
K/V bytes decode must read, over the time) and ratios. Needs a CUDA GPU; elsewhere it says so and
exits 0. The kernels' correctness is tests/test_triton_attention.py's business.
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

BATCHES = (1, 16, 64, 256)
CONTEXTS = (512, 4096, 16384)
HEAD_DIM, NUM_KV_HEADS, NUM_HEADS, BLOCK_SIZE = 128, 8, 32, 16
TIME_BUDGET_S = 270.0  # the whole run stays under 5 minutes; cases past it are reported as skipped
ROTATE_BYTES = 512 * 2**20  # inputs per measurement cycle through at least this much memory (L2 is ~50 MB)
NO_GPU = "no CUDA GPU is present: the kernel benchmark measures GPU memory bandwidth and needs one. Nothing was measured."


# -- pure helpers (tested on the CPU) --------------------------------------------------------
def kv_bytes(batch: int, context: int, num_kv_heads: int = NUM_KV_HEADS, head_dim: int = HEAD_DIM, elem: int = 2) -> int:
    """The K and V bytes one decode step must read: every context token, every KV head, once."""
    return 2 * batch * context * num_kv_heads * head_dim * elem


def rotations_for(nbytes: int, limit: int = 64) -> int:
    """How many copies of a case's inputs to cycle through so that no repeat finds them in L2."""
    return max(1, min(limit, math.ceil(ROTATE_BYTES / max(1, nbytes))))


def summarize(name: str, ms: float | None, nbytes: int, copy_gbps: float, skipped: str | None = None) -> dict[str, Any]:
    if ms is None:
        return {"name": name, "skipped": skipped or "not measured"}
    gbps = nbytes / (ms * 1e-3) / 1e9
    return {"name": name, "ms": ms, "GBps": gbps, "fraction_of_copy": gbps / copy_gbps if copy_gbps else None}


def add_ratios(case: dict[str, Any]) -> dict[str, Any]:
    """peer time / paged time for every measured peer: above 1, the paged kernel is faster."""
    paged = case["results"].get("paged", {})
    case["ratios"] = {
        f"{name}_over_paged": r["ms"] / paged["ms"]
        for name, r in case["results"].items()
        if name != "paged" and "ms" in r and "ms" in paged
    }
    return case


PEER_LABELS = {"paged_no_split": "no split", "paged_no_gqa_grouping": "no GQA grp", "sdpa": "SDPA", "flex": "flex"}


def format_table(report: dict[str, Any]) -> str:
    peers = [p for p in PEER_LABELS if p in report.get("peers", [])]
    cfg = report["config"]
    head = f"{'batch':>5} {'context':>7} {'KV MiB':>8} | {'paged us':>9} {'GB/s':>6} {'of copy':>7}"
    for p in peers:
        head += f" | {PEER_LABELS[p] + ' us':>13} {'x':>5}"
    lines = [
        f"device: {report['device']}   copy bandwidth (read + write): {report['copy_GBps']:.0f} GB/s",
        f"paged decode, {cfg['dtype']}, {cfg['num_heads']} query / {cfg['num_kv_heads']} KV heads, head_dim {cfg['head_dim']}, "
        f"block_size {cfg['block_size']}",
        "GB/s: K/V bytes decode must read / time.  x: peer time / paged time (above 1: paged is faster).",
        "no split / no GQA grp: the paged kernel with split-KV / query-head grouping switched off.",
        "",
        head,
        "-" * len(head),
    ]
    for c in report["cases"]:
        row = f"{c['batch']:>5} {c['context']:>7} {c['kv_bytes'] / 2**20:>8.1f} | "
        paged = c["results"].get("paged", {})
        if "ms" not in paged:
            lines.append(row + f"skipped: {paged.get('skipped', '?')}")
            continue
        row += f"{paged['ms'] * 1e3:>9.1f} {paged['GBps']:>6.0f} {paged['fraction_of_copy']:>7.0%}"
        for p in peers:
            r = c["results"].get(p, {})
            if "ms" in r:
                row += f" | {r['ms'] * 1e3:>13.1f} {c['ratios'][p + '_over_paged']:>5.2f}"
            else:
                row += f" | {'-':>13} {'':>5}"
        lines.append(row)
    notes = sorted(
        {f"{PEER_LABELS.get(p, p)}: {r['skipped']}" for c in report["cases"] for p, r in c["results"].items() if "skipped" in r and p != "paged"}
    )
    if notes:
        lines += ["", "peers not measured:"] + [f"  {n}" for n in notes]
    return "\n".join(lines)


# -- measurement (CUDA only) ------------------------------------------------------------------
_CYCLES_PER_MS: list[float] = []


def _gpu_cycles_per_ms() -> float | None:
    """How many cycles ``torch.cuda._sleep`` spins per millisecond on this GPU (measured once)."""
    if not hasattr(torch.cuda, "_sleep"):
        return None
    if not _CYCLES_PER_MS:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(10**7)
        end.record()
        torch.cuda.synchronize()
        _CYCLES_PER_MS.append(10**7 / max(start.elapsed_time(end), 1e-3))
    return _CYCLES_PER_MS[0]


def time_cuda(fn: Callable[[int], Any], rotations: int, min_reps: int = 20, max_reps: int = 300, target_s: float = 0.25) -> float:
    """Median milliseconds of ``fn(i)`` on the GPU, by CUDA events, after warm-up; call i reads rotation i % rotations.

    A small kernel runs faster than Python can launch it, so events around each call would time
    the launch gap too. Before each chunk of calls the GPU is therefore held in a spin
    (torch.cuda._sleep) long enough for the whole chunk to be queued; it then runs the calls back
    to back and each event pair brackets GPU work only.
    """
    for i in range(3):
        fn(i % rotations)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for i in range(5):
        fn(i % rotations)
    host_ms = (time.perf_counter() - t) / 5 * 1e3  # enqueue time per call (the queue is not full yet)
    torch.cuda.synchronize()
    gpu_ms = (time.perf_counter() - t) / 5 * 1e3
    reps = int(max(min_reps, min(max_reps, target_s * 1e3 / max(gpu_ms, 1e-3))))
    cycles_per_ms = _gpu_cycles_per_ms()
    times: list[float] = []
    chunk = 25
    for first in range(0, reps, chunk):
        n = min(chunk, reps - first)
        if cycles_per_ms:
            torch.cuda._sleep(int(cycles_per_ms * (2 * n * host_ms + 1)))
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
        for j, (start, end) in enumerate(events):
            start.record()
            fn((first + j) % rotations)
            end.record()
        torch.cuda.synchronize()
        times += [s.elapsed_time(e) for s, e in events]
    return statistics.median(times)


def copy_bandwidth_gbps(device: torch.device) -> float:
    """Device-to-device copy of a large buffer: (bytes read + bytes written) / time."""
    free, _ = torch.cuda.mem_get_info(device)
    nbytes = int(min(2 * 2**30, free // 4)) // 16 * 16
    src = torch.empty(nbytes // 2, dtype=torch.float16, device=device).normal_()
    dst = torch.empty_like(src)
    ms = time_cuda(lambda i: dst.copy_(src), 1, min_reps=10, max_reps=50)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / (ms * 1e-3) / 1e9


def _flex() -> tuple[Callable | None, str | None]:
    try:
        import torch._dynamo
        from torch.nn.attention.flex_attention import flex_attention
    except Exception as e:  # noqa: BLE001 - an old torch: reported, not raised
        return None, f"flex attention unavailable in torch {torch.__version__} ({type(e).__name__})"
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    return torch.compile(flex_attention), None


def _sdpa_gqa_supported() -> bool:
    try:
        q = torch.zeros(1, 2, 1, 8, device="cuda", dtype=torch.float16)
        kv = torch.zeros(1, 1, 4, 8, device="cuda", dtype=torch.float16)
        F.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)
        return True
    except (TypeError, RuntimeError):
        return False


def run_case(
    batch: int, context: int, dtype: torch.dtype, copy_gbps: float, tp: Any, flex: Callable | None,
    flex_note: str | None, sdpa_gqa: bool, device: torch.device, deadline: float,
) -> dict[str, Any]:
    elem = torch.finfo(dtype).bits // 8
    nbytes = kv_bytes(batch, context, elem=elem)
    case: dict[str, Any] = {"batch": batch, "context": context, "kv_bytes": nbytes, "results": {}}
    R = rotations_for(nbytes)
    expand = 1 if sdpa_gqa else NUM_HEADS // NUM_KV_HEADS
    need = R * nbytes * (1 + expand) + nbytes // 2 + 2**30  # paged pool + dense copies + a gather's temporary + slack
    free, _ = torch.cuda.mem_get_info(device)
    if need > free:
        case["results"]["paged"] = {"name": "paged", "skipped": f"needs {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free"}
        return case
    scale = HEAD_DIM**-0.5
    blocks_per_seq = context // BLOCK_SIZE
    num_blocks = R * batch * blocks_per_seq
    g = torch.Generator(device=device).manual_seed(batch * 100003 + context)
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, device=device, dtype=dtype, generator=g)
    v_cache = torch.randn_like(k_cache)
    # Each rotation reads its own blocks, scattered over the pool as a long-running server leaves them.
    perm = torch.randperm(num_blocks, device=device, generator=g).int()
    tables = [perm[r * batch * blocks_per_seq : (r + 1) * batch * blocks_per_seq].view(batch, blocks_per_seq) for r in range(R)]
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    qs = [torch.randn(batch, NUM_HEADS, HEAD_DIM, device=device, dtype=dtype, generator=g) for _ in range(R)]
    out = torch.empty_like(qs[0])

    def paged(**kw: Any) -> Callable[[int], Any]:
        return lambda i: tp.paged_decode(qs[i], k_cache, v_cache, tables[i], lens, scale, out, **kw)

    # Dense peers read the same tokens, contiguous: (batch, heads, context, head_dim).
    def dense(r: int, t: torch.Tensor) -> torch.Tensor:
        d = t[tables[r].long()].view(batch, context, NUM_KV_HEADS, HEAD_DIM).transpose(1, 2).contiguous()
        return d.repeat_interleave(expand, dim=1) if expand > 1 else d

    ks = [dense(r, k_cache) for r in range(R)]
    vs = [dense(r, v_cache) for r in range(R)]
    q4 = [q.unsqueeze(2) for q in qs]  # (batch, heads, 1, head_dim)
    gqa_kw = {"enable_gqa": True} if sdpa_gqa else {}

    def sdpa(i: int) -> torch.Tensor:
        return F.scaled_dot_product_attention(q4[i], ks[i], vs[i], scale=scale, **gqa_kw)

    # Check before timing: a fast wrong kernel is worth nothing.
    want = sdpa(0).squeeze(2).float()
    got = tp.paged_decode(qs[0], k_cache, v_cache, tables[0], lens, scale).float()
    err = ((got - want).norm() / want.norm()).item()
    case["paged_vs_sdpa_rel_err"] = err
    if not err < 2e-2:
        case["results"]["paged"] = {"name": "paged", "skipped": f"wrong result: relative error {err:.1e} against SDPA"}
        return case

    measures: list[tuple[str, Callable[[int], Any] | None, str | None]] = [
        ("paged", paged(), None),
        ("paged_no_split", paged(num_splits=1), None),
        ("paged_no_gqa_grouping", paged(group_heads=False), None),
        ("sdpa", sdpa, None),
        ("flex", (lambda i: flex(q4[i], ks[i], vs[i], scale=scale, enable_gqa=True)) if flex else None, flex_note),
    ]
    for name, fn, note in measures:
        if fn is None:
            case["results"][name] = summarize(name, None, nbytes, copy_gbps, note)
            continue
        if time.perf_counter() > deadline and name != "paged":
            case["results"][name] = summarize(name, None, nbytes, copy_gbps, "time budget spent")
            continue
        try:
            ms = time_cuda(fn, R)
            case["results"][name] = summarize(name, ms, nbytes, copy_gbps)
        except Exception as e:  # noqa: BLE001 - a peer that fails is reported, not fatal
            torch.cuda.synchronize()
            case["results"][name] = summarize(name, None, nbytes, copy_gbps, f"failed: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}")
    case["num_splits"] = tp.choose_num_splits(batch, batch * NUM_KV_HEADS, blocks_per_seq * BLOCK_SIZE, device)
    return add_ratios(case)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--json", type=Path, help="write the results here as JSON")
    ap.add_argument("--batch", type=int, nargs="+", default=list(BATCHES))
    ap.add_argument("--context", type=int, nargs="+", default=list(CONTEXTS))
    ap.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    ap.add_argument("--no-flex", action="store_true", help="skip flex attention (its compiles take a while)")


def run(args: argparse.Namespace, ap: argparse.ArgumentParser | None = None) -> int:
    ap = ap or getattr(args, "_parser", None) or argparse.ArgumentParser()

    if not torch.cuda.is_available():
        print(f"minipaged bench kernels: {NO_GPU}")
        print("(On this machine the Triton kernels run in the CPU interpreter, which is for correctness only.)")
        if args.json:
            args.json.write_text(json.dumps({"device": None, "skipped": NO_GPU}, indent=2))
            print(f"wrote {args.json}")
        return 0
    from ..attention import get_backend, triton_available

    if not triton_available():
        print("minipaged bench kernels: triton is not installed (pip install triton); nothing was measured.")
        return 0
    get_backend("triton")
    from ..attention import triton_paged as tp

    t0 = time.perf_counter()
    deadline = t0 + TIME_BUDGET_S
    device = torch.device("cuda")
    dtype = getattr(torch, args.dtype)
    print(f"minipaged bench kernels on {torch.cuda.get_device_name(device)}: measuring copy bandwidth ...", flush=True)
    copy_gbps = copy_bandwidth_gbps(device)
    flex, flex_note = (None, "switched off (--no-flex)") if args.no_flex else _flex()
    sdpa_gqa = _sdpa_gqa_supported()
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "python": platform.python_version(),
        "copy_GBps": copy_gbps,
        "config": {
            "dtype": args.dtype, "num_heads": NUM_HEADS, "num_kv_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM,
            "block_size": BLOCK_SIZE, "sdpa": "enable_gqa" if sdpa_gqa else "K/V expanded to every query head",
            "timing": "CUDA events after warm-up, median of many repeats, inputs rotated through >= 512 MiB",
        },
        "peers": ["paged_no_split", "paged_no_gqa_grouping", "sdpa", "flex"],
        "cases": [],
    }
    for batch in args.batch:
        for context in args.context:
            if time.perf_counter() > deadline:
                report["cases"].append({"batch": batch, "context": context, "kv_bytes": kv_bytes(batch, context),
                                        "results": {"paged": {"name": "paged", "skipped": "time budget spent"}}})
                continue
            print(f"  batch {batch:>3} x context {context:>5} ...", flush=True)
            try:
                case = run_case(batch, context, dtype, copy_gbps, tp, flex, flex_note, sdpa_gqa, device, deadline)
            except torch.cuda.OutOfMemoryError:
                case = {"batch": batch, "context": context, "kv_bytes": kv_bytes(batch, context),
                        "results": {"paged": {"name": "paged", "skipped": "out of GPU memory"}}}
            report["cases"].append(case)
            torch.cuda.empty_cache()
    report["wall_s"] = time.perf_counter() - t0
    print()
    print(format_table(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
        print(f"\nwrote {args.json}")
    return 0
