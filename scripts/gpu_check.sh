#!/usr/bin/env bash
# THE command to run when a GPU is available (issue 35). From the repository root:
#
#   bash scripts/gpu_check.sh [OUT_DIR]        # default OUT_DIR: $TMPDIR/minipaged-gpu-check
#
# In at most 8 minutes (each step has its own limit, and a step that would end past 8 minutes
# is skipped, saying so):
#   1. minipaged bench kernels             paged decode GB/s vs copy bandwidth, SDPA and flex (JSON + table)
#   2. the Triton kernel tests, bf16 included (they are skipped in the CPU interpreter)
#   3. every lesson with a GPU path (GPU_LESSONS below: 00 reports the device, 05 compiles and times
#      the kernel, 06 and 07 measure on the device the model is on, 12 speculates there) and the
#      solved workbook 05
#   4. LLM() on CUDA against the CPU path: greedy tokens, fp32 and bf16
# Then OUT_DIR/summary.json: the device, each step (ok, exit status, seconds, limit, log file),
# the total, and the kernel figures. tests/test_gpu_check.py checks that every lesson whose code
# takes a GPU branch is in GPU_LESSONS.
#
# Without a CUDA GPU it stops at once with exit status 2, says so and writes summary.json with
# "gpu": null; nothing is measured. Otherwise the exit status is the number of steps that failed.
set -u
cd "$(dirname "$0")/.."
OUT="${1:-${TMPDIR:-/tmp}/minipaged-gpu-check}"
mkdir -p "$OUT"
PY="${PYTHON:-python}"
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && PY=.venv/bin/python
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET  # the point is the compiled kernels

BUDGET_S=480
# lesson:limit in seconds (a lesson that branches on torch.cuda / HAVE_TRITON must be here: tests/test_gpu_check.py)
GPU_LESSONS="00_setup_and_tour:30 05_triton_kernel:45 06_continuous_batching:50 07_whole_engine:70 12_speculative_decoding:50"
STEPS="$OUT/steps.tsv"
: > "$STEPS"
summary() {  # summary GPU_NAME_OR_EMPTY
    "$PY" - "$OUT" "$1" "$BUDGET_S" <<'PYEOF'
import json, os, sys
out, gpu, budget = sys.argv[1], sys.argv[2] or None, int(sys.argv[3])
steps = {}
for line in open(os.path.join(out, "steps.tsv")):
    name, rc, seconds, limit, status = line.rstrip("\n").split("\t")
    steps[name] = {"ok": status == "ok", "status": status, "exit": int(rc), "seconds": int(seconds), "limit": int(limit),
                   "log": f"{name}.log"}
kernels = os.path.join(out, "kernels.json")
res = {"gpu": gpu, "budget_seconds": budget, "total_seconds": sum(s["seconds"] for s in steps.values()),
       "failed": [n for n, s in steps.items() if not s["ok"]], "steps": steps,
       "kernels": json.load(open(kernels)) if os.path.isfile(kernels) else None}
if gpu is None:
    res["reason"] = "no CUDA GPU visible to PyTorch (or no triton): nothing was measured"
json.dump(res, open(os.path.join(out, "summary.json"), "w"), indent=1)
print(f"gpu_check: summary in {os.path.join(out, 'summary.json')}")
PYEOF
}

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "gpu_check: no CUDA GPU is visible to PyTorch (torch.cuda.is_available() is False)." >&2
    summary ""
    echo "gpu_check: run this on a machine with an NVIDIA GPU and a CUDA build of torch; nothing was measured." >&2
    exit 2
fi
if ! "$PY" -c "import triton" 2>/dev/null; then
    echo "gpu_check: the triton package is missing: pip install triton (it ships with CUDA builds of torch)." >&2
    summary ""
    exit 2
fi

failed=0
T0=$(date +%s)
step() {  # step NAME SECONDS COMMAND...
    local name="$1" limit="$2"; shift 2
    local t=$(date +%s)
    if [ $(( t - T0 + limit )) -gt "$BUDGET_S" ]; then
        echo "== $name: SKIPPED (it could end past the ${BUDGET_S}s budget)"; failed=$((failed + 1))
        printf '%s\t%s\t%s\t%s\t%s\n' "$name" -1 0 "$limit" skipped >> "$STEPS"; return
    fi
    echo "== $name (limit ${limit}s)"
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$? status=ok
    tail -n 25 "$OUT/$name.log"
    if [ $rc -eq 0 ]; then echo "== $name: ok in $(( $(date +%s) - t ))s"
    else status=$([ $rc -eq 124 ] && echo timeout || echo failed)
         echo "== $name: FAILED (exit $rc$([ $rc -eq 124 ] && echo ', time limit'))"; failed=$((failed + 1)); fi
    printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - t ))" "$limit" "$status" >> "$STEPS"
}
lesson() {  # lesson NAME SECONDS: execute notebooks/NAME.ipynb on the GPU, stored under OUT
    step "lesson_$1" "$2" "$PY" -m jupyter nbconvert --to notebook --execute --ExecutePreprocessor.timeout=$(( $2 - 5 )) \
        "notebooks/$1.ipynb" --output-dir "$OUT" --output "lesson_$1_executed.ipynb"
}

"$PY" -c "import torch; p = torch.cuda.get_device_properties(0); print(f'device: {p.name}, {p.total_memory / 2**30:.0f} GiB, torch {torch.__version__}')"
GPU_NAME=$("$PY" -c "import torch; print(torch.cuda.get_device_name(0))")
step kernels 90 "$PY" -m minipaged.bench kernels --batch 1 64 --context 512 4096 --json "$OUT/kernels.json"
step kernel_tests 60 "$PY" -m pytest -q -x -p no:cacheprovider tests/test_triton_attention.py
for spec in $GPU_LESSONS; do lesson "${spec%%:*}" "${spec##*:}"; done
step workbook05 30 "$PY" -m jupyter nbconvert --to notebook --execute --ExecutePreprocessor.timeout=25 \
    solutions/05_triton_decode_kernel.ipynb --output-dir "$OUT" --output workbook05_executed.ipynb
step llm_cuda 45 "$PY" - "$OUT/llm_cuda.json" <<'EOF'
"""LLM() on CUDA (Triton attention) against the CPU path (PyTorch attention), greedy."""
import json, sys, time
import torch
from minipaged import LLM, SamplingParams

prompts = [[{"role": "user", "content": p}] for p in
           ("What is the capital of France?", "Write a short poem about autumn leaves.",
            "Explain recursion with a simple example.", "How do I reverse a list in Python?")]
params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
res = {}
cpu = LLM(device="cpu", attention="torch")
t = time.perf_counter(); ref = [o.token_ids for o in cpu.chat(prompts, params)]; res["cpu_fp32_s"] = time.perf_counter() - t
for dtype, need in ((torch.float32, 16), (torch.bfloat16, 4)):
    gpu = LLM(device="cuda", dtype=dtype, attention="auto")
    assert gpu.engine.backend.name == "triton", f"LLM() on CUDA chose {gpu.engine.backend.name!r}, not the Triton kernels"
    gpu.chat(prompts[:1], SamplingParams(max_tokens=4, temperature=0.0))  # compile the kernels first
    t = time.perf_counter(); got = [o.token_ids for o in gpu.chat(prompts, params)]; s = time.perf_counter() - t
    # equal greedy prefix: fp32 may part only where two logits tie to rounding, bf16 sooner
    prefix = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in zip(got, ref)]
    name = str(dtype).removeprefix("torch.")
    res[name] = {"seconds": s, "equal_prefix_tokens": prefix, "need_at_least": need}
    print(f"{name}: CUDA {s:.2f}s vs CPU fp32 {res['cpu_fp32_s']:.2f}s; tokens equal to the CPU path for the first {prefix} of 32")
    if min(prefix) < need:
        sys.exit(f"{name} on CUDA parts from the CPU path after {min(prefix)} tokens (need {need}): {got[0][:8]} vs {ref[0][:8]}")
    del gpu
    torch.cuda.empty_cache()
json.dump(res, open(sys.argv[1], "w"), indent=1)
EOF
echo "gpu_check: $failed step(s) failed, $(( $(date +%s) - T0 ))s in all; figures and logs in $OUT/"
summary "$GPU_NAME"
exit $failed
