"""Backward schedule variants side by side on one GPU (session 8's experiment, docs/perf-notes.md).

Each variant sets flash_bwd's switches (ONE_LOOP_DQ, ONE_LOOP_DKDV, DEPENDENT_BWD) and is timed like
bench_attention's grid (same inputs, ``time_fwd_bwd``), interleaved over --reps rounds beside SDPA's
flash backend; the table gives the median backward TFLOP/s and its ratio to SDPA flash. Every
variant's gradients must equal the first variant's bit for bit (the switches change the schedule,
not the arithmetic); a mismatch is printed.

    python scripts/bench_bwd_variants.py --cells 128:causal:1024 128:causal:2048 64:causal:1024
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from bench_attention import SDPA_BACKENDS, _ours, _sdpa, attention_flops, time_fwd_bwd, warm_up_gpu
from flashformer.kernels import flash_bwd

VARIANTS = {  # name: (ONE_LOOP_DQ, ONE_LOOP_DKDV, DEPENDENT_BWD)
    "base": (0, 0, False),
    "dq-branch": (1, 0, False),
    "dq-select": (2, 0, False),
    "dkdv-branch": (0, 1, False),
    "dkdv-select": (0, 2, False),
    "pdl": (0, 0, True),
    "dq-branch+pdl": (1, 0, True),
    "all": (1, 2, True),
}


def set_variant(name):
    flash_bwd.ONE_LOOP_DQ, flash_bwd.ONE_LOOP_DKDV, flash_bwd.DEPENDENT_BWD = VARIANTS[name]


def gradients(q, k, v, grad_out, causal):
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    _ours(*leaves, causal).backward(grad_out)
    return [t.grad for t in leaves]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cells", nargs="+", default=["128:causal:1024"], help="head_dim:causal|full:seqlen")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--out", default="bench_bwd_variants.json")
    args = parser.parse_args(argv)
    warm_up_gpu()
    sdpa_flash = _sdpa(SDPA_BACKENDS["sdpa-flash"])
    rows = []
    for cell in args.cells:
        head_dim, mask, seqlen = cell.split(":")
        head_dim, causal, seqlen = int(head_dim), mask == "causal", int(seqlen)
        batch, heads = max(1, args.tokens // seqlen), args.width // head_dim
        q, k, v, grad_out = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16)
                             for _ in range(4))
        flops = attention_flops(batch, heads, seqlen, head_dim, causal)
        reference, mismatched = None, []
        for name in args.variants:  # compiles every variant before timing, and checks its gradients
            set_variant(name)
            grads = gradients(q, k, v, grad_out, causal)
            if reference is None:
                reference = grads
            elif not all(torch.equal(a, b) for a, b in zip(grads, reference)):
                mismatched.append(name)
        times = {name: [] for name in ["sdpa-flash", *args.variants]}
        for _ in range(args.reps):
            times["sdpa-flash"].append(time_fwd_bwd(sdpa_flash, q, k, v, causal, grad_out, flops)[0]["bwd_tflops"])
            for name in args.variants:
                set_variant(name)
                times[name].append(time_fwd_bwd(_ours, q, k, v, causal, grad_out, flops)[0]["bwd_tflops"])
        row = {"head_dim": head_dim, "causal": causal, "seqlen": seqlen, "bwd_tflops": times,
               "median": {name: statistics.median(t) for name, t in times.items()}, "mismatched": mismatched}
        rows.append(row)
        print(json.dumps(row), flush=True)
    set_variant("base")
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)
    names = ["sdpa-flash", *args.variants]
    print("\nbackward TFLOP/s, median of rounds (x SDPA flash)\n")
    print("| head_dim | mask | seqlen | " + " | ".join(names) + " | grads differ |")
    print("|---|---|---|" + "---|" * len(names) + "---|")
    for r in rows:
        flash = r["median"]["sdpa-flash"]
        cells = [f"{r['median'][n]:.0f} ({r['median'][n] / flash:.3f})" for n in names]
        print(f"| {r['head_dim']} | {'causal' if r['causal'] else 'full'} | {r['seqlen']} | " + " | ".join(cells)
              + f" | {', '.join(r['mismatched']) or '-'} |")


if __name__ == "__main__":
    main()
