"""One long-context training step of a Llama-3-8B-shaped model with LoRA on one GPU: peak memory and speed.

The model is built from random weights directly on the device in bf16 (an 8B model never exists in
fp32), adapted with LoRA (rank 16 on q, k, v, o by default), checkpointed per block with the block
inputs offloaded to pinned host memory, and trained on one batch-1 row of ``--tokens`` random tokens with
the chunked LM head + cross-entropy. One warm-up step, then ``--steps`` timed ones; printed: the plan's
estimate (flashformer.memory), torch.cuda.max_memory_allocated, tokens/s, and the measured activation
bytes per token. A step at millions of tokens runs for minutes: a tqdm bar follows it block by block
(one device synchronisation per block pass, which long blocks do not feel). An out-of-memory error ends the run with exit code 1, naming the phase it reached.

    python scripts/bench_longctx_8b.py                              # 8B LoRA, 131072 tokens, offload
    python scripts/bench_longctx_8b.py --no-offload --tokens 65536
    python scripts/bench_longctx_8b.py --full                       # Llama-3.2-1B shape, full fine-tune, 262144
    python scripts/bench_longctx_8b.py --full --config configs/models/llama-125m.yaml --set n_layer=2 \
        --tokens 2097152 --warmup-steps 0 --steps 1                 # 125M's blocks at 2M tokens
    python scripts/bench_longctx_8b.py --device cpu --layers 2 --d-model 256 --heads 4 --kv-heads 2 \\
        --head-dim 64 --d-ff 512 --vocab 1024 --tokens 512           # CPU smoke test
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

import torch
from tqdm import tqdm

from flashformer.batches import Batch
from flashformer.config import load_config
from flashformer.lora import TARGET_MODULES, LoRAConfig, apply_lora
from flashformer.losses import default_chunk_size
from flashformer.memory import format_plan, memory_plan
from flashformer.model import ModelConfig, Transformer
from flashformer.parallel import apply_activation_checkpointing
from flashformer.train import OptimConfig
from flashformer.train.step import build_optimizer, train_step

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FULL_MODEL_CONFIG = os.path.join(REPO_ROOT, "configs", "models", "llama-1b.yaml")
RESULT_PREFIX = "BENCH_LONGCTX_RESULT "
GB = 1e9


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--full", action="store_true",
                        help="full fine-tune of --config (fp32 weights, bf16 autocast), no LoRA")
    parser.add_argument("--config", default=FULL_MODEL_CONFIG,
                        help="ModelConfig YAML of the --full model (default: configs/models/llama-1b.yaml)")
    parser.add_argument("--set", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                        help="overrides of the --full model's config, e.g. n_layer=2")
    parser.add_argument("--tokens", type=int, default=None, help="tokens per step (default 131072; 262144 with --full)")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--d-model", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--d-ff", type=int, default=14336)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--lora-targets", nargs="+", default=["q", "k", "v", "o"], choices=list(TARGET_MODULES))
    parser.add_argument("--offload", action=argparse.BooleanOptionalAction, default=True,
                        help="keep the checkpointed block inputs in pinned host memory")
    parser.add_argument("--warmup-steps", type=int, default=1,
                        help="untimed steps first (compiles; 0 where one step is long enough to hide them)")
    parser.add_argument("--steps", type=int, default=2, help="timed steps after the warm-up steps")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--attn-backend", default="auto")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.tokens is None:
        args.tokens = 262144 if args.full else 131072
    if args.tokens < 2 or args.steps < 1 or args.warmup_steps < 0:
        parser.error("--tokens must be >= 2, --steps >= 1 and --warmup-steps >= 0")
    if not args.full and (args.set or args.config != FULL_MODEL_CONFIG):
        parser.error("--config and --set choose the --full model; the LoRA model's shape comes from --layers, "
                     "--d-model, ...")
    return args


def model_config(args) -> ModelConfig:
    if args.full:
        return load_config(ModelConfig, args.config, [f"max_seq_len={max(args.tokens, 131072)}", *args.set])
    return ModelConfig(family="llama", vocab_size=args.vocab, d_model=args.d_model, n_layer=args.layers,
                       n_head=args.heads, n_kv_head=args.kv_heads, head_dim=args.head_dim, d_ff=args.d_ff,
                       max_seq_len=args.tokens, rope_theta=500000.0, tie_embeddings=False)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_model(config: ModelConfig, lora: LoRAConfig | None, device: torch.device, attn_backend: str) -> Transformer:
    """Random weights allocated on ``device`` in their final dtype: bf16 for a LoRA base, fp32 otherwise."""
    with torch.device(device), default_dtype(torch.float32 if lora is None else torch.bfloat16):
        model = Transformer(config, attn_backend=attn_backend)
    return model if lora is None else apply_lora(model, lora)


def _is_out_of_memory(error: BaseException) -> bool:
    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error).lower()


def _allocated(device) -> float | None:
    """GB allocated now on a CUDA device (None elsewhere: no allocator statistics)."""
    return torch.cuda.memory_allocated(device) / GB if device.type == "cuda" else None


def _peak(device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / GB if device.type == "cuda" else None


def _gb(value) -> str:
    return "n/a" if value is None else f"{value:.1f} GB"


def _synchronize(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def follow_blocks(model: Transformer, device, steps: int) -> tqdm:
    """A bar over the block passes of ``steps`` steps: each block's forward as it ends, and its backward as it
    begins (its output's gradient is ready). Both wait for the device, so the bar shows the GPU's progress,
    and a run cut short leaves in its log how far it got."""
    bar = tqdm(total=2 * len(model.blocks) * steps, unit="block", desc="block passes", file=sys.stderr)

    def tick(*_):
        _synchronize(device)
        bar.update()

    def after_forward(block, inputs, output):
        tick()
        if torch.is_grad_enabled() and output.requires_grad:
            output.register_hook(tick)

    for block in model.blocks:
        block.register_forward_hook(after_forward)
    return bar


def run(args, record: dict) -> None:
    """Build, warm up, time, filling ``record`` as it goes (its "phase" says how far it got when a step
    raises, out-of-memory errors included)."""
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    config = model_config(args)
    lora = None if args.full else LoRAConfig(rank=args.lora_rank, targets=args.lora_targets, base_dtype="bf16")
    checkpointing = "offload" if args.offload else True
    plan = memory_plan(config, args.tokens, lora, checkpointing, bf16_autocast=True)
    print(format_plan(plan), flush=True)
    name = os.path.splitext(os.path.basename(args.config))[0]
    label = (f"{name} full fine-tune, n_layer={config.n_layer}" if args.full
             else f"{config.n_layer}-layer LoRA rank {args.lora_rank}")
    record.update(model=label, tokens=args.tokens, offload=args.offload, device=str(device),
                  estimated_peak_gb=plan["estimated_peak"] / GB)
    model = build_model(config, lora, device, args.attn_backend)
    apply_activation_checkpointing(model, offload=args.offload)
    optimizer = build_optimizer(model, OptimConfig(lr=1e-4, warmup_steps=0))
    ids = torch.randint(0, config.vocab_size, (1, args.tokens + 1), device=device)
    batch = Batch(ids[:, :-1], ids[:, 1:])
    step = dict(bf16=True, loss_chunk_size=default_chunk_size(config.vocab_size), max_grad_norm=1.0)
    record["weights_gb"] = _allocated(device)
    bar = follow_blocks(model, device, args.warmup_steps + args.steps)
    for index in range(args.warmup_steps):
        record["phase"] = f"warm-up step {index + 1} of {args.warmup_steps}"
        loss, _ = train_step(model, optimizer, [batch], **step)
        record["warmup_loss"] = loss.item()
    _synchronize(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    for index in range(args.steps):
        record["phase"] = f"timed step {index + 1} of {args.steps}"
        loss, _ = train_step(model, optimizer, [batch], **step)
    _synchronize(device)
    seconds = time.perf_counter() - start
    bar.close()
    static = _allocated(device)  # weights + optimizer state, gradients freed: what a step starts from
    peak = _peak(device)
    record.update(phase="done", loss=loss.item(), static_gb=static, peak_gb=peak,
                  tokens_per_s=args.tokens * args.steps / seconds,
                  activation_bytes_per_token=None if peak is None else (peak - static) * GB / args.tokens)


def main(argv=None) -> int:
    args = parse_args(argv)
    record = {"phase": "build"}
    try:
        run(args, record)
    except (torch.OutOfMemoryError, RuntimeError) as error:
        if not _is_out_of_memory(error):
            raise
        device = torch.device(args.device)
        print(f"OUT OF MEMORY during {record['phase']}: peak {_gb(_peak(device))} allocated so far "
              f"(estimate {_gb(record.get('estimated_peak_gb'))}); {str(error).splitlines()[0]}", file=sys.stderr)
        print(RESULT_PREFIX + json.dumps({**record, "status": "oom"}))
        return 1
    print(f"peak {_gb(record['peak_gb'])} (estimate {_gb(record['estimated_peak_gb'])}, weights + optimizer "
          f"{_gb(record['static_gb'])}) | {record['tokens_per_s']:,.0f} tokens/s | loss {record['loss']:.3f}")
    if record["activation_bytes_per_token"] is not None:
        print(f"measured activations: {record['activation_bytes_per_token'] / 1e3:.1f} KB per token")
    print(RESULT_PREFIX + json.dumps({**record, "status": "ok"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
