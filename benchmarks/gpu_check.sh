#!/usr/bin/env bash
# The prepared device check (issue 31): one command of a few minutes on a single-GPU machine that has PyTorch,
# Triton and transformers but no network. Writes OUT/report.json and OUT/report.md (benchmarks/gpu_check.py).
#
#   here, once:        bash benchmarks/gpu_check.sh --prepare   # the missing wheels into .whl (git-ignored)
#   on the GPU:        bash benchmarks/gpu_check.sh "$OUT"      # with .whl carried along
#
# (fastapi 0.16x imports opentelemetry-api, which the GPU image lacks: its absence killed serve there once.)
# The embedded model's package (94 MB) is larger than what may travel, so where it is missing the throughput
# and serving sections use a random-weight model of its exact shapes (speed does not depend on the values).
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS="gguf llguidance fastapi starlette uvicorn pydantic==2.14.4
        pydantic-core==2.50.5 annotated-types typing-inspection opentelemetry-api"
if [ "${1:-}" = "--prepare" ]; then
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
    # shellcheck disable=SC2086
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d .whl $WHEELS
    exit $?
fi
OUT=${1:-${OUT:-gpu_check_out}}
shift || true
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv 2>/dev/null | tee "$OUT.nvidia-smi.txt" || true
timeout 460 python3 benchmarks/gpu_check.py --out "$OUT" "$@"
