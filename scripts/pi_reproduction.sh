#!/usr/bin/env bash
# Position interpolation's result (Chen et al. 2023) in ~5.5 minutes on one H200 (BENCHMARKS.md). Trains a
# byte-level Llama at 1024 tokens (configs/pi-base-1k.yaml, ~4 min), rescales RoPE linearly to 8192
# and fine-tunes briefly (~2 min), then reports held-out perplexity and passkey accuracy at 1k-8k for
# the original, the interpolated and the fine-tuned model, and PASS / FAIL for the claim.
#   bash scripts/pi_reproduction.sh [OUT_DIR]            (default runs/pi; it must not hold a run yet)
# Results: OUT_DIR/finetune/long_context_report.{md,json}, perplexity_vs_length.png.
# Passkey examples (<= 1024 tokens, within the base model's context) make up 5% of the fine-tuning tokens: a
# 24M byte-level model trained only on code never sees the task otherwise, and scores 0% at every length for
# all three models, the original at 1k included.
# Environment: BASE_STEPS, FT_STEPS, FT_LR, TARGET_LEN, EVAL_LENGTHS, EVAL_WINDOWS, PASSKEY_TRIALS,
# PASSKEY_TRAIN_FRACTION; BASE_ARGS and FT_ARGS are extra key=value overrides (FT_ARGS also finetune-long
# options). The CPU smoke run (~2 min on 2 cores):
#   BASE_STEPS=400 FT_STEPS=100 FT_LR=1e-3 TARGET_LEN=512 EVAL_LENGTHS="128 256 512" EVAL_WINDOWS=8 \
#   PASSKEY_TRIALS=2 BASE_ARGS="model.d_model=128 model.n_layer=4 model.n_head=4 model.n_kv_head=2
#   model.head_dim=32 model.d_ff=352 model.max_seq_len=128 data.seq_len=128 batch_size=16 micro_batch_size=16
#   eval_every=100 optim.lr=2e-3 sample.max_new_tokens=0" \
#   FT_ARGS="batch_size=4 micro_batch_size=4" bash scripts/pi_reproduction.sh /tmp/pi-smoke
set -euo pipefail
out="${1:-runs/pi}"
target="${TARGET_LEN:-8192}"
export PYTHONUNBUFFERED=1
# One default config per kernel instead of autotuning every shape (1k training, 8k varlen fine-tuning,
# four evaluated lengths, decoding): autotuning compiles ~7 candidates each, minutes of an 8-minute run.
export FLASHFORMER_AUTOTUNE="${FLASHFORMER_AUTOTUNE:-0}"

# BASE_ARGS / FT_ARGS / EVAL_LENGTHS are unquoted on purpose: each word is one override or value.
# shellcheck disable=SC2086
python3 -m flashformer.cli train configs/pi-base-1k.yaml out_dir="$out/base" steps="${BASE_STEPS:-1500}" \
  ${BASE_ARGS:-}
# 8 rows x 8192 = 65k tokens per step, as in base training; ~250k tokens/s at 8k (attention doubles the
# FLOPs per token, activation checkpointing recomputes the forward) makes 400 steps ~2 minutes.
# lr half the base's, not finetune-long's default tenth: at toy scale on CPU (128 -> 512, 100 steps) the
# fine-tuned ppl @ 512 against the original's @ 128 was +12% at 0.1x, +2.2% at 0.3x, +0.6% at 0.5x, +2.0% at 1x.
# shellcheck disable=SC2086
python3 -m flashformer.cli finetune-long "$out/base" --target-len "$target" --scaling linear \
  --steps "${FT_STEPS:-400}" --lr "${FT_LR:-5e-4}" --out-dir "$out/finetune" \
  --eval-lengths ${EVAL_LENGTHS:-1024 2048 4096 8192} \
  --eval-windows "${EVAL_WINDOWS:-32}" --passkey-trials "${PASSKEY_TRIALS:-5}" \
  --passkey-train-fraction "${PASSKEY_TRAIN_FRACTION:-0.05}" \
  batch_size=8 micro_batch_size=8 ${FT_ARGS:-}
