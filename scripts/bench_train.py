"""End-to-end training throughput: one recipe, several attention paths, side by side in one process.

Runs `flashformer.train` for a few hundred steps per (seqlen, attention path) and reports the median
tokens/s and MFU of the logged steps after warm-up. "flash-nondet" is attn_backend=flash with the
non-deterministic backward (deterministic=false); "sdpa-flash" and "sdpa-cudnn" are attn_backend=sdpa
pinned to one torch backend with ``sdpa_kernel``. Data: the embedded stdlib corpus (throughput does
not depend on which tokens are trained on), so nothing is downloaded.

    python scripts/bench_train.py configs/gpt2-124m.yaml --seqlens 1024 4096 --steps 200

``--profile N`` then traces N steps per (seqlen, path) with torch.profiler after a warm-up and prints
where the GPU time goes: attention kernels, matrix multiplies, the rest, and the share of the step's
wall time during which no kernel ran (host-bound gaps), plus each path's largest kernels.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashformer.profiling import benchmark_provenance, kernel_times
from flashformer.train import Trainer, load_train_config, read_metrics, train

# path -> (attn_backend, deterministic, the torch backend an sdpa path is pinned to)
PATHS = {
    "flash": ("flash", True, None),
    "flash-nondet": ("flash", False, None),
    "sdpa-flash": ("sdpa", True, SDPBackend.FLASH_ATTENTION),
    "sdpa-cudnn": ("sdpa", True, SDPBackend.CUDNN_ATTENTION),
}


ATTENTION_KERNELS = ("attn", "flash", "fmha", "cudnn", "_bwd_", "decode")
MATMUL_KERNELS = ("gemm", "cutlass", "nvjet", "sm90_xmma", "matmul")


def bench_config(recipe, seqlen, path, steps, tokens_per_step, extra, out_dir):
    """The recipe with this bench's overrides: one GPU, stdlib data, eager, nothing but training."""
    batch = max(1, tokens_per_step // seqlen)
    backend, deterministic, _ = PATHS[path]
    overrides = [
        f"attn_backend={backend}", f"deterministic={str(deterministic).lower()}",
        f"data.seq_len={seqlen}", f"model.max_seq_len={max(seqlen, 1024)}",
        f"batch_size={batch}", f"micro_batch_size={batch}", f"steps={steps}", f"out_dir={out_dir}",
        "data.source=stdlib", "data.tokenizer=null", "parallel.mode=none", "log_every=10",
        f"eval_every={steps}", "eval_batches=1", f"ckpt_every={steps}", "keep_checkpoints=1",
        "sample.max_new_tokens=0", "compile=false", *extra,
    ]
    return load_train_config(recipe, overrides), batch


def _pinned(path):
    """The sdpa_kernel context that pins an "sdpa-*" path to its torch backend (none for ours)."""
    sdpa_backend = PATHS[path][2]
    return sdpa_kernel(sdpa_backend) if sdpa_backend is not None else contextlib.nullcontext()


def run_one(recipe, seqlen, path, steps, tokens_per_step, extra):
    with tempfile.TemporaryDirectory() as out_dir:
        cfg, batch = bench_config(recipe, seqlen, path, steps, tokens_per_step, extra, out_dir)
        with _pinned(path):
            train(cfg)
        records = [r for r in read_metrics(out_dir) if "tokens_per_s" in r]
    steady = records[len(records) // 3:]  # skip warm-up (autotuning, allocator growth)
    return {
        "seqlen": seqlen, "path": path, "batch": batch, "steps": steps,
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady),
        "mfu": statistics.median(r["mfu"] for r in steady) if "mfu" in steady[0] else None,
        "final_loss": records[-1].get("loss"),
    }


def profile_one(recipe, seqlen, path, steps, tokens_per_step, extra, warmup=10):
    """GPU time per step by kernel category, and the step's wall time, over ``steps`` traced steps."""
    with tempfile.TemporaryDirectory() as out_dir, _pinned(path):
        cfg, batch = bench_config(recipe, seqlen, path, warmup + steps, tokens_per_step, extra, out_dir)
        trainer = Trainer(cfg)
        for _ in range(warmup):
            trainer.train_step()
        torch.cuda.synchronize()
        kernels, wall_ms = kernel_times(trainer.train_step, steps)

    def share(names):
        return sum(ms for name, ms in kernels.items() if any(n in name.lower() for n in names))
    attention, matmul, total = share(ATTENTION_KERNELS), share(MATMUL_KERNELS), sum(kernels.values())
    top = sorted(kernels.items(), key=lambda item: -item[1])[:12]
    return {"seqlen": seqlen, "path": path, "batch": batch, "wall_ms": wall_ms, "gpu_ms": total,
            "attention_ms": attention, "matmul_ms": matmul, "other_ms": total - attention - matmul,
            "idle_share": max(0.0, 1 - total / wall_ms), "top_kernels": top}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe", help="training recipe, e.g. configs/gpt2-124m.yaml")
    parser.add_argument("--seqlens", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--paths", nargs="+", default=list(PATHS), choices=list(PATHS))
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--tokens-per-step", type=int, default=16384)
    parser.add_argument("--set", nargs="*", default=[], metavar="key=value", help="extra recipe overrides")
    parser.add_argument("--profile", type=int, default=0, metavar="N", help="also trace N steps per cell")
    parser.add_argument("--out", default="bench_train.json")
    args = parser.parse_args(argv)
    results = [run_one(args.recipe, s, p, args.steps, args.tokens_per_step, args.set)
               for s in args.seqlens for p in args.paths] if args.steps else []
    profiles = [profile_one(args.recipe, s, p, args.profile, args.tokens_per_step, args.set)
                for s in args.seqlens for p in args.paths] if args.profile else []
    with open(args.out, "w") as f:
        json.dump({**benchmark_provenance(), "throughput": results, "profiles": profiles}, f, indent=1)
    if profiles:
        print(profile_table(profiles))
    print("| seqlen | batch | path | tokens/s | MFU | final loss |\n|---|---|---|---|---|---|")
    for r in results:
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "–"
        print(f"| {r['seqlen']} | {r['batch']} | {r['path']} | {r['tokens_per_s'] / 1e3:.0f}k | {mfu} | "
              f"{r['final_loss']:.3f} |")


def profile_table(profiles):
    lines = []
    for p in profiles:
        lines.append(f"{p['path']} @ {p['seqlen']}: " + ", ".join(f"{ms:.2f} ms {name[:70]}" for name, ms in p["top_kernels"][:6]))
    lines += ["", "| seqlen | path | step wall ms | GPU busy ms | attention ms | matmul ms | other ms | GPU idle |",
              "|---|---|---|---|---|---|---|---|"]
    for p in profiles:
        lines.append(f"| {p['seqlen']} | {p['path']} | {p['wall_ms']:.1f} | {p['gpu_ms']:.1f} | {p['attention_ms']:.1f} | "
                     f"{p['matmul_ms']:.1f} | {p['other_ms']:.1f} | {p['idle_share']:.0%} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
