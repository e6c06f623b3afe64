#!/usr/bin/env bash
# One batched check on a lent GPU machine: install, GPU tests, benchmarks; logs under $OUT.
# usage: benchmarks/gpu_check.sh [tests] [kernels] [attention] [decode] [sample] [train]
set -uo pipefail
export PYTHONUNBUFFERED=1 EULERGEN_CACHE=/tmp/eulergen-cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>/dev/null \
  && export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/gpu.txt"
for stage in "$@"; do
  case "$stage" in
    tests)     timeout 300 python3 -m pytest -m gpu tests/gpu -q -x -p no:cacheprovider 2>&1 | tee "$OUT/tests.log" ;;
    kernels)   timeout 240 python3 benchmarks/kernels.py 2>&1 | tee "$OUT/kernels.log" ;;
    attention) timeout 200 python3 benchmarks/attention.py 2>&1 | tee "$OUT/attention.log" ;;
    decode)    timeout 100 python3 benchmarks/attention.py --decode 2>&1 | tee "$OUT/decode.log" ;;
    sample)    timeout 200 python3 benchmarks/sample.py 2>&1 | tee "$OUT/sample.log" ;;
    train)     timeout 300 python3 benchmarks/train.py 2>&1 | tee "$OUT/train.log" ;;
    *) echo "unknown stage $stage" ;;
  esac
done
