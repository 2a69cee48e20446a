#!/usr/bin/env bash
# Multi-GPU training on a machine with 2+ GPUs (the device tool's nvidia-h200-x2): DDP and FSDP2 training and
# context parallelism, each against one GPU. Results: one summary line per stage, logs and JSON packed into
# $OUT/results.tgz.
# Usage on the device machine: bash scripts/multi_gpu_check.sh [stage ...]   (default: ddp fsdp cp-check cp-long)
#   ddp  ~2 min: gpt2-124m, 150 steps: 1 GPU and 2 GPUs at the same per-GPU batch (tokens/s), and 1 GPU at
#        the same global batch (the loss curve 2 GPUs must match)
#   ddp-apart  ~40 s: ddp's one-GPU run on every GPU at once (no communication)
#   fsdp ~3 min: configs/llama-1b.yaml, 30 steps on 1 GPU and on 2 (tokens/s, MFU, peak memory per GPU)
#   cp-check ~3-5 min: ring attention exact against one GPU (fp32, 8k tokens; mostly compiling)
#   cp-long  ~5 min: llama-125m steps (no activation checkpointing) at the longest single-GPU length found
#        here and at twice that, split over the GPUs (CP_SEQLENS="L ..." names the lengths, skipping the search)
set -uo pipefail
OUT="${OUT:-out}"; mkdir -p "$OUT"
RES=/tmp/multi-gpu-results; mkdir -p "$RES"
trap 'tar czf "$OUT/results.tgz" --exclude="*.safetensors" --exclude="*.pt" -C "$RES" .' EXIT
export PYTHONUNBUFFERED=1 FLASHFORMER_AUTOTUNE=0
GPUS=$(python3 -c "import torch; print(torch.cuda.device_count())")
if [ -d .whl ]; then  # datasets and its pure-Python deps, which the device image lacks
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v WARNING
# train LIMIT_S [key=value ...] out_dir=DIR: one process / all GPUs; the log lands beside the run's directory.
train() { local limit=$1; shift; timeout "$limit" python3 -m flashformer.cli train "$@" > "$RES/$(basename "${*: -1}").log" 2>&1; }
# torchrun through this python3 (the device image's PATH may hold another Python's torchrun)
torchrun_train() { local limit=$1; shift; timeout "$limit" python3 -m torch.distributed.run --standalone \
  --nproc_per_node "$GPUS" -m flashformer.cli train "$@" > "$RES/$(basename "${*: -1}").log" 2>&1; }
summary() {  # tokens/s (median of the second half of the logged steps), MFU, peak memory, last loss per run
  python3 - "$@" <<'EOF'
import statistics, sys
from flashformer.train import read_metrics
for run in sys.argv[1:]:
    records = [r for r in read_metrics(run) if "tokens_per_s" in r]
    late = records[len(records) // 2:]
    print(f"{run}: {statistics.median(r['tokens_per_s'] for r in late):,.0f} tokens/s, "
          f"MFU {statistics.median(r.get('mfu', 0) for r in late):.1%}, "
          f"peak {max(r.get('peak_memory_gb', 0) for r in records):.1f} GB/GPU, last loss {records[-1]['loss']:.4f}")
EOF
}
# DDP's runs: gpt2-124m, 1024-token rows, per_gpu rows per GPU and step, eager
ddp_common=(data.source=stdlib data.tokenizer=null data.seq_len=1024 steps=150 log_every=10 eval_every=1000
            eval_batches=1 ckpt_every=1000 keep_checkpoints=1 sample.max_new_tokens=0 compile=false)
per_gpu=16
stages=("$@"); [ ${#stages[@]} -eq 0 ] && stages=(ddp fsdp cp-check cp-long)
for stage in "${stages[@]}"; do
  echo "=== $stage $(date -u +%FT%TZ), $GPUS GPUs"
  case $stage in
    ddp)
      global=$((per_gpu * GPUS))
      train 100 configs/gpt2-124m.yaml "${ddp_common[@]}" parallel.mode=none batch_size=$per_gpu \
        micro_batch_size=$per_gpu out_dir=$RES/ddp-1gpu-same-per-gpu
      # NCCL's transport and channel choices go into the log: the 2-GPU side varied 12% between calls
      NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,GRAPH,TUNING torchrun_train 100 configs/gpt2-124m.yaml "${ddp_common[@]}" \
        parallel.mode=ddp batch_size=$global micro_batch_size=$per_gpu out_dir=$RES/ddp-${GPUS}gpu
      train 100 configs/gpt2-124m.yaml "${ddp_common[@]}" parallel.mode=none batch_size=$global \
        micro_batch_size=$per_gpu out_dir=$RES/ddp-1gpu-same-global
      summary "$RES/ddp-1gpu-same-per-gpu" "$RES/ddp-${GPUS}gpu" "$RES/ddp-1gpu-same-global"
      python3 - "$RES/ddp-${GPUS}gpu" "$RES/ddp-1gpu-same-global" <<'EOF'
import sys
from flashformer.train import read_metrics
many, one = ([r for r in read_metrics(run) if "loss" in r and "tokens_per_s" in r] for run in sys.argv[1:])
print("loss, %s GPUs vs 1 GPU at the same global batch: max |diff| %.4f over %d logged steps"
      % (sys.argv[1].rsplit("-", 1)[-1], max(abs(a["loss"] - b["loss"]) for a, b in zip(many, one)), len(one)))
EOF
      ;;
    ddp-apart)  # ddp's one-GPU run on every GPU at once, without communication: what each GPU reaches while
      # all of them work (shared host, power); DDP against this isolates what its communication costs
      for ((gpu = 0; gpu < GPUS; gpu++)); do
        CUDA_VISIBLE_DEVICES=$gpu train 100 configs/gpt2-124m.yaml "${ddp_common[@]}" parallel.mode=none \
          batch_size=$per_gpu micro_batch_size=$per_gpu out_dir=$RES/ddp-apart-gpu$gpu &
      done
      wait
      summary $(for ((gpu = 0; gpu < GPUS; gpu++)); do echo "$RES/ddp-apart-gpu$gpu"; done) ;;
    fsdp)
      common=(steps=30 log_every=5 eval_every=1000 eval_batches=1 ckpt_every=1000 keep_checkpoints=1
              sample.max_new_tokens=0 micro_batch_size=2)
      train 200 configs/llama-1b.yaml "${common[@]}" parallel.mode=none batch_size=2 out_dir=$RES/fsdp-1gpu
      torchrun_train 200 configs/llama-1b.yaml "${common[@]}" batch_size=$((2 * GPUS)) out_dir=$RES/fsdp-${GPUS}gpu
      summary "$RES/fsdp-1gpu" "$RES/fsdp-${GPUS}gpu" ;;
    cp-check)  # fp32: one process compiles every kernel variant it meets in turn (minutes on a cold cache)
      timeout 300 python3 -m torch.distributed.run --standalone --nproc_per_node "$GPUS" scripts/context_parallel_step.py \
        configs/models/llama-125m.yaml --seqlen 8192 --check --out "$RES/cp-check.json" > "$RES/cp-check.log" 2>&1
      tail -1 "$RES/cp-check.log" ;;
    cp-long)
      # The longest single-GPU length, then twice it over the ranks (CP_SEQLENS instead names the lengths and
      # skips the search). Without activation checkpointing: with it one GPU already reaches ~1.5M tokens, and
      # a step at twice that takes longer than a device call.
      # Both sides with expandable segments: at 2 x 262144 tokens the default allocator holds ~6.4 GiB in
      # fragments and refuses a 0.75 GiB block.
      alloc=PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
      seqlens=${CP_SEQLENS:-}
      if [ -z "$seqlens" ]; then
        env "$alloc" timeout 240 python3 scripts/memory_savings.py --device cuda --backends flash --checkpointing off \
          --seqlens 131072 196608 262144 327680 393216 --out "$RES/cp-1gpu.json" --plot "$RES/cp-1gpu.png" \
          > "$RES/cp-1gpu.log" 2>&1
        longest=$(python3 -c "import json; print(json.load(open('$RES/cp-1gpu.json'))['longest']['flash + chunked CE'] or 0)")
        echo "longest on 1 GPU without checkpointing: $longest tokens"
        seqlens="$longest $((2 * longest))"
      fi
      for seqlen in $seqlens; do
        env "$alloc" timeout 200 python3 -m torch.distributed.run --standalone --nproc_per_node "$GPUS" scripts/context_parallel_step.py \
          configs/models/llama-125m.yaml --seqlen "$seqlen" --steps 2 --no-checkpointing \
          --out "$RES/cp-$seqlen.json" > "$RES/cp-$seqlen.log" 2>&1
        tail -1 "$RES/cp-$seqlen.log"
      done ;;
  esac
done
