"""Where the GGUF matmul beats MKL on the fp32 copies, and how close each gets to the GEMM rate.

Times one decode step's worth of matmuls (every linear layer of the default model in turn, and
the LM head) at each batch size M, two ways: ``minipaged.cpu.kernels.qmatmul`` on the file's GGUF blocks,
and PyTorch's ``F.linear`` (MKL) on the fp32 weights; and one layer's MLP up-projection in a loop
(its weights stay in cache: the kernel's own rate). Prints GFLOP/s beside the fp32 1024^3 matmul
rate. This is what the executor's plan rests on when it lets the GGUF matmul serve every batch
(``EngineConfig.gguf_blocks``; minipaged/plan.py). Run it alone: two heavy jobs on a
small machine distort every figure.

    python scripts/gguf_matmul_crossover.py [--rows 1,4,8,16,64,256,512,2048] [--out docs/figures/gguf_matmul.md]

Without AVX-512 only the portable loop is built (the plan refuses it unless gguf_blocks=True);
``--allow-portable`` times it anyway.
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
    ap.add_argument("--allow-portable", action="store_true",
                    help="time the portable loop where there is no AVX-512 (exact, far slower)")
    a = ap.parse_args(argv)
    from minipaged.bench.hardware import _best as best  # warm-up run, then the best of `repeats`
    from minipaged.bench.hardware import gemm_gflops
    from minipaged.cpu import build, kernels
    from minipaged.cpu.gguf_blocks import read_blocks
    from minipaged.model import load_model

    if build.library() is None:
        print(f"the GGUF matmul does not run here: the CPU kernels could not be built: {build.info()['why_not']}",
              file=sys.stderr)
        return 1
    if not kernels.qmatmul_fast() and not a.allow_portable:
        print("the GGUF matmul does not run here: this CPU (or compiler) has no AVX-512, which the fast kernel is "
              "written for (--allow-portable times the portable loop anyway)", file=sys.stderr)
        return 1
    model, _ = load_model(None)
    by_name = read_blocks(model.source.path, model.config)  # what an engine's executor multiplies from
    names = {"lm_head.weight": model.lm_head}
    names.update({f"model.{n}.weight": m for n, m in model.named_modules()
                  if isinstance(m, torch.nn.Linear) and m is not model.lm_head})
    blocks = {m: by_name[n] for n, m in names.items() if n in by_name}
    layers = list(blocks)
    flops_per_row = 2 * sum(m.weight.numel() for m in layers)
    body = [m for m in layers if m is not model.lm_head]
    if len(body) != len(layers) - 1:
        print("the LM head has no GGUF blocks: this table needs the default model's", file=sys.stderr)
        return 1
    gemm = gemm_gflops()
    kinds = sorted({b.kind for b in blocks.values()})
    lines = [f"{len(layers)} linear layers with GGUF blocks ({', '.join(kinds)}); "
             f"fp32 1024^3 matmul: {gemm:.0f} GFLOP/s; GGUF matmul: "
             f"{build.gguf_matmul_kernel()}", "",
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
            qb = best(lambda: [kernels.qmatmul(xs[lin.in_features], blocks[lin]) for lin in body], a.repeats)
            fb = best(lambda: [F.linear(xs[lin.in_features], lin.weight) for lin in body], a.repeats)
            hx = xs[model.lm_head.in_features]
            q = qb + best(lambda: kernels.qmatmul(hx, blocks[model.lm_head]), a.repeats)
            f = fb + best(lambda: F.linear(hx, model.lm_head.weight), a.repeats)
            x = xs[up.in_features]
            loops = max(1, 2000 // m)
            one = best(lambda: [kernels.qmatmul(x, blocks[up]) for _ in range(loops)], a.repeats) / loops
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
