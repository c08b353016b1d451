#!/usr/bin/env bash
# Measure one `minipaged serve` with three load generators on the same load, streaming (their
# default mode; guidellm also not streamed): `minipaged bench serve`, the vLLM project's guidellm and NVIDIA's aiperf. All
# three send /v1/completions with IN prompt tokens and exactly OUT output tokens (ignore_eos),
# N requests at RATE per second, constant arrivals. The tools pull large dependencies (guidellm
# brings torch, ~6 GB; aiperf ~1 GB), so each is installed once in its own venv under $TOOLS
# (default build/bench-tools) and this script is not part of `make test`. Writes
# $WORK/out/{minipaged,guidellm,guidellm_not_streamed,aiperf}.txt (+ their JSON) and a summary of request throughput
# and TTFT p50 per tool (summary.txt) for docs/serving.md's table.
#
#   scripts/compare_bench_tools.sh                        # the default model, 32 requests at 1 req/s
#   N=64 RATE=4 IN=128 OUT=64 scripts/compare_bench_tools.sh
#   TOOLS=/tmp/bench-tools scripts/compare_bench_tools.sh # venvs somewhere with room
#   PIN=0 scripts/compare_bench_tools.sh                  # server and tools share every CPU
#
# PIN=1 (the default where taskset exists and there are 2+ CPUs): the server runs on CPU 0 with
# one thread and every load generator on the other CPUs, so a tool's own work (guidellm and
# aiperf start several processes) never slows the server it measures: all three see one server.
#
# Checked with guidellm 0.8.1 (its `guidellm run --backend kind=...` command line; older
# releases had `guidellm benchmark --target ...` instead) and aiperf 0.13.0, on Python 3.11;
# pin them with GUIDELLM_SPEC=guidellm==0.8.1 AIPERF_SPEC=aiperf==0.13.0 if a later release moves.
# Both ran unchanged against `minipaged serve` (streaming, continuous_usage_stats, ignore_eos,
# max_tokens / max_completion_tokens): 0 errors. The committed run (the defaults, the server pinned
# to one core, ~6 minutes with the tools' start-up) is docs/figures/bench_tools.txt: every tool
# within 10% of `minipaged bench serve` on request throughput and TTFT p50. Unpinned, on 2 busy
# cores, TTFT does not settle: each tool's own processes take CPU from the server it measures.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
N=${N:-32}; RATE=${RATE:-1}; IN=${IN:-128}; OUT=${OUT:-64}; PORT=${PORT:-8765}
NCPU=$(nproc 2>/dev/null || echo 1)
ON_SERVER=(); ON_TOOLS=()
if [ "${PIN:-1}" = 1 ] && command -v taskset >/dev/null && [ "$NCPU" -ge 2 ]; then
  ON_SERVER=(env OMP_NUM_THREADS=1 taskset -c 0); ON_TOOLS=(taskset -c "1-$((NCPU - 1))")
fi
WORK=${WORK:-build/bench-tools}; TOOLS=${TOOLS:-$WORK}
mkdir -p "$WORK/out" "$TOOLS"
WORK=$(cd "$WORK" && pwd); TOOLS=$(cd "$TOOLS" && pwd)  # absolute: the tools run with paths of their own
URL="http://127.0.0.1:$PORT"

tool_venv() {  # tool_venv NAME PACKAGE [FIRST]: a venv with PACKAGE (FIRST installed before it), made once
  if [ ! -x "$TOOLS/$1/bin/$1" ]; then
    python3 -m venv "$TOOLS/$1"
    if [ -n "${3:-}" ]; then "$TOOLS/$1/bin/pip" install -q "$3"; fi
    "$TOOLS/$1/bin/pip" install -q "$2"
  fi
}
# guidellm asks for torch: the CPU build first (TORCH_SPEC, as the Makefile), so pip keeps it
# instead of pulling a multi-GB CUDA build.
tool_venv guidellm "${GUIDELLM_SPEC:-guidellm}" "${TORCH_SPEC:-torch==2.13.0}"
tool_venv aiperf "${AIPERF_SPEC:-aiperf}"

# The tokenizer both tools count tokens with: the served model's, written out as a folder
# (they would otherwise fetch it from the Hub).
TOK="$WORK/tokenizer"
if [ ! -f "$TOK/tokenizer.json" ]; then
  "$PY" - "$TOK" <<'PYEOF'
import sys
from transformers import AutoTokenizer
from minipaged.model import default_model_path
p = default_model_path()
AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name).save_pretrained(sys.argv[1])
PYEOF
fi

"${ON_SERVER[@]}" "$PY" -m minipaged serve --port "$PORT" --seed 0 \
  --served-model-name smollm2 > "$WORK/out/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 300); do curl -sf "$URL/health" >/dev/null && break; sleep 1; done
curl -sf "$URL/health" >/dev/null || { echo "the server did not come up: see $WORK/out/server.log"; exit 1; }

# Each tool gets a fresh server state only in the sense that prompts differ: minipaged draws a fresh
# seed, guidellm and aiperf make their own synthetic text, so no run hits another's prefix cache.
"${ON_TOOLS[@]}" "$PY" -m minipaged bench serve --url "$URL/v1" --model smollm2 --dataset fixed --input-len "$IN" --output-len "$OUT" \
  --num-requests "$N" --rate "$RATE" --arrival constant --no-progress --json "$WORK/out/minipaged.json" \
  | tee "$WORK/out/minipaged.txt" || echo "minipaged bench serve failed (exit $?): see its output above"

guidellm() {  # guidellm OUTNAME STREAM: one guidellm run of the load, streamed or not
  "${ON_TOOLS[@]}" "$TOOLS/guidellm/bin/guidellm" run \
    --backend "kind=openai_http,target=$URL,model=smollm2,request_format=/v1/completions,stream=$2" \
    --profile "kind=constant,rate=$RATE" --constraint "kind=max_requests,count=$N" \
    --data "kind=synthetic_text,prompt_tokens=$IN,output_tokens=$OUT" --tokenizer "kind=hf_auto,model=$TOK" \
    --output "kind=json,path=$WORK/out/$1.json" --output kind=console --disable-progress \
    | tee "$WORK/out/$1.txt" || echo "guidellm ($1) failed (exit $?): see its output above"
}
guidellm guidellm true
guidellm guidellm_not_streamed false

"${ON_TOOLS[@]}" "$TOOLS/aiperf/bin/aiperf" profile --model smollm2 --url "$URL" --endpoint-type completions --streaming \
  --tokenizer "$TOK" --isl "$IN" --isl-stddev 0 --osl "$OUT" --osl-stddev 0 --extra-inputs ignore_eos:true \
  --request-count "$N" --request-rate "$RATE" --request-rate-mode constant --ui none \
  --artifact-dir "$WORK/out/aiperf" | tee "$WORK/out/aiperf.txt" || echo "aiperf failed (exit $?): see its output above"

# One line per tool: request throughput (req/s) and TTFT p50 (ms), read from each tool's own output.
SETTINGS="N=$N RATE=$RATE IN=$IN OUT=$OUT, server pinned: ${ON_SERVER[*]:-no}, $(nproc) CPUs, $(date -u +%Y-%m-%d)"
"$PY" - "$WORK/out" "$SETTINGS" <<'PYEOF' | tee "$WORK/out/summary.txt"
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
print(f"scripts/compare_bench_tools.sh: {sys.argv[2]}")

def read(name, get):
    try:
        return name, *get()
    except Exception as e:  # noqa: BLE001 - a tool failed, or its JSON schema moved: say so, keep the rest
        return name, None, f"unread ({type(e).__name__}: {e})"

def minipaged():
    m = json.loads((out / "minipaged.json").read_text())
    return m["request_throughput"], m["ttft_ms"]["p50"]

def guidellm(name="guidellm", ttft=True):  # guidellm 0.8: benchmarks[0].metrics.<metric>.successful.{mean,median}
    b = json.loads((out / f"{name}.json").read_text())["benchmarks"][0]["metrics"]
    thr = b["requests_per_second"]["successful"]["mean"]
    return thr, (b["time_to_first_token_ms"]["successful"]["median"] if ttft else "- (not streamed)")

def aiperf():  # aiperf 0.13: profile_export_aiperf.json, <metric>.{avg,p50}
    a = json.loads(next((out / "aiperf").rglob("profile_export_aiperf.json")).read_text())
    return a["request_throughput"]["avg"], a["time_to_first_token"]["p50"]

fmt = lambda v, p: f"{v:.{p}f}" if isinstance(v, (int, float)) else str(v)  # noqa: E731
rows = (read("minipaged bench serve", minipaged), read("guidellm", guidellm),
        read("guidellm, not streamed", lambda: guidellm("guidellm_not_streamed", ttft=False)), read("aiperf", aiperf))
_, thr0, ttft0 = rows[0]

def vs(v, ref):  # this tool's figure against minipaged bench serve's, as a signed difference
    ok = isinstance(v, (int, float)) and isinstance(ref, (int, float)) and ref
    return f"{v / ref - 1:+.1%}" if ok else "-"

print(f"{'tool':24} {'req/s':>8} {'vs bench':>9} {'TTFT p50 ms':>16} {'vs bench':>9}")
for name, thr, ttft in rows:
    print(f"{name:24} {fmt(thr, 3):>8} {vs(thr, thr0):>9} {fmt(ttft, 1):>16} {vs(ttft, ttft0):>9}")
PYEOF
echo "outputs in $WORK/out: compare request throughput and TTFT p50 (within 10% is agreement)"
