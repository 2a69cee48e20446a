"""Is each attention backward bit-for-bit repeatable? Runs every implementation's forward + backward --runs times on
the same inputs and counts the runs whose dq, dk or dv differ in any bit from the first, then lists the kernels one
forward + backward launches (torch.profiler). "sdpa-cudnn-det" is SDPA's cuDNN under torch.backends.cudnn.deterministic:
whether that flag reaches cuDNN's attention at all shows in its counts and kernels. Needs a CUDA device.

    python3 scripts/check_determinism.py --impls ours ours-nondet sdpa-cudnn sdpa-cudnn-det --runs 20
"""

from __future__ import annotations

import argparse
import json

import torch
from torch.profiler import ProfilerActivity, profile

from bench_attention import (CUDNN_DETERMINISTIC, SDPA_BACKENDS, _ours, _ours_nondeterministic, _sdpa,  # scripts/ is
                             cudnn_deterministic)                                                      # sys.path[0]
from flashformer.profiling import benchmark_provenance

IMPLS = {"ours": _ours, "ours-nondet": _ours_nondeterministic,
         **{name: _sdpa(backend) for name, backend in SDPA_BACKENDS.items()},
         CUDNN_DETERMINISTIC: _sdpa(SDPA_BACKENDS["sdpa-cudnn"])}


def gradients(fn, q, k, v, causal, grad_out):
    """(dq, dk, dv) of one forward + backward of ``fn`` at fresh leaves of q, k, v."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    fn(*leaves, causal).backward(grad_out)
    return [t.grad for t in leaves]


def repeatability(fn, q, k, v, causal, grad_out, runs):
    """Per gradient (dq, dk, dv): how many of ``runs`` runs differ in any bit from a first run, and the largest
    difference seen."""
    first = gradients(fn, q, k, v, causal, grad_out)
    differing, largest = [0, 0, 0], [0.0, 0.0, 0.0]
    for _ in range(runs):
        for i, (grad, ref) in enumerate(zip(gradients(fn, q, k, v, causal, grad_out), first)):
            if not torch.equal(grad, ref):
                differing[i] += 1
                largest[i] = max(largest[i], (grad.double() - ref.double()).abs().max().item())
    return differing, largest


def launched_kernels(fn, q, k, v, causal, grad_out):
    """The names of the device kernels one forward + backward launches, sorted."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        gradients(fn, q, k, v, causal, grad_out)
        torch.cuda.synchronize()
    return sorted({event.name for event in prof.events() if event.device_type.name == "CUDA"})


def parse_shape(text):
    """'BxSxHxD' -> (batch, seqlen, heads, head_dim)."""
    parts = text.split("x")
    if len(parts) != 4 or not all(part.isdigit() and int(part) > 0 for part in parts):
        raise argparse.ArgumentTypeError(f"--shape wants BxSxHxD with positive integers, got {text!r}")
    return tuple(int(part) for part in parts)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--impls", nargs="+", choices=list(IMPLS), default=list(IMPLS))
    parser.add_argument("--shape", type=parse_shape, default=(4, 4096, 16, 128), help="BxSxHxD, bf16")
    parser.add_argument("--causal", choices=["yes", "no"], default="yes")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="check_determinism.json")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error(f"--runs must be at least 1, got {args.runs}")
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    torch.manual_seed(args.seed)
    q, k, v, grad_out = (torch.randn(*args.shape, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    causal = args.causal == "yes"
    rows = []
    for name in args.impls:
        with cudnn_deterministic(name == CUDNN_DETERMINISTIC):
            differing, largest = repeatability(IMPLS[name], q, k, v, causal, grad_out, args.runs)
            kernels = launched_kernels(IMPLS[name], q, k, v, causal, grad_out)
        rows.append({"impl": name, "runs": args.runs, "differing_runs": dict(zip(("dq", "dk", "dv"), differing)),
                     "largest_difference": dict(zip(("dq", "dk", "dv"), largest)), "kernels": kernels})
    with open(args.out, "w") as f:
        json.dump({**benchmark_provenance(), "shape": args.shape, "causal": causal, "rows": rows}, f, indent=1)
    print(f"\n{'x'.join(map(str, args.shape))} (B x S x H x D), causal={causal}, {args.runs} runs after a first")
    print("| impl | runs differing: dq / dk / dv | largest difference: dq / dk / dv | kernels |")
    print("|---|---|---|---|")
    for row in rows:
        counts = " / ".join(str(n) for n in row["differing_runs"].values())
        largest = " / ".join(f"{x:.1e}" for x in row["largest_difference"].values())
        print(f"| {row['impl']} | {counts} | {largest} | {'; '.join(name[:50] for name in row['kernels'])} |")


if __name__ == "__main__":
    main()
