"""Where the GGUF matmul beats MKL on the fp32 copies, and how close each gets to the GEMM rate.

Times one decode step's worth of matmuls (every linear layer of the default model in turn, and
the LM head) at each batch size M, two ways: ``cpu_kernels.qmatmul`` on the kept GGUF blocks,
and PyTorch's ``F.linear`` (MKL) on the fp32 weights; and one layer's MLP up-projection in a loop
(its weights stay in cache: the kernel's own rate). Prints GFLOP/s beside the fp32 1024^3 matmul
rate. This is what ``GGUF_MATMUL_MAX_ROWS`` in model/llama.py rests on. Run it alone: two heavy
jobs on a small machine distort every figure.

    python scripts/gguf_matmul_crossover.py [--rows 1,4,8,16,64,256,512,2048] [--out docs/figures/gguf_matmul.md]
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,4,8,16,32,64,128,256,512,2048")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", help="also write the table here, as markdown with the command and the machine")
    a = ap.parse_args(argv)
    from minipaged.attention import cpu_kernels
    from minipaged.bench.hardware import _best as best  # warm-up run, then the best of `repeats`
    from minipaged.bench.hardware import gemm_gflops
    from minipaged.model import load_model
    from minipaged.model.llama import GGUF_MATMUL_MAX_ROWS

    why = cpu_kernels.qmatmul_why_not()
    if why:
        print(f"the GGUF matmul does not run here: {why}", file=sys.stderr)
        return 1
    model, _ = load_model(None)
    layers = [m for m in model.linears() if m.blocks is not None]
    flops_per_row = 2 * sum(m.weight.numel() for m in layers)
    body = [m for m in layers if m is not model.lm_head]
    if len(body) != len(layers) - 1:
        print("the LM head keeps no GGUF blocks: this table needs the default model's", file=sys.stderr)
        return 1
    gemm = gemm_gflops()
    lines = [f"{len(layers)} linear layers with GGUF blocks ({', '.join(model.gguf_blocks_info()['kinds'])}); "
             f"fp32 1024^3 matmul: {gemm:.0f} GFLOP/s; GGUF_MATMUL_MAX_ROWS = {GGUF_MATMUL_MAX_ROWS}", "",
             "| rows | GGUF matmul, whole step | MKL on fp32, whole step | GGUF / MKL | GGUF / MKL, body only "
             "| GGUF, one layer in a loop |",
             "|---|---|---|---|---|---|"]
    for line in lines:
        print(line)
    up = model.layers[0].mlp.up_proj
    with torch.inference_mode():
        for m in (int(r) for r in a.rows.split(",")):
            xs = {k: torch.randn(m, k) for k in {lin.in_features for lin in layers}}
            # the body (a prefill's matmuls: there the head runs on the last rows only) and the head,
            # each timed once; a whole step is the two
            qb = best(lambda: [cpu_kernels.qmatmul(xs[lin.in_features], lin.blocks) for lin in body], a.repeats)
            fb = best(lambda: [F.linear(xs[lin.in_features], lin.weight) for lin in body], a.repeats)
            hx = xs[model.lm_head.in_features]
            q = qb + best(lambda: cpu_kernels.qmatmul(hx, model.lm_head.blocks), a.repeats)
            f = fb + best(lambda: F.linear(hx, model.lm_head.weight), a.repeats)
            x = xs[up.in_features]
            loops = max(1, 2000 // m)
            one = best(lambda: [cpu_kernels.qmatmul(x, up.blocks) for _ in range(loops)], a.repeats) / loops
            rate = lambda s, n=flops_per_row: n * m / s / 1e9  # noqa: E731
            lines.append(f"| {m} | {rate(q):.0f} GFLOP/s ({q * 1e3:.1f} ms, {rate(q) / gemm:.0%}) "
                         f"| {rate(f):.0f} GFLOP/s ({f * 1e3:.1f} ms, {rate(f) / gemm:.0%}) | {f / q:.2f}x "
                         f"| {fb / qb:.2f}x ({qb * 1e3:.1f} vs {fb * 1e3:.1f} ms) "
                         f"| {2 * up.weight.numel() * m / one / 1e9:.0f} GFLOP/s "
                         f"({2 * up.weight.numel() * m / one / 1e9 / gemm:.0%}) |")
            print(lines[-1], flush=True)
    if a.out:
        import platform

        head = ["# The GGUF matmul against MKL on the fp32 copies", "",
                f"Command: `python scripts/gguf_matmul_crossover.py --out {a.out}` on {os.cpu_count()} CPU cores "
                f"({platform.machine()}), torch {torch.__version__}, {torch.get_num_threads()} threads. A whole step: "
                "every linear layer of the default model in turn and the LM head, x (rows, in) @ W^T; body only: "
                "the same without the LM head (a prefill's matmuls: there the head runs only on each sequence's last "
                "row); one layer in a "
                "loop: layer 0's MLP up-projection again and again (its weights stay in cache). Percentages are of "
                "the 1024^3 fp32 matmul rate measured in the same run.", ""]
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text("\n".join(head + lines) + "\n")
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
