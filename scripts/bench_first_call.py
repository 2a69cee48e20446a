"""A fresh process's first attention step at shapes outside the offline table: its wall time, compiles
included (on an empty cache, and again after another shape's run), then its speed beside the nearest
tuned shape's (one GPU run).

Each shape runs in a child process of its own with an empty Triton cache (TRITON_CACHE_DIR in a new
temporary directory), so its first forward + backward compiles every kernel it launches, as a user's first
training step does. The child then times the shape and the tuned shapes beside it (same head_dim and mask, window
and softcap included, at the power-of-two lengths below and at or above it, the latter picking its tiles,
the same number of tokens) with do_bench: a window or a softcap is compared with itself at a tuned
length, not with plain causal attention, which does other work per tile. TFLOP/s count the (query, key)
pairs each mask attends; the kernels' device time alone (torch.profiler) is compared too, so that a short
call whose host time sets its pace reads apart from a slower kernel, and beside it the same ratio for SDPA's
cuDNN kernels (plain and causal masks): what a length between the table's costs any tiled kernel. A second cache, filled by a
process that ran the tuned shape, then times the shape's first step as a user's machine sees it after
earlier runs (launchers and other specialisations built; this shape's kernels not). With
--without-compile-ahead a third process, on an empty cache too, times the first step with
FLASHFORMER_COMPILE_AHEAD=0: the backward's kernels compiled in turn after the forward, not beside it.

    python3 scripts/bench_first_call.py
    python3 scripts/bench_first_call.py --shapes 23x704x128:causal 5x2500x128:window256 --out first_call.json
    python3 scripts/bench_first_call.py --shapes 23x704x128:causal 2x5000x64:causal --without-compile-ahead

Shapes are BATCHxSEQLENxHEAD_DIM[:MASK] with MASK one of full, causal (the default), windowW (causal
with W keys to the left) or softcapC (causal, logits soft-capped at C); heads are 2048 / head_dim.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time

import torch

from flashformer.profiling import check_specs

# The example of 23 x 704 at head_dim 128, causal, beside lengths between the table's powers of two, each
# mask family on both kernel paths (head_dim 128: Gluon on sm_90; 64: the tl kernels' table), head dims
# that pad (80, 96) and the widest one.
DEFAULT_SHAPES = ["23x704x128:causal", "3x3000x128:full", "2x5000x64:causal", "5x2500x128:window256",
                  "4x3000x128:softcap30", "3x2500x64:window256", "3x2500x64:softcap30", "9x900x96:causal",
                  "1x12000x80:causal", "2x3500x256:causal"]
HEADS_TIMES_HEAD_DIM = 2048


def parse_shape(spec):
    """(batch, seqlen, head_dim, mask options) of one BATCHxSEQLENxHEAD_DIM[:MASK] spec."""
    dims, _, mask = spec.partition(":")
    try:
        batch, seqlen, head_dim = (int(n) for n in dims.split("x"))
    except ValueError:
        raise ValueError(f"--shapes: {spec!r} is not BATCHxSEQLENxHEAD_DIM[:MASK]") from None
    mask = mask or "causal"
    if mask in ("full", "causal"):
        options = {"causal": mask == "causal"}
    elif mask.startswith("window") and mask[6:].isdigit():
        options = {"causal": True, "window_size": (int(mask[6:]), 0)}
    elif mask.startswith("softcap"):
        options = {"causal": True, "softcap": float(mask[7:])}
    else:
        raise ValueError(f"--shapes: mask {mask!r} of {spec!r} is not full, causal, windowW or softcapC")
    if min(batch, seqlen, head_dim) < 1:
        raise ValueError(f"--shapes: {spec!r} needs batch, seqlen and head_dim >= 1")
    return batch, seqlen, head_dim, options


def mask_name(spec):
    """The MASK part of a BATCHxSEQLENxHEAD_DIM[:MASK] spec (causal where it is left out)."""
    return spec.partition(":")[2] or "causal"


def attended_pairs(seqlen, causal, window_left=-1):
    """(query, key) pairs one head of one sequence attends (square, bottom-right aligned)."""
    if not causal:
        return seqlen * seqlen
    keys = torch.arange(seqlen) + 1  # query i sees keys 0..i
    if window_left >= 0:
        keys = keys.clamp(max=window_left + 1)
    return int(keys.sum())


def tuned_neighbours(batch, seqlen):
    """(batch, seqlen) of the tuned shapes beside this one, same tokens: the power of two below its length
    and the one at or above it (whose tiles it launches: the kernels' seqlen bucket); one shape where the
    length is a power of two."""
    above = 2 ** math.ceil(math.log2(seqlen))
    lengths = sorted({max(1, above // 2) if above > seqlen else above, above})
    return [(max(1, batch * seqlen // tuned), tuned) for tuned in lengths]


def nearest(seqlen, neighbours):
    """The neighbour whose length is nearest this one's as a ratio (log2 distance)."""
    return min(neighbours, key=lambda shape: abs(math.log2(shape[1] / seqlen)))


# Forward + backward calls traced for their kernels' device time.
KERNEL_TIME_CALLS = 20


def time_shape(batch, seqlen, head_dim, options, steady=True):
    """(first step's wall seconds, steady forward + backward TFLOP/s, forward TFLOP/s, forward + backward
    TFLOP/s of the kernels' device time alone), the rates None without ``steady``, of one shape in this
    process. A short call whose host time exceeds its kernels' shows a wall rate below the kernel rate."""
    import triton

    from flashformer.kernels import flash_attn_func
    from flashformer.profiling import kernel_times

    heads = max(1, HEADS_TIMES_HEAD_DIM // head_dim)
    q, k, v = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    grad_out = torch.randn_like(q)
    torch.cuda.synchronize()
    start = time.perf_counter()
    flash_attn_func(q, k, v, **options).backward(grad_out)
    torch.cuda.synchronize()
    first = time.perf_counter() - start
    if not steady:
        return first, None, None, None

    def step():
        flash_attn_func(q, k, v, **options).backward(grad_out)

    def forward():
        with torch.no_grad():
            flash_attn_func(q, k, v, **options)

    def fresh_step():  # gradients written, not accumulated: no add kernels beside ours
        q.grad = k.grad = v.grad = None
        step()

    ms = triton.testing.do_bench(step, warmup=25, rep=100, grad_to_none=[q, k, v], return_mode="median")
    forward_ms = triton.testing.do_bench(forward, warmup=25, rep=100, return_mode="median")
    kernel_ms = sum(kernel_times(fresh_step, KERNEL_TIME_CALLS)[0].values())
    pairs = attended_pairs(seqlen, options["causal"], options.get("window_size", (-1, 0))[0])
    forward_flops = 4 * batch * heads * pairs * head_dim
    step_flops = 3.5 * forward_flops  # backward 2.5x the forward
    return first, step_flops / ms / 1e9, forward_flops / forward_ms / 1e9, step_flops / kernel_ms / 1e9


def cudnn_kernel_tflops(batch, seqlen, head_dim, causal):
    """Forward + backward TFLOP/s of SDPA's cuDNN kernels' device time alone at one shape: the control for the
    ratio to the nearest tuned shape (how far any tiled kernel falls at this length against that one)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from flashformer.profiling import kernel_times

    heads = max(1, HEADS_TIMES_HEAD_DIM // head_dim)
    q, k, v = (torch.randn(batch, heads, seqlen, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    grad_out = torch.randn_like(q)

    def fresh_step():
        q.grad = k.grad = v.grad = None
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            F.scaled_dot_product_attention(q, k, v, is_causal=causal).backward(grad_out)

    for _ in range(3):  # cuDNN builds its plans on the first calls
        fresh_step()
    kernel_ms = sum(kernel_times(fresh_step, KERNEL_TIME_CALLS)[0].values())
    return 3.5 * 4 * batch * heads * attended_pairs(seqlen, causal) * head_dim / kernel_ms / 1e9


def child(spec):
    """One shape and the tuned shapes beside it, timed in this (fresh) process; one JSON line on stdout."""
    start = time.perf_counter()
    import flashformer.kernels  # noqa: F401  (import time is the user's too, but reported apart)

    torch.ones(1, device="cuda").sum().item()  # CUDA's own start-up is not the kernels'
    setup_s = time.perf_counter() - start
    batch, seqlen, head_dim, options = parse_shape(spec)
    first_s, tflops, forward_tflops, kernel_tflops = time_shape(batch, seqlen, head_dim, options)
    row = {"shape": spec, "setup_s": setup_s, "first_step_s": first_s, "tflops": tflops,
           "forward_tflops": forward_tflops, "kernel_tflops": kernel_tflops, "tuned": []}
    neighbours = tuned_neighbours(batch, seqlen)
    for tuned_batch, tuned_seqlen in neighbours:
        tuned_first_s, tuned_tflops, tuned_forward_tflops, tuned_kernel_tflops = time_shape(
            tuned_batch, tuned_seqlen, head_dim, options)
        row["tuned"].append({"shape": f"{tuned_batch}x{tuned_seqlen}x{head_dim}:{mask_name(spec)}",
                             "first_step_s": tuned_first_s, "tflops": tuned_tflops,
                             "forward_tflops": tuned_forward_tflops, "kernel_tflops": tuned_kernel_tflops})
    near = neighbours.index(nearest(seqlen, neighbours))
    row["nearest_tuned"] = row["tuned"][near]["shape"]
    if set(options) == {"causal"}:  # SDPA's cuDNN takes plain and causal masks, not windows or softcap
        row["cudnn_kernel_tflops"] = cudnn_kernel_tflops(batch, seqlen, head_dim, options["causal"])
        row["tuned"][near]["cudnn_kernel_tflops"] = cudnn_kernel_tflops(*neighbours[near], head_dim, options["causal"])
    row["tuned_shape"] = row["tuned"][-1]["shape"]  # the one whose tiles it takes, cached by --child-warm
    print(json.dumps(row))


def warm(spec):
    """The first step of one shape only, so that its compiles land in the Triton cache."""
    torch.ones(1, device="cuda").sum().item()
    print(json.dumps({"shape": spec, "first_step_s": time_shape(*parse_shape(spec), steady=False)[0]}))


def run_child(flag, spec, cache, timeout_s, env=None):
    """The JSON line of a child process (``flag`` SPEC) whose Triton cache is ``cache`` (``env``: more
    environment variables), or an error row."""
    try:
        done = subprocess.run([sys.executable, os.path.abspath(__file__), flag, spec],
                              env=dict(os.environ, **(env or {}), TRITON_CACHE_DIR=cache), capture_output=True,
                              text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"shape": spec, "error": f"not done within --timeout {timeout_s:g} s"}
    if done.returncode != 0:
        return {"shape": spec, "error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else
                f"exit {done.returncode}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_fresh(spec, timeout_s, warm_cache=True, without_compile_ahead=False):
    """One shape's row: its child run on an empty Triton cache and, with ``warm_cache``, its first step
    again in a fresh process whose cache holds another shape's compiles (its tuned shape's, from a
    process before it): a user's machine after earlier runs, where the launchers and the kernels of
    other specialisations are already built. ``without_compile_ahead``: also its first step on an empty
    cache with FLASHFORMER_COMPILE_AHEAD=0."""
    with tempfile.TemporaryDirectory() as cache:
        row = run_child("--child", spec, cache, timeout_s)
    if without_compile_ahead and "error" not in row:
        with tempfile.TemporaryDirectory() as cache:
            alone = run_child("--child-warm", spec, cache, timeout_s, env={"FLASHFORMER_COMPILE_AHEAD": "0"})
        row["first_step_without_compile_ahead_s"] = alone.get("first_step_s")
    if warm_cache and "error" not in row:
        with tempfile.TemporaryDirectory() as cache:
            warmed = run_child("--child-warm", row["tuned_shape"], cache, timeout_s)
            again = warmed if "error" in warmed else run_child("--child-warm", spec, cache, timeout_s)
        row["first_step_after_other_shape_s"] = again.get("first_step_s")
    return row


def _seconds(value):
    return "-" if value is None else f"{value:.1f}"


def cudnn_ratio(row, nearest_row):
    """cuDNN's kernel rate at the shape over its rate at the nearest tuned shape, "-" where not timed."""
    if "cudnn_kernel_tflops" not in row or "cudnn_kernel_tflops" not in nearest_row:
        return "-"
    return f"{row['cudnn_kernel_tflops'] / nearest_row['cudnn_kernel_tflops']:.2f}"


def markdown_table(rows):
    lines = ["| shape | first step (s), empty cache | without compile-ahead | after another shape's run | TFLOP/s "
             "(fwd+bwd / fwd) | tuned shapes beside it: TFLOP/s (fwd+bwd / fwd) | ratio to the nearest | "
             "ratio to the one above | kernels alone: ratio to the nearest | cuDNN's kernels: the same ratio |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['shape']} | error: {row['error'][:80]} | | | | | | | | |")
            continue
        tuned = {t["shape"]: t for t in row["tuned"]}
        beside = ", ".join(f"{t['shape']} {t['tflops']:.0f} / {t['forward_tflops']:.0f}" for t in row["tuned"])
        lines.append(f"| {row['shape']} | {row['first_step_s']:.1f} | "
                     f"{_seconds(row.get('first_step_without_compile_ahead_s'))} | "
                     f"{_seconds(row.get('first_step_after_other_shape_s'))} | "
                     f"{row['tflops']:.0f} / {row['forward_tflops']:.0f} | {beside} | "
                     f"{row['tflops'] / tuned[row['nearest_tuned']]['tflops']:.2f} | "
                     f"{row['tflops'] / tuned[row['tuned_shape']]['tflops']:.2f} | "
                     f"{row['kernel_tflops'] / tuned[row['nearest_tuned']]['kernel_tflops']:.2f} | "
                     f"{cudnn_ratio(row, tuned[row['nearest_tuned']])} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES, metavar="BxSxD[:MASK]")
    parser.add_argument("--out", default="bench_first_call.json")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per shape's child process")
    parser.add_argument("--no-warm-cache", action="store_true",
                        help="skip each shape's second first step (cache of another shape's run)")
    parser.add_argument("--without-compile-ahead", action="store_true",
                        help="also time each shape's first step, empty cache, with FLASHFORMER_COMPILE_AHEAD=0")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--child-warm", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args.child)
    if args.child_warm:
        return warm(args.child_warm)
    check_specs(parser, args.shapes, parse_shape)
    if not torch.cuda.is_available():
        raise SystemExit("bench_first_call.py times CUDA kernels: no CUDA device here")
    from tqdm import tqdm

    from flashformer.profiling import benchmark_provenance

    rows, provenance = [], benchmark_provenance()
    for spec in tqdm(args.shapes, desc="shapes"):
        rows.append(run_fresh(spec, args.timeout, warm_cache=not args.no_warm_cache,
                              without_compile_ahead=args.without_compile_ahead))
        tqdm.write(json.dumps(rows[-1]))
        with open(args.out, "w") as f:  # after every shape: a run cut short keeps what it measured
            json.dump({**provenance, "rows": rows}, f, indent=1)
    print(markdown_table(rows))


if __name__ == "__main__":
    main()
