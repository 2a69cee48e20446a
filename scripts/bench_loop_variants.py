"""Kernel loop-structure variants side by side on one GPU (session 8's experiment, docs/perf-notes.md).

Each variant sets the kernels' switches (flash_fwd.ONE_LOOP_FWD, flash_bwd.ONE_LOOP_DQ, ONE_LOOP_DKDV)
and is timed like bench_attention's grid (same inputs, ``time_fwd_bwd``), interleaved
over --reps rounds beside SDPA's flash and cuDNN backends; the table gives median forward and backward TFLOP/s
and their ratios to SDPA flash. Every variant's output and gradients must equal the first variant's
bit for bit (the switches change the schedule, not the arithmetic); a mismatch is printed.

    python scripts/bench_loop_variants.py --cells 128:causal:1024 128:causal:2048 64:causal:1024
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from bench_attention import SDPA_BACKENDS, _ours, _sdpa, attention_flops, heads_for, time_fwd_bwd, warm_up_gpu
from flashformer.kernels import flash_bwd, flash_fwd

VARIANTS = {  # name: (ONE_LOOP_FWD, ONE_LOOP_DQ, ONE_LOOP_DKDV); 0: three loops, 1: branch, 2: select
    "base": (0, 0, 0),
    "fwd-branch": (1, 0, 0),
    "fwd-select": (2, 0, 0),
    "dq-select": (0, 2, 0),
    "dq-select+dkdv-branch": (0, 2, 1),
    "dq-branch+dkdv-branch": (0, 1, 1),
}


def set_variant(name):
    flash_fwd.ONE_LOOP_FWD, flash_bwd.ONE_LOOP_DQ, flash_bwd.ONE_LOOP_DKDV = VARIANTS[name]


def output_and_gradients(q, k, v, grad_out, causal):
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = _ours(*leaves, causal)
    out.backward(grad_out)
    return [out.detach(), *(t.grad for t in leaves)]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cells", nargs="+", default=["128:causal:1024"], help="head_dim:causal|full:seqlen")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--width", type=int, default=2048, help="heads * head_dim")
    parser.add_argument("--heads-256", type=int, default=8, help="heads at head_dim 256")
    parser.add_argument("--out", default="bench_loop_variants.json")
    args = parser.parse_args(argv)
    warm_up_gpu()
    sdpa = {name: _sdpa(SDPA_BACKENDS[name]) for name in ("sdpa-flash", "sdpa-cudnn")}
    rows = []
    for cell in args.cells:
        head_dim, mask, seqlen = cell.split(":")
        head_dim, causal, seqlen = int(head_dim), mask == "causal", int(seqlen)
        batch, heads = max(1, args.tokens // seqlen), heads_for(args, head_dim)
        q, k, v, grad_out = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16)
                             for _ in range(4))
        flops = attention_flops(batch, heads, seqlen, head_dim, causal)
        reference, mismatched = None, []
        for name in args.variants:  # compiles every variant before timing, and checks its results
            set_variant(name)
            results = output_and_gradients(q, k, v, grad_out, causal)
            if reference is None:
                reference = results
            elif not all(torch.equal(a, b) for a, b in zip(results, reference)):
                mismatched.append(name)
        cells = {name: [] for name in [*sdpa, *args.variants]}
        for _ in range(args.reps):
            for name, fn in sdpa.items():
                cells[name].append(time_fwd_bwd(fn, q, k, v, causal, grad_out, flops)[0])
            for name in args.variants:
                set_variant(name)
                cells[name].append(time_fwd_bwd(_ours, q, k, v, causal, grad_out, flops)[0])
        row = {"head_dim": head_dim, "causal": causal, "seqlen": seqlen, "cells": cells,
               "median": {name: [statistics.median(c[f"{way}_tflops"] for c in runs) for way in ("fwd", "bwd")]
                          for name, runs in cells.items()},
               "mismatched": mismatched}
        rows.append(row)
        print(json.dumps(row), flush=True)
    set_variant("base")
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)
    names = [*sdpa, *args.variants]
    print("\nforward / backward TFLOP/s, medians of rounds (x SDPA flash)\n")
    print("| head_dim | mask | seqlen | " + " | ".join(names) + " | results differ |")
    print("|---|---|---|" + "---|" * len(names) + "---|")
    for r in rows:
        (flash_fwd_tflops, flash_bwd_tflops) = r["median"]["sdpa-flash"]
        cells = [f"{f:.0f} / {b:.0f} ({f / flash_fwd_tflops:.3f}, {b / flash_bwd_tflops:.3f})"
                 for f, b in (r["median"][n] for n in names)]
        print(f"| {r['head_dim']} | {'causal' if r['causal'] else 'full'} | {r['seqlen']} | " + " | ".join(cells)
              + f" | {', '.join(r['mismatched']) or '-'} |")


if __name__ == "__main__":
    main()
