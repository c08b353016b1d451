#!/usr/bin/env bash
# The GPU checks of issue 15, in one run of at most 8 minutes, run from the repository root:
#
#   bash scripts/gpu_check.sh [OUT_DIR]        # default OUT_DIR: $TMPDIR/minipaged-gpu-check
#
#   1. python -m minipaged.bench kernels   paged decode GB/s vs copy bandwidth, SDPA and flex (JSON + table)
#   2. the Triton kernel tests, bf16 included (they are skipped in the CPU interpreter)
#   3. lesson 05 (its speed cell runs the compiled kernel on the GPU) and the solved workbook 05
#   4. lessons 06 and 07 (their measurements and lesson 07's roofline, on the device the model is on)
#   5. LLM() on CUDA against the CPU path: greedy tokens, fp32 and bf16
#
# Without a CUDA GPU it stops at once with exit status 2 and says so; nothing is measured.
# Each step has its own time limit, so one slow step cannot eat the others' time. The exit
# status is the number of steps that failed (0: all passed). Figures go to OUT_DIR.
set -u
cd "$(dirname "$0")/.."
OUT="${1:-${TMPDIR:-/tmp}/minipaged-gpu-check}"
mkdir -p "$OUT"
PY="${PYTHON:-python}"
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && PY=.venv/bin/python
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET  # the point is the compiled kernels

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "gpu_check: no CUDA GPU is visible to PyTorch (torch.cuda.is_available() is False)." >&2
    echo "gpu_check: run this on a machine with an NVIDIA GPU and a CUDA build of torch; nothing was measured." >&2
    exit 2
fi
if ! "$PY" -c "import triton" 2>/dev/null; then
    echo "gpu_check: the triton package is missing: pip install triton (it ships with CUDA builds of torch)." >&2
    exit 2
fi

failed=0
T0=$(date +%s)
step() {  # step NAME SECONDS COMMAND...
    local name="$1" limit="$2"; shift 2
    local t=$(date +%s)
    echo "== $name (limit ${limit}s)"
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    tail -n 25 "$OUT/$name.log"
    if [ $rc -eq 0 ]; then echo "== $name: ok in $(( $(date +%s) - t ))s"
    else echo "== $name: FAILED (exit $rc$([ $rc -eq 124 ] && echo ', time limit'))"; failed=$((failed + 1)); fi
}

"$PY" -c "import torch; p = torch.cuda.get_device_properties(0); print(f'device: {p.name}, {p.total_memory / 2**30:.0f} GiB, torch {torch.__version__}')"
step kernels 120 "$PY" -m minipaged.bench kernels --batch 1 64 --context 512 4096 --json "$OUT/kernels.json"
step kernel_tests 80 "$PY" -m pytest -q -x tests/test_triton_attention.py
step lesson05 45 "$PY" -m jupyter nbconvert --to notebook --execute --ExecutePreprocessor.timeout=40 \
    notebooks/05_triton_kernel.ipynb --output-dir "$OUT" --output lesson05_executed.ipynb
step workbook05 40 "$PY" -m jupyter nbconvert --to notebook --execute --ExecutePreprocessor.timeout=35 \
    solutions/05_triton_decode_kernel.ipynb --output-dir "$OUT" --output workbook05_executed.ipynb
step lesson06 60 "$PY" -m jupyter nbconvert --to notebook --execute --ExecutePreprocessor.timeout=55 \
    notebooks/06_continuous_batching.ipynb --output-dir "$OUT" --output lesson06_executed.ipynb
step lesson07 90 "$PY" -m jupyter nbconvert --to notebook --execute --ExecutePreprocessor.timeout=85 \
    notebooks/07_whole_engine.ipynb --output-dir "$OUT" --output lesson07_executed.ipynb
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
exit $failed
