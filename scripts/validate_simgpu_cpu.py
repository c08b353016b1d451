"""Check the simulated GPU's step-time model where it can be measured: on this machine's CPU.

Measures this machine's read bandwidth and fp32 GEMM rate (minipaged.bench.hardware), gives
them to the same StepCostModel the paper runner uses (SmolLM2-135M, fp32 weights and KV,
efficiencies 1.0: the measured rates are already what this machine reaches), plus a per-step
overhead measured once (the batch-1 step minus its roofline), then compares its prediction
with the engine's measured decode step time on the plain route at batches 1..64:

    step(B) = (time to generate 1 + K tokens - time to generate 1 token) / K, B prompts at once

Run: ``python scripts/validate_simgpu_cpu.py [--json docs/figures/paper_cpu_validation.json]``.
The plain route is ``LLM(fast_paths=False)`` where EngineConfig has that field, else
``gguf_blocks=False, packed_gemm=False``.
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import fields
from pathlib import Path


def plain_route_kwargs() -> dict:
    from minipaged.config import EngineConfig

    names = {f.name for f in fields(EngineConfig)}
    if "fast_paths" in names:
        return {"fast_paths": False}
    return {k: False for k in ("gguf_blocks", "packed_gemm") if k in names}


def measure_step(llm, batch: int, prompt_len: int, k: int) -> float:
    from minipaged import SamplingParams

    prompts = [{"prompt_token_ids": [1 + (i + j) % 500 for j in range(prompt_len)]} for i in range(batch)]

    def gen(n: int) -> float:
        t = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        return time.perf_counter() - t

    gen(2)  # warm up
    return (min(gen(1 + k) for _ in range(2)) - min(gen(1) for _ in range(2))) / k


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,2,4,8,16,32,64")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=16, help="decode steps timed per batch")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)

    import torch

    from minipaged import LLM
    from minipaged.bench.gpu.cost import Calibration, StepCostModel
    from minipaged.bench.hardware import bandwidth, gemm_gflops

    bw = bandwidth()["read_GBps"] * 1e9
    fl = gemm_gflops() * 1e9
    kw = plain_route_kwargs()
    llm = LLM(max_num_seqs=64, **kw)
    batches = [int(b) for b in a.batches.split(",")]
    measured = {}
    for b in batches:  # printed as it goes: on a loaded machine the large batches take minutes
        measured[b] = measure_step(llm, b, a.prompt_len, a.tokens)
        print(f"measured batch {b}: {measured[b] * 1e3:.2f} ms per decode step", flush=True)
    ctx = a.prompt_len + a.tokens // 2
    roof = StepCostModel("a100-40gb", "smollm2-135m", Calibration(1.0, 1.0, 0.0, 0.0), bandwidth=bw, peak_flops=fl,
                         dtype_bytes=4)
    overhead = max(0.0, measured[batches[0]] - roof.decode_time(batches[0], ctx))
    model = StepCostModel("a100-40gb", "smollm2-135m", Calibration(1.0, 1.0, overhead, 0.0), bandwidth=bw,
                          peak_flops=fl, dtype_bytes=4)
    rows = []
    print(f"CPU: read {bw / 1e9:.1f} GB/s, fp32 GEMM {fl / 1e9:.0f} GFLOP/s, threads {torch.get_num_threads()}; "
          f"plain route: {kw}; per-step overhead (from batch {batches[0]}): {overhead * 1e3:.2f} ms")
    print(f"{'batch':>5} {'measured ms':>12} {'predicted ms':>13} {'error':>7}")
    for b in batches:
        p = model.decode_time(b, ctx)
        err = p / measured[b] - 1
        rows.append({"batch": b, "measured_s": measured[b], "predicted_s": p, "error": err})
        print(f"{b:>5} {measured[b] * 1e3:>12.2f} {p * 1e3:>13.2f} {err:>+7.0%}")
    worst = max(abs(r["error"]) for r in rows)
    print(f"worst error {worst:.0%} ({'within' if worst <= 0.25 else 'outside'} 25%)")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"bandwidth_Bps": bw, "gemm_flops": fl, "plain_route": kw, "overhead_s": overhead,
                                      "rows": rows, "worst_error": worst}, indent=1))
    return 0 if worst <= 0.25 else 1


if __name__ == "__main__":
    raise SystemExit(main())
