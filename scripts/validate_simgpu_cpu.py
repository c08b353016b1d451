"""Check the simulated GPU's cost model where it can be measured: the real engine on this CPU.

The same StepCostModel the paper runner (``minipaged bench paper``) uses is given this machine's
measured read bandwidth and fp32 GEMM rate (minipaged.bench.hardware) and the default model's
shape (SmolLM2-135M, fp32 weights and KV: the plain route, ``LLM(fast_paths=False)``). Where a
roofline cannot know what this CPU's libraries do, the route's own operators are timed alone,
as Vidur profiles operators: the linear layers at every row count (``hardware.linear_profile``:
PyTorch's fp32 matmul is slower at 2-4 rows than at 8) and attention as the route runs it
(``hardware.attention_profile`` and ``attention_timer``: a padded gather and SDPA, several
passes over K and V). ``--no-profile`` prices both by the roofline alone. One calibration is
fitted on a few measured steps (per-step and per-sequence overheads from decode steps at two
batches, per-token from prefill steps); then it predicts what it was not fitted on, and each
prediction is compared with the measurement:

- the decode step time at the other batches (1..64);
- the throughput of a small offline workload (requests of mixed lengths, all at once), both
  replayed (the cost model on the engine's own steps) and simulated (minipaged's scheduler and
  block pool on the simulated clock, no model: what ``bench paper`` does on a GPU);
- the throughput of every cell of the README's factorial bench (``minipaged bench``: naive and
  {contiguous, paged} x {static, continuous}), run here on the plain route at the bench's
  ``--quick`` sizes, against the same workload and engine settings served by the simulator's
  reservation policies (contiguous: the longest request reserved from admission; static: no
  refill) on the same calibration (``--skip-factorial`` leaves it out).

The target is within 25% (issue 24). Every measurement is taken twice, early and late in the
run, and averaged; the spread between the two passes is reported as the machine's own drift.
The logic is minipaged/bench/gpu/validate.py.

Run on a quiet machine (other work on the cores shows up as error):

    python scripts/validate_simgpu_cpu.py            # about 12 minutes; writes docs/figures/simgpu_cpu_validation.json
    python scripts/validate_simgpu_cpu.py --quick    # a minute or two, a smoke run: writes nothing unless --json

Exit status: 0 within the target, 1 outside it.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_JSON = ROOT / "docs" / "figures" / "simgpu_cpu_validation.json"

FULL = {"calibration_batches": [1, 64], "validation_batches": [2, 4, 8, 16, 32], "prompt_len": 64, "decode_steps": 12,
        "prefill_tokens": [256, 512], "prefill_repeats": 3, "workload": 32, "workload_prompt": (16, 192),
        "workload_output": (16, 96), "bandwidth_mib": 256, "gemm_repeats": 8,
        # the factorial bench at its own --quick sizes (serving.QUICK: 32 ShareGPT-like requests, a KV budget of
        # 16 contiguous reservations, naive on 4 of them); roofline batches: the bench's machine table, unused here
        "factorial": {"quick": True}, "factorial_roofline_batches": (1, 16),
        # the linear layers timed on the model's own weights at these row counts (hardware.linear_profile)
        "profile_rows": (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 20, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024),
        "profile_repeats": 5,
        # decode attention timed as the engine's own backend runs it (hardware.attention_profile)
        "attention_batches": (1, 2, 4, 8, 16, 32, 64), "attention_contexts": (32, 64, 128, 256, 512, 1024)}
QUICK = {"calibration_batches": [1, 8], "validation_batches": [4, 16], "prompt_len": 16, "decode_steps": 4,
         "prefill_tokens": [256], "prefill_repeats": 1, "workload": 8, "workload_prompt": (8, 48),
         "workload_output": (4, 16), "bandwidth_mib": 64, "gemm_repeats": 3,
         "factorial": {"quick": True, "num_requests": 8, "static_batch": 4, "max_output": 32, "naive_requests": 2,
                       "prompt_scale": 0.5},
         "factorial_roofline_batches": (1,), "profile_rows": (1, 2, 4, 8, 16, 64, 256), "profile_repeats": 1,
         "attention_batches": (1, 4, 16), "attention_contexts": (32, 128, 512)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="small sizes: checks that it runs end to end (a minute or two on quiet cores)")
    ap.add_argument("--json", type=Path, default=None,
                    help=f"where to write the result (default: {DEFAULT_JSON.relative_to(ROOT)} for a full run; "
                         "a --quick run writes only where this says)")
    ap.add_argument("--model", default=None, help="a model path (default: the course's SmolLM2-135M)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-profile", action="store_true",
                    help="price the linear layers and decode attention by the roofline alone (one GEMM rate, one "
                         "bandwidth) instead of their measured times (profiles): how far a pure roofline gets")
    ap.add_argument("--skip-factorial", action="store_true",
                    help="leave out the factorial bench (minipaged bench's cells, measured and predicted)")
    a = ap.parse_args(argv)
    s = QUICK if a.quick else FULL
    out_path = a.json if a.json is not None else (None if a.quick else DEFAULT_JSON)

    import torch

    from minipaged import LLM
    from minipaged.bench.gpu import validate as v
    from minipaged.bench.hardware import attention_profile, attention_timer, bandwidth, gemm_gflops, linear_profile

    t0 = time.perf_counter()
    bw = bandwidth(mib=s["bandwidth_mib"], repeats=5 if not a.quick else 3)["read_GBps"] * 1e9
    fl = gemm_gflops(repeats=s["gemm_repeats"]) * 1e9
    machine = v.machine_spec(bw, fl)
    print(f"measured: read {bw / 1e9:.1f} GB/s, fp32 GEMM {fl / 1e9:.0f} GFLOP/s "
          f"({torch.get_num_threads()} threads, {os.cpu_count()} CPUs)", flush=True)

    shape = v.engine_shape()
    llm = LLM(a.model, fast_paths=False, record_trace=False, **shape)  # the plain route
    eng = llm.engine
    model = v.model_spec_of(eng.model, name="smollm2-135m (fp32)" if a.model is None else None)
    print(f"engine: {model.name}, {model.num_params / 1e6:.1f}M matrix parameters, plain route; ready after "
          f"{time.perf_counter() - t0:.0f} s", flush=True)

    c = eng.model.config

    def profiles() -> tuple[dict, dict]:
        t1 = time.perf_counter()
        lp = linear_profile(eng.model, rows=s["profile_rows"], repeats=s["profile_repeats"])
        ap = attention_profile(eng.backend, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, shape["block_size"],
                               batches=s["attention_batches"], contexts=s["attention_contexts"],
                               repeats=s["profile_repeats"])
        print(f"profiles in {time.perf_counter() - t1:.0f} s: linear body at "
              + ", ".join(f"{r}: {b * 1e3:.1f}" for r, b in zip(lp["rows"], lp["body_s"]) if r in (1, 2, 4, 8, 16, 64))
              + f" rows (ms); {ap['backend']} decode attention, batch {ap['batches'][-1]} at {ap['contexts'][-1]} keys "
              f"{ap['seconds'][-1][-1] * 1e3:.1f} ms a step", flush=True)
        return lp, ap

    batches = [(b, "calibration") for b in s["calibration_batches"]] + [(b, "validation") for b in s["validation_batches"]]

    def decode_pass(order: list) -> dict:
        got = {}
        for b, role in order:
            got[b] = v.measure_decode(eng, b, s["prompt_len"], s["decode_steps"], seed=a.seed + b)
            print(f"  decode batch {b:>3} ({role}): {got[b].seconds * 1e3:8.2f} ms per step", flush=True)
        return got

    # Two passes of each measurement, one early and one late (the decodes' second in reverse order), averaged:
    # a slow spell of this machine (they last seconds to minutes) then weighs on both sides alike, and the
    # spread between the passes is reported as what the machine itself drifted.
    lp1, ap1 = profiles()
    v.measure_decode(eng, 2, s["prompt_len"], 2, seed=99)  # warm-up: first-touch, lazy init
    dec1 = decode_pass(batches)

    def factorial_pass(k: int) -> tuple | None:
        if a.skip_factorial:
            return None
        t1 = time.perf_counter()
        setup, bench = v.measure_factorial(eng.model, s["factorial"], seed=a.seed,
                                           roofline_batches=s["factorial_roofline_batches"])
        cells = v.measured_cells(bench)
        print(f"  factorial bench, pass {k}: {len(setup.requests)} requests, "
              + ", ".join(f"{c} {m['tokens_per_s']:.1f}" for c, m in cells.items())
              + f" tok/s in {time.perf_counter() - t1:.0f} s", flush=True)
        return setup, cells

    fac1 = factorial_pass(1)
    cal_pre = []
    for n in s["prefill_tokens"]:
        smp = v.measure_prefill(eng, n, repeats=s["prefill_repeats"], seed=a.seed + n)
        cal_pre.append(smp)
        print(f"  prefill {n:>4} tokens (calibration): {smp.seconds * 1e3:8.2f} ms", flush=True)
    reqs = v.workload(s["workload"], s["workload_prompt"], s["workload_output"], seed=a.seed)
    measured, samples = v.measure_workload(eng, reqs, seed=a.seed)
    print(f"  workload: {len(reqs)} requests in {measured['seconds']:.2f} s, {measured['steps']} steps", flush=True)

    fac2 = factorial_pass(2)
    factorial = None if fac1 is None else (fac1[0], v.mean_cells(fac1[1], fac2[1]))
    dec2 = decode_pass(batches[::-1])
    lp2, ap2 = profiles()
    dec = {b: v.mean_sample(dec1[b], dec2[b]) for b, _ in batches}
    cal_dec = [dec[b] for b in s["calibration_batches"]]
    val_dec = [dec[b] for b in s["validation_batches"]]
    lp, ap = v.mean_profile(lp1, lp2, ("body_s", "head_s")), v.mean_profile(ap1, ap2, ("seconds",))
    profile = v.LinearProfile(lp["rows"], lp["body_s"], lp["head_s"],
                              source=f"hardware.linear_profile on the served model's weights, median of "
                                     f"{lp['repeats']}, the mean of two passes, {lp['threads']} threads")
    timer = attention_timer(eng.backend, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, shape["block_size"])
    attention = v.AttentionProfile(ap["batches"], ap["contexts"], ap["seconds"], groups=v.route_decode_groups(eng.backend),
                                   source=f"decodes: hardware.attention_profile of the {ap['backend']} backend, "
                                          f"{ap['layers']} layers a step, median of {ap['repeats']}, the mean of two "
                                          f"passes; prefills: hardware.attention_timer, each step's shape timed once",
                                   prefill=timer)
    drift = {"decode": max(abs(v.error(dec1[b].seconds, dec2[b].seconds)) for b, _ in batches),
             "linear_profile": max(abs(v.error(x, y)) for x, y in zip(lp1["body_s"] + lp1["head_s"],
                                                                      lp2["body_s"] + lp2["head_s"])),
             "attention_profile": max(abs(v.error(x, y)) for r1, r2 in zip(ap1["seconds"], ap2["seconds"])
                                      for x, y in zip(r1, r2))}
    if factorial is not None:
        drift["factorial"] = max(abs(v.error(*c["passes_tokens_per_s"])) for c in factorial[1].values())
    print("drift between the two passes (the machine's own): " + ", ".join(f"{k} up to {x:.0%}" for k, x in drift.items()),
          flush=True)

    res = v.compare(machine, model, cal_dec, cal_pre, val_dec, reqs, measured, samples, shape, factorial=factorial,
                    profile=None if a.no_profile else profile, attention=None if a.no_profile else attention)
    cmd = " ".join(["python scripts/validate_simgpu_cpu.py"] + (["--quick"] if a.quick else [])
                   + (["--skip-factorial"] if a.skip_factorial else []) + (["--no-profile"] if a.no_profile else []))
    res["settings"] = {**s, "quick": a.quick, "seed": a.seed, "engine": shape, "fast_paths": False,
                       "threads": torch.get_num_threads(), "cpus": os.cpu_count(), "machine": platform.machine(),
                       "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
                       "torch": torch.__version__, "seconds": round(time.perf_counter() - t0, 1),
                       "skip_factorial": a.skip_factorial, "no_profile": a.no_profile, "command": cmd}
    res["drift_between_passes"] = drift
    if res.get("attention_profile"):
        res["attention_profile"]["prefill_shapes_timed"] = len(timer.timed)
    print(v.format_report(res))
    if out_path is not None:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(res, indent=1) + "\n")
        print(f"wrote {out_path}")
    return 0 if res["within_target"] else 1


if __name__ == "__main__":
    sys.exit(main())
