"""Attention throughput on one GPU: flashformer's Triton kernels beside torch's SDPA backends.

flash-attention's grid: batch * seqlen = 16384 tokens, heads * head_dim = 2048, bf16. FLOPs of the
forward = 4 * batch * heads * seqlen^2 * head_dim, halved when causal; backward = 2.5 x forward.
Times are medians of ``triton.testing.do_bench`` after warm-up; every implementation runs on the same
inputs in the same process, and each cell also records ours' max abs difference from SDPA.

    python scripts/bench_attention.py --out bench.json            # head_dim 64 and 128, the full grid
    python scripts/bench_attention.py --head-dims 256 --heads-256 8
    python scripts/bench_attention.py --head-dims 128 --causal yes --seqlens 1024 --kernel-times 20

``--kernel-times N`` adds each cell's largest kernels (torch.profiler, ms per forward + backward), e.g.
how ours' backward splits between its dQ and dK/dV kernels against SDPA's. ``--cuda-graphs`` adds a
second table from CUDA-graph replays: device time alone, where a ~0.2 ms eager call also carries any
host time longer than do_bench's L2 flush.
``--rounds N`` times every implementation of a cell N times, in turn (A B C A B C ...), and reports the
medians: the same kernel timed twice in one run has read up to 10% apart on the H200 (BENCHMARKS.md).

``--varlen`` instead times a packed batch: seeded random document lengths (short and long ones, no
block-size multiples) summing exactly to --tokens, through flash_attn_varlen_func, beside ours dense at
the same total tokens with seqlen = the mean document length rounded to 64 (the headline ratio
varlen / dense@mean; the bar is >= 0.9, ideally 0.95) and seqlen = the longest document. FLOPs are
summed per document. With ours-tl in --impls the packed batch also runs on the portable tl kernels (on an
H200 ours varlen takes the Gluon forward). FlexAttention with a document mask (if in --impls and
--flex-head-dims) is the outside reference; the max diff is ours varlen against each document run through flash_attn_func alone.

    python scripts/bench_attention.py --varlen --doc-lengths lognormal --seed 0 --impls ours flex \
        --flex-head-dims 64 128 --out bench_varlen.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from tqdm import tqdm

from flashformer.kernels import (cu_seqlens_from_lengths, document_ids_from_cu_seqlens, flash_attn_func,
                                 flash_attn_varlen_func, force_kernel_impl)
from flashformer.profiling import benchmark_provenance, capture_cuda_graph, kernel_times

SDPA_BACKENDS = {
    "sdpa-flash": SDPBackend.FLASH_ATTENTION,
    "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION,
    "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION,
}
# SDPA's cuDNN kernels with torch.backends.cudnn.deterministic set (not an SDPA backend of its own, so "best SDPA"
# stays what a user gets by default). On the H200 the flag changes neither cuDNN's kernels nor its dQ's run-to-run
# differences (scripts/check_determinism.py): the column shows that a user has no deterministic cuDNN to pick.
CUDNN_DETERMINISTIC = "sdpa-cudnn-det"
DOC_SIGMA = 1.25  # lognormal spread: at mean 1024, 16k tokens hold documents of tens to thousands of tokens


def attention_flops(batch, heads, seqlen, head_dim, causal):
    flops = 4 * batch * heads * seqlen * seqlen * head_dim
    return flops / 2 if causal else flops


def _ours(q, k, v, causal):
    return flash_attn_func(q, k, v, causal=causal)


def _ours_nondeterministic(q, k, v, causal):
    return flash_attn_func(q, k, v, causal=causal, deterministic=False)


def _ours_tl(q, k, v, causal):
    """The portable tl kernels alone, where "ours" takes the Hopper Gluon kernels on an H200."""
    with force_kernel_impl("triton"):
        return flash_attn_func(q, k, v, causal=causal)


def _sdpa(backend):
    def run(q, k, v, causal):
        # SDPA wants (batch, heads, seqlen, head_dim); transposes are views, as a model would pass.
        with sdpa_kernel(backend):
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 is_causal=causal)
        return out.transpose(1, 2)
    return run


@contextlib.contextmanager
def cudnn_deterministic(enabled=True):
    """torch.backends.cudnn.deterministic set to ``enabled`` while the block runs (both passes read it at
    launch), then restored."""
    saved = torch.backends.cudnn.deterministic
    torch.backends.cudnn.deterministic = enabled
    try:
        yield
    finally:
        torch.backends.cudnn.deterministic = saved


def _flex(document_ids=None):
    """FlexAttention; with ``document_ids`` (per token of a (1, total) packed batch) no query sees another document."""
    from torch.nn.attention.flex_attention import and_masks, create_block_mask, flex_attention

    compiled = torch.compile(flex_attention, dynamic=False)
    masks = {}

    def causal_mod(b, h, qi, ki):
        return qi >= ki

    def document_mod(b, h, qi, ki):
        return document_ids[qi] == document_ids[ki]

    def run(q, k, v, causal):
        seqlen = q.shape[1]
        mods = ([causal_mod] if causal else []) + ([document_mod] if document_ids is not None else [])
        if mods and (seqlen, causal) not in masks:
            masks[seqlen, causal] = create_block_mask(and_masks(*mods), None, None, seqlen, seqlen)
        block_mask = masks.get((seqlen, causal))
        out = compiled(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=block_mask)
        return out.transpose(1, 2)
    return run


def document_lengths(tokens, kind="lognormal", seed=0, mean=1024):
    """Seeded random document lengths (ints >= 1) summing exactly to ``tokens``.

    uniform: integers in [1, 2 * mean); lognormal: mean ``mean``, sigma DOC_SIGMA, i.e. many short
    documents beside a few long ones that hold much of the batch, as packed pretraining data does.
    The document that crosses ``tokens`` is cut to fit.
    """
    if tokens < 1 or mean < 1:
        raise ValueError(f"tokens and mean must be >= 1, got {tokens}, {mean}")
    gen = torch.Generator().manual_seed(seed)
    draws = 2 * math.ceil(tokens / mean) + 8  # one round nearly always suffices

    def draw():
        if kind == "uniform":
            return torch.randint(1, 2 * mean, (draws,), generator=gen)
        if kind == "lognormal":  # mu = log(mean) - sigma^2 / 2 puts the distribution's mean at `mean`
            lengths = torch.empty(draws, dtype=torch.float64).log_normal_(math.log(mean) - DOC_SIGMA ** 2 / 2,
                                                                            DOC_SIGMA, generator=gen)
            return lengths.round().clamp(1, tokens).long()
        raise ValueError(f"unknown document length distribution {kind!r}")

    lengths, remaining = [], tokens
    while remaining:
        for n in draw().tolist():
            lengths.append(min(n, remaining))
            remaining -= lengths[-1]
            if not remaining:
                break
    return lengths


def dense_shapes(lengths):
    """{"mean": (batch, seqlen), "max": (batch, seqlen)}: the dense batches varlen is compared with, at (up to)
    the same total tokens; the mean length is rounded to a multiple of 64 as a dense benchmark would pick it."""
    tokens = sum(lengths)
    mean_len = max(64, round(tokens / len(lengths) / 64) * 64)
    return {"mean": (max(1, tokens // mean_len), mean_len), "max": (max(1, tokens // max(lengths)), max(lengths))}


def per_document_reference(q, k, v, lengths, causal):
    """Packed (total, heads, head_dim) attention run one document at a time through the dense kernel."""
    docs = zip(*(t.split(lengths) for t in (q, k, v)))
    return torch.cat([flash_attn_func(dq[None], dk[None], dv[None], causal=causal)[0] for dq, dk, dv in docs])


def time_fwd_bwd(fn, q, k, v, causal, grad_out, flops):
    """(TFLOP/s cell, forward output) of ``fn``; (None, None) when the backend refuses the shape.

    ``flops`` is the forward's; backward counts 2.5 x that. The forward is timed on inputs without
    requires_grad, the backward on fresh leaves, so dense, varlen and flex are timed alike.
    """
    import triton

    try:
        out = fn(q, k, v, causal)
        fwd_ms = triton.testing.do_bench(lambda: fn(q, k, v, causal), warmup=50, rep=200, return_mode="median")
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out_g = fn(*leaves, causal)
        bwd_ms = triton.testing.do_bench(lambda: out_g.backward(grad_out, retain_graph=True), warmup=50, rep=200,
                                         grad_to_none=leaves, return_mode="median")
    except RuntimeError as err:  # e.g. a backend without a kernel for this head_dim
        tqdm.write(f"  skipped: {str(err).splitlines()[0][:120]}")
        return None, None
    return {"fwd_tflops": flops / fwd_ms / 1e9, "bwd_tflops": 2.5 * flops / bwd_ms / 1e9,
            "fwd_ms": fwd_ms, "bwd_ms": bwd_ms}, out


def merge_rounds(cells):
    """One cell from the same implementation timed in several rounds: each rate the median over the rounds, with
    every round's rates kept and the spread (largest over smallest - 1) of each."""
    if len(cells) == 1:
        return cells[0]
    merged = {key: statistics.median(cell[key] for cell in cells) for key in cells[0]}
    merged["rounds"] = [{key: cell[key] for key in ("fwd_tflops", "bwd_tflops")} for cell in cells]
    merged["spread"] = {key: max(cell[key] for cell in cells) / min(cell[key] for cell in cells) - 1
                        for key in ("fwd_tflops", "bwd_tflops")}
    return merged


def time_graphed(fn, q, k, v, causal, grad_out, flops):
    """time_fwd_bwd's cell from CUDA-graph replays: device time alone. An eager call whose host path
    outlasts do_bench's L2 flush before it leaves the GPU idle inside the timed region, which a training
    step (whose host runs ahead) never sees. The backward is (forward + backward) - forward, both
    captured whole: autograd's backward kernels must be captured with the forward that made the graph."""
    import triton

    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    try:
        fwd, _ = capture_cuda_graph(lambda: fn(q, k, v, causal), warmups=3)
        fwd_bwd, _ = capture_cuda_graph(lambda: fn(*leaves, causal).backward(grad_out), warmups=3)
        fwd_ms = triton.testing.do_bench(fwd.replay, warmup=20, rep=200, return_mode="median")
        both_ms = triton.testing.do_bench(fwd_bwd.replay, warmup=20, rep=200, return_mode="median")
    except RuntimeError as err:  # a backend whose call cannot be captured
        tqdm.write(f"  graph capture failed: {str(err).splitlines()[0][:120]}")
        return None
    bwd_ms = both_ms - fwd_ms
    return {"fwd_tflops": flops / fwd_ms / 1e9, "bwd_tflops": 2.5 * flops / bwd_ms / 1e9, "fwd_ms": fwd_ms,
            "bwd_ms": bwd_ms}


def fwd_bwd_kernel_times(fn, q, k, v, causal, grad_out, iters, top=6):
    """The ``top`` kernels of one forward + backward of ``fn``: [(name, ms per call)], over ``iters``
    traced calls. Says which kernel of a backward holds the time (ours: dQ and dK/dV)."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]

    def step():
        for t in leaves:
            t.grad = None
        fn(*leaves, causal).backward(grad_out)

    step()
    times, _ = kernel_times(step, iters)
    return sorted(times.items(), key=lambda item: -item[1])[:top]


def kernel_times_table(results, names):
    """Markdown: per grid cell and implementation, its largest kernels (ms per forward + backward)."""
    lines = ["| head_dim | causal | seqlen | implementation | kernel | ms |", "|---|---|---|---|---|---|"]
    for r in results:
        for n in names:
            for kernel, ms in r.get(n, {}).get("kernels", []):
                lines.append(f"| {r['head_dim']} | {'yes' if r['causal'] else 'no'} | {r['seqlen']} | {n} | "
                             f"{kernel[:60]} | {ms:.3f} |")
    return "\n".join(lines)


def heads_for(args, head_dim):
    return args.heads_256 if head_dim == 256 else args.width // head_dim


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--tokens", type=int, default=16384, help="batch * seqlen; with --varlen, the packed total")
    parser.add_argument("--width", type=int, default=2048, help="heads * head_dim")
    parser.add_argument("--heads-256", type=int, default=8, help="heads at head_dim 256 (flash-attn uses 8)")
    parser.add_argument("--impls", nargs="+", default=["ours", "ours-nondet", *SDPA_BACKENDS, "flex"],
                        help="ours-nondet: deterministic=False (the backward accumulates dQ by TMA reductions); "
                             f"{CUDNN_DETERMINISTIC}: SDPA cuDNN with torch.backends.cudnn.deterministic set")
    parser.add_argument("--flex-seqlens", type=int, nargs="+", default=[1024, 4096, 16384],
                        help="FlexAttention compiles per shape: only these lengths")
    parser.add_argument("--flex-head-dims", type=int, nargs="+", default=[128])
    parser.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    parser.add_argument("--varlen", action="store_true", help="time a packed batch of documents instead of the grid")
    parser.add_argument("--doc-lengths", choices=["uniform", "lognormal"], default="lognormal")
    parser.add_argument("--doc-mean", type=int, default=1024, help="mean document length of the distribution")
    parser.add_argument("--seed", type=int, default=0, help="seed of the document lengths")
    parser.add_argument("--out", default="bench_attention.json")
    parser.add_argument("--plot", help="also draw the grid's TFLOP/s against seqlen into this PNG (needs matplotlib)")
    parser.add_argument("--kernel-times", type=int, default=0, metavar="N",
                        help="also trace N forward + backward calls per grid cell and implementation and list "
                             "their largest kernels (torch.profiler)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="time every implementation of a cell this many times, in turn; each rate is the median "
                             "of the rounds, and the table gains the largest spread between rounds")
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="also time each grid cell from CUDA-graph replays (device time, no host path) and "
                             "print a second table")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    causals = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    record = benchmark_provenance()
    warm_up_gpu()
    if args.varlen:
        record["varlen"] = run_varlen(args, causals)
        table = varlen_table(record["varlen"])
    else:
        record["results"], names = run_grid(args, causals)
        table = markdown_table(record["results"], names)
        if args.kernel_times:
            table = kernel_times_table(record["results"], names) + "\n\n" + table
        if args.cuda_graphs:
            table += ("\n\nCUDA-graph replays (device time only):\n\n"
                      + markdown_table(graph_rows(record["results"], names), names))
        if args.plot and plot_grid(record["results"], names, args.plot):
            print(f"wrote {args.plot}")
    with open(args.out, "w") as f:
        json.dump({**record, "autotuned_configs": autotuned_configs()}, f, indent=1)
    print(table)


def warm_up_gpu(seconds=2.0):
    """Matmuls until the clocks have ramped up: on a cold H200 the first cell times at about half speed
    (the d64 forward at 512 read 140 TFLOP/s where the same kernel reads 262 right after)."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ a
        torch.cuda.synchronize()


def run_grid(args, causals):
    """(rows of the dense grid, implementation names in column order)."""
    impls = {"ours": _ours, "ours-nondet": _ours_nondeterministic, "ours-tl": _ours_tl,
             **{name: _sdpa(b) for name, b in SDPA_BACKENDS.items()},
             CUDNN_DETERMINISTIC: _sdpa(SDPBackend.CUDNN_ATTENTION)}
    if "flex" in args.impls:
        impls["flex"] = _flex()
    impls = {name: fn for name, fn in impls.items() if name in args.impls}
    cells = [(d, c, s) for d in args.head_dims for c in causals for s in args.seqlens]
    results = []
    for head_dim, causal, seqlen in tqdm(cells, desc="attention grid"):
        batch = max(1, args.tokens // seqlen)
        heads = heads_for(args, head_dim)
        q, k, v = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        grad_out = torch.randn_like(q)
        flops = attention_flops(batch, heads, seqlen, head_dim, causal)
        row = {"head_dim": head_dim, "causal": causal, "seqlen": seqlen, "batch": batch, "heads": heads}
        outputs, rounds = {}, {}
        for _ in range(args.rounds):  # the implementations in turn, round after round
            for name, fn in impls.items():
                if name == "flex" and (seqlen not in args.flex_seqlens or head_dim not in args.flex_head_dims):
                    continue
                with cudnn_deterministic(name == CUDNN_DETERMINISTIC):
                    cell, out = time_fwd_bwd(fn, q, k, v, causal, grad_out, flops)
                if cell is not None:
                    outputs.setdefault(name, out)
                    rounds.setdefault(name, []).append(cell)
        for name, cells_of_rounds in rounds.items():
            row[name] = cell = merge_rounds(cells_of_rounds)
            fn = impls[name]
            with cudnn_deterministic(name == CUDNN_DETERMINISTIC):
                if args.kernel_times:
                    cell["kernels"] = fwd_bwd_kernel_times(fn, q, k, v, causal, grad_out, args.kernel_times)
                if args.cuda_graphs:
                    cell["graph"] = time_graphed(fn, q, k, v, causal, grad_out, flops)
        # against the first SDPA backend that ran (all compute the same exact attention)
        sdpa_ran = [name for name in SDPA_BACKENDS if name in outputs]
        if "ours" in outputs and sdpa_ran:
            row["max_abs_diff_vs_sdpa"] = (outputs["ours"].float() - outputs[sdpa_ran[0]].float()).abs().max().item()
            row["max_abs_diff_against"] = sdpa_ran[0]
        results.append(row)
        tqdm.write(json.dumps(row))
    return results, list(impls)


def run_varlen(args, causals):
    """The "varlen" JSON section: drawn lengths, dense shapes, and per (head_dim, causal) a row of
    ours varlen, ours dense@mean / dense@max, flex with a document mask, ratios and the max diff."""
    lengths = document_lengths(args.tokens, args.doc_lengths, args.seed, args.doc_mean)
    cu_seqlens = cu_seqlens_from_lengths(lengths).cuda()
    max_len, shapes = max(lengths), dense_shapes(lengths)
    flex = _flex(document_ids_from_cu_seqlens(cu_seqlens)) if "flex" in args.impls else None

    def varlen(q, k, v, causal):
        return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, causal=causal)

    def flex_packed(q, k, v, causal):  # the packed tokens as one (1, total) sequence
        return flex(q[None], k[None], v[None], causal)[0]

    def randn(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16)

    rows = []
    for head_dim, causal in tqdm([(d, c) for d in args.head_dims for c in causals], desc="varlen"):
        heads = heads_for(args, head_dim)
        row = {"head_dim": head_dim, "causal": causal, "docs": len(lengths), "tokens": args.tokens, "heads": heads}
        q, k, v, grad_out = (randn(args.tokens, heads, head_dim) for _ in range(4))
        flops = sum(attention_flops(1, heads, n, head_dim, causal) for n in lengths)
        cell, out = time_fwd_bwd(varlen, q, k, v, causal, grad_out, flops)
        if cell is not None:
            row["ours-varlen"] = cell
            ref = per_document_reference(q, k, v, lengths, causal)
            row["max_abs_diff_vs_per_doc"] = (out.float() - ref.float()).abs().max().item()
        if "ours-tl" in args.impls:  # the portable kernels on the same packed batch, where ours is Gluon's
            with force_kernel_impl("triton"):
                row["ours-tl-varlen"], _ = time_fwd_bwd(varlen, q, k, v, causal, grad_out, flops)
        if flex is not None and head_dim in args.flex_head_dims:
            row["flex-document"], _ = time_fwd_bwd(flex_packed, q, k, v, causal, grad_out, flops)
        for name, (batch, seqlen) in shapes.items():
            dq, dk, dv, dgrad = (randn(batch, seqlen, heads, head_dim) for _ in range(4))
            dense_flops = attention_flops(batch, heads, seqlen, head_dim, causal)
            cell, _ = time_fwd_bwd(_ours, dq, dk, dv, causal, dgrad, dense_flops)
            row[f"ours-dense@{name}"] = cell and {"batch": batch, "seqlen": seqlen, **cell}
        if row.get("ours-varlen") and row.get("ours-dense@mean"):
            row["varlen_over_dense_mean"] = [row["ours-varlen"][p] / row["ours-dense@mean"][p]
                                             for p in ("fwd_tflops", "bwd_tflops")]
        rows.append(row)
        tqdm.write(json.dumps(row))
    return {"distribution": args.doc_lengths, "doc_mean": args.doc_mean, "seed": args.seed, "tokens": args.tokens,
            "lengths": lengths, "dense_shapes": shapes, "results": rows}


def autotuned_configs():
    """The config each of our autotuned kernels picked, per autotune key (recorded with the results, so
    that a run's numbers can be traced to its tiles)."""
    from flashformer.kernels import flash_bwd, flash_fwd

    tuners = {"fwd": flash_fwd._attn_fwd_tuned, "bwd_dkdv": flash_bwd._bwd_dkdv_tuned, "bwd_dq": flash_bwd._bwd_dq_tuned}
    return {name: {str(key): str(config) for key, config in tuner.cache.items()} for name, tuner in tuners.items()}


def markdown_table(results, names):
    """Fwd / bwd TFLOP/s per implementation, plus ours over the best SDPA backend."""
    spread = any("spread" in r.get(n, {}) for r in results for n in names)
    head = ("| head_dim | causal | seqlen | batch | " + " | ".join(names) + " | ours / best SDPA (fwd, bwd) | max diff |"
            + (" largest spread between rounds (fwd, bwd) |" if spread else ""))
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        cells = []
        for n in names:
            cells.append(f"{r[n]['fwd_tflops']:.0f} / {r[n]['bwd_tflops']:.0f}" if n in r else "–")
        sdpa = [r[n] for n in SDPA_BACKENDS if n in r]
        ratio = "–"
        if "ours" in r and sdpa:
            best_f = max(s["fwd_tflops"] for s in sdpa)
            best_b = max(s["bwd_tflops"] for s in sdpa)
            ratio = f"{r['ours']['fwd_tflops'] / best_f:.2f}, {r['ours']['bwd_tflops'] / best_b:.2f}"
        diff = r.get("max_abs_diff_vs_sdpa", math.nan)
        line = (f"| {r['head_dim']} | {'yes' if r['causal'] else 'no'} | {r['seqlen']} | {r['batch']} | "
                + " | ".join(cells) + f" | {ratio} | {diff:.1e} |")
        if spread:
            spreads = [r[n]["spread"] for n in names if "spread" in r.get(n, {})]
            line += f" {max(x['fwd_tflops'] for x in spreads):.1%}, {max(x['bwd_tflops'] for x in spreads):.1%} |"
        lines.append(line)
    return "\n".join(lines)


def graph_rows(results, names):
    """The grid's rows with each implementation's cell replaced by its CUDA-graph cell (none where the
    capture failed)."""
    return [{**{key: value for key, value in r.items() if key not in names},
             **{n: r[n]["graph"] for n in names if r.get(n, {}).get("graph")}} for r in results]


def plot_grid(results, names, path):
    """TFLOP/s against seqlen, one line per implementation: a row of panels per (head_dim, causal),
    forward left, backward right. Returns False (and writes nothing) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    groups = sorted({(r["head_dim"], r["causal"]) for r in results})
    fig, axes = plt.subplots(len(groups), 2, figsize=(10, 3.2 * len(groups)), squeeze=False, sharex=True)
    for row, (head_dim, causal) in enumerate(groups):
        cells = sorted((r for r in results if (r["head_dim"], r["causal"]) == (head_dim, causal)),
                       key=lambda r: r["seqlen"])
        for col, (key, label) in enumerate((("fwd_tflops", "forward"), ("bwd_tflops", "backward"))):
            ax = axes[row][col]
            for name in names:
                points = [(r["seqlen"], r[name][key]) for r in cells if name in r]
                if points:
                    ax.plot(*zip(*points), marker="o", label=name)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{label}, head_dim {head_dim}, {'causal' if causal else 'full'}", fontsize=10)
            ax.set_ylabel("TFLOP/s")
            ax.grid(True, alpha=0.3)
    for ax in axes[-1]:
        ax.set_xlabel("seqlen (batch x seqlen = const)")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def varlen_table(section):
    """Fwd / bwd TFLOP/s of the varlen section, a caption line with the drawn lengths and dense shapes."""
    def tflops(cell):
        return f"{cell['fwd_tflops']:.0f} / {cell['bwd_tflops']:.0f}" if cell else "–"

    lengths, shapes = section["lengths"], section["dense_shapes"]
    caption = (f"{len(lengths)} {section['distribution']} documents (seed {section['seed']}), lengths "
               f"{min(lengths)}..{max(lengths)}; dense@mean = {shapes['mean'][0]} x {shapes['mean'][1]}, "
               f"dense@max = {shapes['max'][0]} x {shapes['max'][1]} (batch x seqlen)")
    head = ("| head_dim | causal | docs | tokens | ours varlen | ours tl varlen | ours dense@mean | ours dense@max "
            "| varlen / dense@mean (fwd, bwd) | flex document mask | max diff vs per-doc |")
    lines = [caption, "", head, "|" + "---|" * (head.count("|") - 1)]
    for r in section["results"]:
        ratio = ", ".join(f"{x:.2f}" for x in r["varlen_over_dense_mean"]) if "varlen_over_dense_mean" in r else "–"
        lines.append(f"| {r['head_dim']} | {'yes' if r['causal'] else 'no'} | {r['docs']} | {r['tokens']} | "
                     f"{tflops(r.get('ours-varlen'))} | {tflops(r.get('ours-tl-varlen'))} | "
                     f"{tflops(r.get('ours-dense@mean'))} | "
                     f"{tflops(r.get('ours-dense@max'))} | {ratio} | {tflops(r.get('flex-document'))} | "
                     f"{r.get('max_abs_diff_vs_per_doc', math.nan):.1e} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
