"""Training steps of one long sequence split over every rank (ring attention): sequences longer than
one GPU holds. Run under torchrun; every rank holds the whole model and a zigzag slice of
the sequence, and the gradients are averaged over the ranks.

    torchrun --nproc_per_node 2 scripts/context_parallel_step.py configs/models/llama-125m.yaml \\
        --seqlen 2097152 --steps 2 --out cp_step.json
    torchrun --nproc_per_node 2 scripts/context_parallel_step.py configs/models/llama-125m.yaml \\
        --seqlen 4096 --check

Steps are flashformer.train's training step, as in scripts/memory_savings.py's flash columns (bf16 autocast
on CUDA, activation checkpointing unless --no-checkpointing, chunked LM head + cross-entropy, fused AdamW)
inside the ring; the first step warms up, the rest are timed. Printed: per-rank
peak memory (CUDA allocator), tokens/s of the whole sequence, and the loss. ``--check`` instead compares
one step's loss and gradients against the whole sequence on every rank alone, in fp32: context
parallelism must be exact within the kernels' tolerance.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import torch
import torch.distributed as dist

from flashformer.config import load_config
from flashformer.batches import Batch
from flashformer.context_parallel import context_parallel, shard_batch
from flashformer.losses import default_chunk_size
from flashformer.model import ModelConfig, Transformer
from flashformer.parallel import apply_activation_checkpointing, shutdown_distributed
from flashformer.train.step import lm_loss, train_step


def build(config_path, overrides, seqlen, device):
    config = load_config(ModelConfig, config_path, overrides)
    config = dataclasses.replace(config, max_seq_len=max(config.max_seq_len, seqlen))
    torch.manual_seed(0)  # the same weights on every rank
    return Transformer(config, attn_backend="flash").to(device)


def local_batch(input_ids, targets, group) -> Batch:
    """This rank's zigzag slice of the sequence, with every token's true position."""
    ids, local_targets, positions = shard_batch(input_ids, targets, group)
    return Batch(ids, local_targets, position_ids=positions)


def cp_loss(model, input_ids, targets, group):
    """This rank's mean loss over its zigzag slice (forward and backward through the ring)."""
    with context_parallel(group):
        loss = lm_loss(model, local_batch(input_ids, targets, group),
                       loss_chunk_size=default_chunk_size(model.config.vocab_size))
        loss.backward()
    return loss.detach()


def average(tensors, group):
    """Mean over the ranks, in place (each rank's loss covers as many tokens)."""
    for t in tensors:
        dist.all_reduce(t, group=group)
        t /= dist.get_world_size(group)


def check(args, device, group):
    """Loss and gradients of one fp32 step: context parallel against the whole sequence."""
    model = build(args.config, args.set, args.seqlen, device)
    tokens = torch.randint(0, model.config.vocab_size, (1, args.seqlen + 1), device=device,
                           generator=torch.Generator(device).manual_seed(1))
    input_ids, targets = tokens[:, :-1], tokens[:, 1:]
    loss = cp_loss(model, input_ids, targets, group)
    grads = [p.grad.clone() for p in model.parameters()]
    average([loss, *grads], group)
    model.zero_grad(set_to_none=True)
    full_loss = model.loss(input_ids, targets)
    full_loss.backward()
    worst = max(((g - p.grad).abs().max() / p.grad.abs().max().clamp_min(1e-12)).item()
                for g, p in zip(grads, model.parameters()))
    return {"seqlen": args.seqlen, "loss": loss.item(), "full_loss": full_loss.item(),
            "loss_abs_diff": abs(loss.item() - full_loss.item()), "max_grad_rel_diff": worst}


def run_steps(args, device, group):
    """Timed steps; peak memory per rank."""
    model = build(args.config, args.set, args.seqlen, device)
    if not args.no_checkpointing:
        apply_activation_checkpointing(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    tokens = torch.randint(0, model.config.vocab_size, (1, args.seqlen + 1), device=device,
                           generator=torch.Generator(device).manual_seed(1))
    batch = local_batch(tokens[:, :-1], tokens[:, 1:], group)
    chunk_size = default_chunk_size(model.config.vocab_size)
    seconds, losses = [], []
    for step in range(args.steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
            if step == 1:
                torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        # Without DDP the gradients (and the loss, for the record) are averaged over the ranks by hand.
        loss, _ = train_step(model, optimizer, [batch], bf16=device.type == "cuda", loss_chunk_size=chunk_size,
                             context=lambda: context_parallel(group),
                             reduce_gradients=lambda loss: average([loss, *(p.grad for p in model.parameters())],
                                                                   group))
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
        losses.append(loss.item())
    timed = seconds[1:] or seconds
    peak = torch.tensor([torch.cuda.max_memory_allocated() / 1e9 if device.type == "cuda" else 0.0], device=device)
    peaks = [torch.zeros_like(peak) for _ in range(dist.get_world_size(group))]
    dist.all_gather(peaks, peak, group=group)
    return {"seqlen": args.seqlen, "ranks": dist.get_world_size(group), "steps": args.steps, "losses": losses,
            "checkpointing": not args.no_checkpointing, "tokens_per_s": args.seqlen / (sum(timed) / len(timed)),
            "peak_gb_per_rank": [p.item() for p in peaks]}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", help="ModelConfig YAML, e.g. configs/models/llama-125m.yaml")
    parser.add_argument("--seqlen", type=int, required=True, help="tokens of the whole sequence (batch 1)")
    parser.add_argument("--steps", type=int, default=2, help="steps; all but the first are timed")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="model config overrides")
    parser.add_argument("--no-checkpointing", action="store_true", help="keep every activation (no recompute)")
    parser.add_argument("--check", action="store_true", help="compare one fp32 step with the whole sequence")
    parser.add_argument("--out", help="write the result as JSON here (rank 0)")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                        help="auto: one GPU per local rank (NCCL) when there are enough, else CPU (gloo)")
    args = parser.parse_args(argv)
    if "RANK" not in os.environ:
        raise SystemExit("run under torchrun, e.g. torchrun --nproc_per_node 2 scripts/context_parallel_step.py ...")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    enough_gpus = torch.cuda.is_available() and torch.cuda.device_count() >= local_ranks
    if args.device == "cuda" and not enough_gpus:
        raise SystemExit(f"--device cuda needs a GPU per local rank: {local_ranks} ranks, "
                         f"{torch.cuda.device_count()} GPUs")
    on_cuda = enough_gpus and args.device != "cpu"
    device = torch.device("cuda", local_rank) if on_cuda else torch.device("cpu")
    if on_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if on_cuda else "gloo")
    # NCCL allocates its buffers outside torch's allocator at a communicator's first use: use it now, while
    # memory is free. Else the gradient all-reduce after a step that filled the GPU fails with CUDA OOM
    # (as on 2 H200s at 2 x 262144 tokens).
    dist.all_reduce(torch.zeros(1, device=device))
    try:
        world_size = dist.get_world_size()
        if args.seqlen % (2 * world_size):
            raise SystemExit(f"--seqlen {args.seqlen} must be divisible by 2 x {world_size} ranks (zigzag layout)")
        result = check(args, device, None) if args.check else run_steps(args, device, None)
        if dist.get_rank() == 0:
            print(json.dumps(result))
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(result, f, indent=1)
        # Leave together: a rank that tears its gloo pairs down while another still runs can abort that one
        # at exit ("terminate called without an active exception", seen once on a loaded 2-core CI machine).
        dist.barrier()
    finally:
        shutdown_distributed()


if __name__ == "__main__":
    main()
