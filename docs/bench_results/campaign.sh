#!/usr/bin/env bash
# The runs behind docs/benchmarks.md: `tokenmill bench serve` against the embedded SmolLM2 at
# concurrency 1, 4 and 16 on the random and shared-prefix datasets, a fresh server for every run
# (so no run finds another's prompts in the prefix cache, and /v1/diagnostics covers that run only),
# then `tokenmill bench latency` and `tokenmill bench throughput`. Run from anywhere:
#     bash docs/bench_results/campaign.sh            # about 15 minutes on the 2-core machine
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=docs/bench_results
PY=${PY:-.venv/bin/python}
PORT=${PORT:-8765}
URL=http://127.0.0.1:$PORT
GGUF=$($PY -c 'from tokenmill.model.default import default_model_path; print(default_model_path())')
ENGINE=(--max-model-len 2048 --kv-cache-memory-bytes 1G)
# One OpenMP thread: the machine is shared, and two spinning OpenMP threads on two busy cores make
# every GEMM wait for the slower one (20x slower steps in our measurements); the bench client gets
# the other core.
export OMP_NUM_THREADS=1

serve_bench() {  # NAME BENCH-FLAGS...
  local name=$1; shift
  $PY -m tokenmill serve "${ENGINE[@]}" --port "$PORT" --disable-uvicorn-access-log >"/tmp/tokenmill-$name.log" 2>&1 &
  local pid=$!
  until curl -sf "$URL/health" >/dev/null; do
    kill -0 "$pid" || { cat "/tmp/tokenmill-$name.log"; exit 1; }
    sleep 0.5
  done
  { echo "# load before the run: $(uptime)"; } >"$OUT/$name.txt"
  $PY -m tokenmill bench serve --base-url "$URL" --tokenizer "$GGUF" --goodput ttft:3000 tpot:150 \
    --cost-per-hour 0.10 --disable-tqdm --result-json "$OUT/$name.json" --report-html "$OUT/$name.html" \
    "$@" >>"$OUT/$name.txt"
  curl -sf "$URL/v1/diagnostics" | $PY -m json.tool >"$OUT/$name.diagnostics.json"
  kill "$pid"
  wait "$pid" || true
}

RANDOM_FLAGS=(--dataset random --random-input-len 256 --random-output-len 64)
SHARED_FLAGS=(--dataset shared-prefix --shared-prefix-num-prefixes 4 --shared-prefix-prefix-len 512
              --shared-prefix-suffix-len 32 --shared-prefix-output-len 64)
serve_bench random-c1 "${RANDOM_FLAGS[@]}" --num-prompts 8 --max-concurrency 1
serve_bench random-c4 "${RANDOM_FLAGS[@]}" --num-prompts 32 --max-concurrency 4
serve_bench random-c16 "${RANDOM_FLAGS[@]}" --num-prompts 32 --max-concurrency 16
serve_bench shared-prefix-c1 "${SHARED_FLAGS[@]}" --num-prompts 8 --max-concurrency 1
serve_bench shared-prefix-c4 "${SHARED_FLAGS[@]}" --num-prompts 32 --max-concurrency 4
serve_bench shared-prefix-c16 "${SHARED_FLAGS[@]}" --num-prompts 32 --max-concurrency 16

{ echo "# load before the run: $(uptime)"
  $PY -m tokenmill bench latency "${ENGINE[@]}" --input-len 256 --output-len 64 --num-iters 3 \
    --output-json "$OUT/latency.json"; } >"$OUT/latency.txt" 2>&1
{ echo "# load before the run: $(uptime)"
  $PY -m tokenmill bench throughput "${ENGINE[@]}" --num-prompts 32 --input-len 256 --output-len 64 -q \
    --output-json "$OUT/throughput.json"; } >"$OUT/throughput.txt" 2>&1
$PY -m tokenmill bench compare "$OUT/random-c1.json" "$OUT/random-c4.json" "$OUT/random-c16.json" >"$OUT/compare-random.txt"
$PY -m tokenmill bench compare "$OUT/random-c16.json" "$OUT/shared-prefix-c16.json" >"$OUT/compare-c16.txt"
