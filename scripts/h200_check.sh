#!/usr/bin/env bash
# One H200 session: install, correctness (kernels without the interpreter), then the benchmarks.
# Each stage has its own time limit so that one slow stage cannot eat the lease; results come back
# as $OUT/results.tgz (and $OUT/tuned_configs.json after the tune stage).
# Usage on the device machine: bash scripts/h200_check.sh [stage ...]   (default: all stages)
# Stages: readme first-command quick compile slow tune descriptors decode prefill generate attention varlen first-call
# host fused-bwd counters determinism trees train train-chunked memory pi longctx-2m longctx-wait
# Each stage's limit fits one 10-minute device call with its neighbours: pi beside (half of) slow, quick + tune +
# attention + varlen + decode when narrowed. Two instances may run at once on a machine of two GPUs
# (CUDA_VISIBLE_DEVICES=0 / 1, the second started a few seconds later), each with its own RES (results
# directory) and RESULTS (archive name). Narrowing knobs: TUNE_ARGS (default: --head-dims 64 128 256), ATTN_ARGS (default:
# all impls, head dims 64 128 256), SLOW_FILTER (a pytest -k expression splitting the slow sweep across calls), SLOW_TIMEOUT,
# DECODE_ARGS (default: --host-profile 15), PREFILL_ARGS (bench_prefill's --cells, --kernel-times), TRAIN_ARGS (default: --seqlens 1024 4096 16384 --steps 50 --profile 5),
# FIRST_CALL_ARGS (bench_first_call's --shapes and --timeout), HOST_ARGS (bench_host's --shapes), COUNTERS_ARGS
# (kernel_counters.py's --impls / --passes / --seqlens), TREE_SCRIPT / TREE_ARGS / TREE_TIMEOUT (the trees stage). The interpreter test in `readme` needs numpy<2.4
# under Triton 3.6, as the README pins: carry that wheel in .whl/ where the machine's numpy is newer.
set -uo pipefail
OUT="${OUT:-out}"; mkdir -p "$OUT"
# The device tool returns at most 8 files from $OUT: stages write to RES, packed into one archive at exit.
RES="${RES:-/tmp/h200-results}"; mkdir -p "$RES"
# Checkpoints and weights stay behind (the archive may hold 16 MiB).
trap 'tar czf "$OUT/${RESULTS:-results}.tgz" --exclude="*.safetensors" --exclude="*.pt" --exclude="*.bin" -C "$RES" .' EXIT
export PYTHONUNBUFFERED=1
# Installs once per machine (a second instance started beside the first finds it done).
if [ -d .whl ] && [ ! -d /tmp/site/datasets ]; then  # packages the device image lacks (datasets and deps)
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
fi
[ -d .whl ] && export PYTHONPATH=/tmp/site
python3 -m pip show -q flashformer 2>/dev/null || python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v WARNING
stages=("$@"); [ ${#stages[@]} -eq 0 ] && stages=(quick tune attention varlen descriptors decode train)
wait_longctx() {  # until the long-context step prints its result (or fails), at most ~9 minutes
  for _ in $(seq 54); do grep -q "BENCH_LONGCTX_RESULT\|OUT OF MEMORY\|Traceback" /tmp/longctx_2m.log && break; sleep 10; done
  cp /tmp/longctx_2m.log "$RES/"; tail -c 1500 /tmp/longctx_2m.log
}
for stage in "${stages[@]}"; do
  workers=15; [ -n "${pi_pid:-}" ] && workers=13  # compile processes; leave the pi run's Python loop some cores
  echo "=== $stage $(date -u +%FT%TZ)"
  case $stage in
    quick)  FLASHFORMER_AUTOTUNE=0 timeout 180 python3 -m pytest tests/test_kernels_flash.py tests/test_kernels_api.py \
              tests/test_kernels_varlen.py tests/test_kernels_decode.py tests/test_kernels_launch.py \
              tests/test_kernels_cross_entropy.py tests/test_context_parallel.py -q -n 15 -p no:cacheprovider \
              -W ignore 2>&1 | tee "$RES/quick.log" | tail -4
            # generation's CUDA-graph path (the rest of that file needs the tokenizers package)
            timeout 120 python3 -m pytest tests/test_generate.py -k "cuda_graph or device_length" -q \
              -p no:cacheprovider -W ignore 2>&1 | tee -a "$RES/quick.log" | tail -2 ;;
    readme) # the README's test command as written; SIGINT at the limit, so a cut-short run still prints its
            # counts (tests/conftest.py names each failure as it is reported). Without the README's packages
            # (datasets, numpy<2.4: .whl/ where the image lacks them) dozens of tests fail for that alone.
            if ! python3 -c "import datasets, numpy, triton; from flashformer.kernels.settings import \
                check_interpreter_numpy as check; check(triton.__version__, numpy.__version__)"; then
              echo "readme: the README's packages are missing (datasets, numpy<2.4): send .whl/ (scripts/h200_wheels.sh)"
              continue
            fi
            # --durations only adds the slowest tests' times to the report (which ones hold the run's end)
            timeout -s INT -k 30 "${README_TIMEOUT:-540}" python3 -m pytest -q -p no:cacheprovider --durations=12 \
              > "$RES/readme.log" 2>&1
            grep -a "^FAILED\|passed\|failed\|^[0-9.]*s call" "$RES/readme.log" | tail -40 ;;
    first-command) # the README's first command as a user runs it (no environment variables): its eval losses,
            # sample and time; the run lands in runs/tiny, its metrics and loss plot in the results
            rm -rf runs/tiny
            cli=(flashformer); command -v flashformer > /dev/null || cli=(python3 -m flashformer.cli)  # not on PATH
            ( time timeout 400 "${cli[@]}" train configs/tiny.yaml ) > "$RES/first_command.log" 2>&1
            echo "exit $?"; cp runs/tiny/metrics.jsonl runs/tiny/loss.png "$RES/" 2>/dev/null
            tr '\r' '\n' < "$RES/first_command.log" | grep -a -v '%|' | grep -a . | tail -25 ;;
    first-call) timeout 420 python3 scripts/bench_first_call.py ${FIRST_CALL_ARGS:-} --out "$RES/first_call.json" 2>&1 \
              | tee "$RES/first_call.log" | grep "^|" ;;
    host)   timeout 300 python3 scripts/bench_host.py ${HOST_ARGS:-} --out "$RES/host.json" 2>&1 | tee "$RES/host.log" | grep "^|" ;;
    fused-bwd) timeout 480 python3 scripts/bench_gluon_backward.py --check --variants two-kernel fused fused-nondet \
              fused-split fused-split-nondet --head-dims 128 --seqlens 4096 16384 --out "$RES/gluon_fused_backward.json" 2>&1 \
              | tee "$RES/fused_bwd.log" | grep "^|\|smoke" ;;
    counters) # Nsight Compute's counters per kernel of one backward (ours, deterministic=False, cuDNN): COUNTERS_ARGS
            timeout 540 python3 scripts/kernel_counters.py ${COUNTERS_ARGS:-} --out "$RES/kernel_counters.json" 2>&1 \
              | tee "$RES/kernel_counters.log" | grep "^|\|error" ;;
    trees)  # one script run against each commit exported under .gpu/trees (scripts/with_tree.py export), then this
            # tree: two versions timed one after the other in one call. TREE_SCRIPT, TREE_ARGS say what to run.
            for tree in .gpu/trees/* .; do
              name=$(basename "$(cd "$tree" && pwd)"); [ "$tree" = . ] && name=working-tree
              echo "--- $name"
              if [ "$tree" = . ]; then run=(python3 "$TREE_SCRIPT"); else run=(python3 scripts/with_tree.py run "$tree" "$TREE_SCRIPT"); fi
              timeout "${TREE_TIMEOUT:-200}" "${run[@]}" ${TREE_ARGS:-} --out "$RES/tree_$name.json" 2>&1 \
                | tee "$RES/tree_$name.log" | grep "^|\|Error\|check failures"
            done ;;
    determinism) # each backward run 20 times: runs whose gradients differ in any bit, and the kernels each launches
            timeout 120 python3 scripts/check_determinism.py --out "$RES/determinism.json" 2>&1 \
              | tee "$RES/determinism.log" | grep "^|\|^[0-9]" ;;
    compile) FLASHFORMER_AUTOTUNE=0 timeout 60 python3 -m pytest tests/test_kernels_flash.py -k compile -q \
              -p no:cacheprovider -W ignore 2>&1 | tail -2 ;;  # also part of quick
    slow)   # SIGINT at the limit: pytest stops and prints its counts. -v names every result as it lands:
            # an interrupted xdist run skips the failure summary, which would lose the failures' names.
            FLASHFORMER_AUTOTUNE=0 timeout -s INT -k 30 "${SLOW_TIMEOUT:-540}" python3 -m pytest tests/test_kernels_flash.py -m slow -k "${SLOW_FILTER:-}" -v -n "$workers" \
              -p no:cacheprovider -W ignore --tb=line > "$RES/slow.log" 2>&1
            grep -a "FAILED\|ERROR" "$RES/slow.log" | head -40; grep -ac " PASSED " "$RES/slow.log"; tail -1 "$RES/slow.log" ;;
    tune)   # offline config sweep, written to $OUT after every cell (a cut-short call keeps what it measured),
            # then into the working tree for the later stages of this call
            [ -f kernels/tuned_configs.json ] && cp kernels/tuned_configs.json "$OUT/"
            timeout 360 python3 scripts/tune_attention.py --rep-ms 80 ${TUNE_ARGS:---head-dims 64 128 256} --out "$OUT/tuned_configs.json" \
              --json "$RES/tune.json" 2>&1 | tee "$RES/tune.log" | grep -v "it/s\]" | tail -45
            cp "$OUT/tuned_configs.json" kernels/ ;;
    generate) timeout 300 python3 scripts/bench_generate.py configs/models/llama-125m.yaml --batches 1 8 \
              --out "$RES/generate.json" 2>&1 | tee "$RES/generate.log" | grep "^|" ;;
    descriptors) timeout 60 python3 scripts/bench_descriptors.py 2>&1 | tee "$RES/descriptors.log" | grep "^|" ;;
    decode) timeout 150 python3 scripts/bench_decode.py ${DECODE_ARGS:---host-profile 15} --out "$RES/decode.json" \
              --plot "$RES/decode.png" 2>&1 \
              | tee "$RES/decode.log" | grep -A30 "^host profile\|^|" ;;
    prefill) # a prompt through the KV cache: the public call (dense forward where it pays), the decode kernel, SDPA
            timeout 240 python3 scripts/bench_prefill.py ${PREFILL_ARGS:-} --out "$RES/prefill.json" 2>&1 \
              | tee "$RES/prefill.log" | grep "^|" ;;
    attention) timeout 420 python3 scripts/bench_attention.py ${ATTN_ARGS:---impls ours ours-nondet sdpa-flash sdpa-cudnn --head-dims 64 128 256} \
              --out "$RES/attention.json" --plot "$RES/attention.png" 2>&1 | tee "$RES/attention.log" | grep "^|" ;;
    varlen) # packed documents: the dispatch's pick (Gluon on sm_90 at head_dim 128 and 256) beside the tl kernels
            timeout 300 python3 scripts/bench_attention.py --varlen --impls ours ours-tl --out "$RES/varlen.json" 2>&1 \
              | tee "$RES/varlen.log" | grep "documents\|^|" ;;
    train)  timeout 540 python3 scripts/bench_train.py configs/gpt2-124m.yaml ${TRAIN_ARGS:---seqlens 1024 4096 16384 --steps 50 \
              --profile 5} --out "$RES/train.json" 2>&1 | tee "$RES/train.log" | grep "^|\| @ " ;;
    train-chunked)  # the chunked LM-head loss (Triton cross-entropy) at every length, against the default
            timeout 300 python3 scripts/bench_train.py configs/gpt2-124m.yaml --seqlens 1024 4096 --steps 50 \
              --paths flash sdpa-cudnn --set chunked_loss=true --out "$RES/train_chunked.json" 2>&1 \
              | tee "$RES/train_chunked.log" | grep "^|" ;;
    memory) timeout 420 python3 scripts/memory_savings.py --device cuda --max 524288 --out "$RES/memory.json" \
              --plot "$RES/memory.png" 2>&1 | tee "$RES/memory.log" | grep -v "it/s\]" | tail -30 ;;
    longctx-2m)  # the 125M model's 12 blocks at 2,097,152 tokens: ~18 min, past one call, so it runs in a process
            # session of its own (it outlives this call while the machine stays held); this stage and `longctx-wait`
            # (the next calls) each wait up to ~9 min for its result line
            setsid nohup python3 scripts/bench_longctx_8b.py --full --config configs/models/llama-125m.yaml \
              --tokens 2097152 --warmup-steps 0 --steps 1 > /tmp/longctx_2m.log 2>&1 < /dev/null &
            wait_longctx ;;
    longctx-wait) wait_longctx ;;
    pi)     # position interpolation 1k -> 8k: ~5.5 min of mostly GPU work, so it runs in the
            # background beside the stages after it (the slow sweep's compiles are CPU work); reported at the end
            FLASHFORMER_AUTOTUNE=0 timeout 560 bash scripts/pi_reproduction.sh "$RES/pi" > "$RES/pi.log" 2>&1 &
            pi_pid=$! ;;
  esac
done
if [ -n "${pi_pid:-}" ]; then
  wait "$pi_pid"; echo "=== pi (exit $?) $(date -u +%FT%TZ)"
  tr '\r' '\n' < "$RES/pi.log" | grep -a -v '%|' | grep -a . | tail -12
fi
