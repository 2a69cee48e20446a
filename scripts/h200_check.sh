#!/usr/bin/env bash
# One H200 session: install, correctness (kernels without the interpreter), then the benchmarks.
# Each stage has its own time limit so that one slow stage cannot eat the lease; logs go to $OUT.
# Usage on the device machine: bash scripts/h200_check.sh [stage ...]   (default: all stages)
set -uo pipefail
OUT="${OUT:-out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then  # packages the device image lacks (datasets and its pure-Python deps)
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v WARNING
stages=("$@"); [ ${#stages[@]} -eq 0 ] && stages=(quick compile tune slow attention varlen decode train)
for stage in "${stages[@]}"; do
  echo "=== $stage $(date -u +%FT%TZ)"
  case $stage in
    quick)  FLASHFORMER_AUTOTUNE=0 timeout 120 python3 -m pytest tests/test_kernels_flash.py tests/test_kernels_api.py \
              tests/test_kernels_varlen.py tests/test_kernels_decode.py tests/test_kernels_launch.py -q -n 15 -p no:cacheprovider \
              -W ignore 2>&1 | tee "$OUT/quick.log" | tail -4 ;;
    compile) FLASHFORMER_AUTOTUNE=0 timeout 60 python3 -m pytest tests/test_kernels_flash.py -k compile -q \
              -p no:cacheprovider -W ignore 2>&1 | tail -2 ;;
    slow)   FLASHFORMER_AUTOTUNE=0 timeout 540 python3 -m pytest tests/test_kernels_flash.py -m slow -q -n 15 \
              -p no:cacheprovider -W ignore 2>&1 | tee "$OUT/slow.log" | tail -4 ;;
    tune)   # offline config sweep; the table lands in the working tree (later stages use it) and in $OUT
            timeout 420 python3 scripts/tune_attention.py --rep-ms 120 --json "$OUT/tune.json" 2>&1 | tee "$OUT/tune.log" \
              | grep -v "it/s\]" | tail -45; cp kernels/tuned_configs.json "$OUT/" ;;
    decode) timeout 150 python3 scripts/bench_decode.py --out "$OUT/decode.json" 2>&1 | tee "$OUT/decode.log" \
              | grep "^|" ;;
    attention) timeout 240 python3 scripts/bench_attention.py --impls ours sdpa-flash sdpa-cudnn --head-dims 64 128 256 \
              --out "$OUT/attention.json" 2>&1 | tee "$OUT/attention.log" | grep "^|" ;;
    varlen) timeout 120 python3 scripts/bench_attention.py --varlen --impls ours --out "$OUT/varlen.json" 2>&1 \
              | tee "$OUT/varlen.log" | grep "documents\|^|" ;;
    train)  timeout 300 python3 scripts/bench_train.py configs/gpt2-124m.yaml --seqlens 1024 4096 16384 --steps 60 \
              --profile 5 --out "$OUT/train.json" 2>&1 | tee "$OUT/train.log" | grep "^|\| @ " ;;
    memory) timeout 420 python3 scripts/memory_savings.py --device cuda --max 524288 --out "$OUT/memory.json" \
              --plot "$OUT/memory.png" 2>&1 | tee "$OUT/memory.log" | grep -v "it/s\]" | tail -30 ;;
  esac
done
