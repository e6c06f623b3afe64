#!/usr/bin/env bash
# One batched check on a lent GPU machine: install, GPU tests, benchmarks; logs under $OUT.
# usage: benchmarks/gpu_check.sh [tests] [kernels] [attention] [decode] [sample] [train]
#        [scale] [converge] [baseline] [sizes] [longctx] [autocast] [beforeafter] [startup]
#   Each stage fits one 10-minute call. autocast: the converge side of training.precision=
#   autocast (the default) and its step beside training.precision=bf16's; its table merges
#   with saved runs by converge.py --report. beforeafter: benchmarks/train.py --quick on an
#   older tree (OLD, .old by default) and on this one, alternately.
#   PRESET=nanoeuler for converge; PRESETS=a,b and BATCH=8 for baseline and sizes; MODES=m1,m2
#   for baseline; RECOMPUTE=1 for sizes (a training.recompute=blocks row beside each);
#   DEADLINE=seconds for the benchmark stages (530 by default; beforeafter: 330 of the
#   script's time). tests: TESTS_TIMEOUT and GPU_WORKERS; pytest-xdist and execnet wheels in
#   .whl run the GPU test files on 8 processes, and a test stage at its limit is interrupted,
#   so pytest still prints what failed.
set -uo pipefail
export PYTHONUNBUFFERED=1 EULERGEN_CACHE=/tmp/eulergen-cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>/dev/null \
  && export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
# GPU test files on GPU_WORKERS processes when pytest-xdist travelled in .whl (NVRTC's compiles
# are CPU work; each file's fixtures stay in one process)
XDIST=""; python3 -c "import xdist" 2>/dev/null && XDIST="-n ${GPU_WORKERS:-8} --dist loadfile"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/gpu.txt"
for stage in "$@"; do
  case "$stage" in
    tests)     timeout -s INT -k 20 "${TESTS_TIMEOUT:-550}" python3 -m pytest -m gpu tests/gpu -q -rfE --durations=25 -p no:cacheprovider $XDIST 2>&1 | tee "$OUT/tests.log" ;;
    kernels)   timeout 240 python3 benchmarks/kernels.py 2>&1 | tee "$OUT/kernels.log" ;;
    attention) timeout 200 python3 benchmarks/attention.py 2>&1 | tee "$OUT/attention.log" ;;
    decode)    timeout 100 python3 benchmarks/attention.py --decode 2>&1 | tee "$OUT/decode.log" ;;
    sample)    timeout 200 python3 benchmarks/sample.py 2>&1 | tee "$OUT/sample.log" ;;
    train)     timeout 300 python3 benchmarks/train.py --deadline 270 2>&1 | tee "$OUT/train.log" ;;
    scale)     timeout 300 python3 -m pytest -m gpu tests/gpu/test_scale_gpu.py -q -s -p no:cacheprovider 2>&1 | tee "$OUT/scale.log" ;;
    converge)  timeout 570 python3 benchmarks/converge.py --preset "${PRESET:-gpt2}" --deadline "${DEADLINE:-530}" --out "$OUT" 2>&1 | tee "$OUT/converge.log" ;;
    baseline)  timeout 570 python3 benchmarks/train.py --dtype bf16 --presets "${PRESETS:-gpt2}" --batch "${BATCH:-8,16}" ${MODES:+--modes $MODES} --deadline "${DEADLINE:-530}" --out "$OUT" 2>&1 | tee "$OUT/baseline.log" ;;
    sizes)     timeout 570 python3 benchmarks/train.py --dtype bf16 --presets "${PRESETS:-gpt2-medium,nanoeuler-medium}" --batch "${BATCH:-8,16}" --modes default ${RECOMPUTE:+--recompute} --deadline "${DEADLINE:-530}" --out "$OUT" 2>&1 | tee "$OUT/sizes.log" ;;
    longctx)   timeout 570 python3 benchmarks/train.py --dtype bf16 --presets nanoeuler,gpt2 --seq 4096,8192 --batch 2 --modes default --sdpa flash,cudnn --deadline "${DEADLINE:-530}" --out "$OUT" 2>&1 | tee "$OUT/longctx.log" ;;
    autocast)  { timeout 340 python3 benchmarks/converge.py --preset "${PRESET:-gpt2}" --sides eulergen-autocast --deadline 330 --out "$OUT" && timeout 220 python3 benchmarks/train.py --dtype bf16 --bf16-storage --presets "${PRESET:-gpt2}" --modes eager --llmc "" --deadline 200 --out "$OUT"; } 2>&1 | tee "$OUT/autocast.log" ;;
    beforeafter)   # OLD: that commit's files (`git archive C | tar -x -C .old`, carried);
      # this tree's --bf16-storage row is the older default's precision
      old=$(realpath "${OLD:-.old}"); mkdir -p /tmp/old-pkg && ln -sfn "$old" /tmp/old-pkg/eulergen
      for side in old new old new; do
        [ "$SECONDS" -gt "${DEADLINE:-330}" ] && break
        echo "== $side"
        if [ "$side" = old ]; then
          (cd /tmp && PYTHONPATH=/tmp/old-pkg${PYTHONPATH:+:$PYTHONPATH} timeout 240 python3 "$old/benchmarks/train.py" --quick --dtype bf16)
        else
          timeout 240 python3 benchmarks/train.py --quick --dtype bf16 --bf16-storage --llmc ""
        fi
      done 2>&1 | tee "$OUT/beforeafter.log" ;;
    startup)   # the first run fills the kernel cache; then warm, edited (cuda, auto), one profiled
      { timeout 120 python3 benchmarks/startup.py --device cuda --repeat 2 \
          && timeout 120 python3 benchmarks/startup.py --device cuda --edit --repeat 4 \
          && timeout 120 python3 benchmarks/startup.py --edit --repeat 4 \
          && timeout 60 python3 benchmarks/startup.py --device cuda --edit --profile "$OUT/prof"; } 2>&1 | tee "$OUT/startup.log" ;;
    *) echo "unknown stage $stage" ;;
  esac
done
