#!/usr/bin/env bash
# Measure one `minipaged serve` with three load generators on the same load, in their default
# (streaming) modes: `minipaged bench serve`, vLLM's guidellm and NVIDIA's aiperf. They pull large
# dependencies, so they are installed here, each in its own venv under build/bench-tools, and
# this script is not part of `make test`. Writes build/bench-tools/out/{minipaged.json,guidellm*,aiperf/}
# and prints each tool's throughput and TTFT p50 for docs/serving.md's table.
#
#   scripts/compare_bench_tools.sh                 # the default model, 32 requests at 2 req/s
#   N=64 RATE=4 IN=128 OUT=64 scripts/compare_bench_tools.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
N=${N:-32}; RATE=${RATE:-2}; IN=${IN:-128}; OUT=${OUT:-64}; PORT=${PORT:-8765}
WORK=build/bench-tools; mkdir -p "$WORK/out"
URL="http://127.0.0.1:$PORT"

tool_venv() {  # tool_venv NAME PACKAGE: a venv with PACKAGE, made once
  if [ ! -x "$WORK/$1/bin/$1" ]; then
    python3 -m venv "$WORK/$1" && "$WORK/$1/bin/pip" install -q "$2"
  fi
}
tool_venv guidellm guidellm
tool_venv aiperf aiperf

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

"$PY" -m minipaged serve --port "$PORT" --seed 0 --served-model-name smollm2 > "$WORK/out/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 120); do curl -sf "$URL/health" >/dev/null && break; sleep 1; done

# the same load for each: N requests of IN prompt tokens and OUT output tokens, RATE per second
"$PY" -m minipaged bench serve --url "$URL/v1" --model smollm2 --dataset fixed --input-len "$IN" --output-len "$OUT" \
  --num-requests "$N" --rate "$RATE" --arrival constant --no-progress --json "$WORK/out/minipaged.json" | tee "$WORK/out/minipaged.txt"

"$WORK/guidellm/bin/guidellm" benchmark --target "$URL" --model smollm2 --processor "$TOK" \
  --data "prompt_tokens=$IN,output_tokens=$OUT" --rate-type constant --rate "$RATE" --max-requests "$N" \
  --output-path "$WORK/out/guidellm.json" | tee "$WORK/out/guidellm.txt"

"$WORK/aiperf/bin/aiperf" profile --model smollm2 --url "$URL" --endpoint-type completions --streaming \
  --tokenizer "$TOK" --synthetic-input-tokens-mean "$IN" --synthetic-input-tokens-stddev 0 \
  --output-tokens-mean "$OUT" --output-tokens-stddev 0 --request-count "$N" --request-rate "$RATE" \
  --artifact-dir "$WORK/out/aiperf" | tee "$WORK/out/aiperf.txt"

echo "outputs in $WORK/out: compare request throughput and TTFT p50 (within 10% is agreement)"
