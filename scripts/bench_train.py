"""End-to-end training throughput: one recipe, several attention paths, side by side in one process.

Runs `flashformer.train` for a few hundred steps per (seqlen, attention path) and reports the median
tokens/s and MFU of the logged steps after warm-up. "sdpa-flash" and "sdpa-cudnn" are
attn_backend=sdpa pinned to one torch backend with ``sdpa_kernel``. Data: the embedded stdlib corpus
(throughput does not depend on which tokens are trained on), so nothing is downloaded.

    python scripts/bench_train.py configs/gpt2-124m.yaml --seqlens 1024 4096 --steps 200
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile

from torch.nn.attention import SDPBackend, sdpa_kernel

from flashformer.train import load_train_config, read_metrics, train

PATHS = {
    "flash": ("flash", None),
    "sdpa-flash": ("sdpa", SDPBackend.FLASH_ATTENTION),
    "sdpa-cudnn": ("sdpa", SDPBackend.CUDNN_ATTENTION),
}


def run_one(recipe, seqlen, path, steps, tokens_per_step, extra):
    backend, sdpa_backend = PATHS[path]
    batch = max(1, tokens_per_step // seqlen)
    with tempfile.TemporaryDirectory() as out_dir:
        overrides = [
            f"model.attn_backend={backend}", f"data.seq_len={seqlen}", f"model.max_seq_len={max(seqlen, 1024)}",
            f"batch_size={batch}", f"micro_batch_size={batch}", f"steps={steps}", f"out_dir={out_dir}",
            "data.source=stdlib", "data.tokenizer=null", "parallel.mode=none", "log_every=10",
            f"eval_every={steps}", "eval_batches=1", f"ckpt_every={steps}", "keep_checkpoints=1",
            "sample.max_new_tokens=0", "compile=false", *extra,
        ]
        cfg = load_train_config(recipe, overrides)
        if sdpa_backend is None:
            train(cfg)
        else:
            with sdpa_kernel(sdpa_backend):
                train(cfg)
        records = [r for r in read_metrics(out_dir) if "tokens_per_s" in r]
    steady = records[len(records) // 3:]  # skip warm-up (autotuning, allocator growth)
    return {
        "seqlen": seqlen, "path": path, "batch": batch, "steps": steps,
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady),
        "mfu": statistics.median(r["mfu"] for r in steady) if "mfu" in steady[0] else None,
        "final_loss": records[-1].get("loss"),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe", help="training recipe, e.g. configs/gpt2-124m.yaml")
    parser.add_argument("--seqlens", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--paths", nargs="+", default=list(PATHS), choices=list(PATHS))
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--tokens-per-step", type=int, default=16384)
    parser.add_argument("--set", nargs="*", default=[], metavar="key=value", help="extra recipe overrides")
    parser.add_argument("--out", default="bench_train.json")
    args = parser.parse_args(argv)
    results = [run_one(args.recipe, s, p, args.steps, args.tokens_per_step, args.set)
               for s in args.seqlens for p in args.paths]
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print("| seqlen | batch | path | tokens/s | MFU | final loss |\n|---|---|---|---|---|---|")
    for r in results:
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "–"
        print(f"| {r['seqlen']} | {r['batch']} | {r['path']} | {r['tokens_per_s'] / 1e3:.0f}k | {mfu} | "
              f"{r['final_loss']:.3f} |")


if __name__ == "__main__":
    main()
