"""Decoding benchmark: one query token against a KV cache, our split-KV kernel against SDPA.

``python scripts/bench_decode.py --out runs/bench_decode.json`` (CUDA only). 32 query heads on 8 kv
heads, head_dim 128, bf16, seqlen_q 1, every cache fully used. Times (median of
triton.testing.do_bench, which flushes L2 between runs):

* ours: the kernel launcher on a contiguous cache; ours paged: the same cache as shuffled pages of
  256; ours API: flash_attn_with_kvcache (contiguous) with cache_seqlens as an int, as the model's
  decoding loop calls it (argument checks, no host sync); "ours API, tensor lengths": the same with int32
  (batch,) cache_seqlens, as flash-attn users call it;
* SDPA with the flash and cuDNN backends, q (b, 32, 1, 128) against k/v (b, 8, L, 128),
  enable_gqa=True;
* "graph": ours and SDPA cuDNN captured in a CUDA graph and replayed, i.e. the device time alone
  (no Python launch cost), as a decoding loop under CUDA graphs would see it; "ours graph ALiBi" the same
  kernel with ALiBi slopes (its bias per logit);
* host µs: wall time per call of the launcher (ours) and of SDPA's cuDNN call when the GPU is not the
  bottleneck;
  ``--host-profile TOP`` also prints where that time goes: a breakdown by part, and the TOP functions of most
  host time per call of the launcher and of the API (cProfile of calls queued behind a GPU sleep, batch 1, 16k).

TB/s = bytes of K and V read / time. Each cell checks ours (both layouts) against SDPA flash. Cells
whose tensors would pass MEMORY_LIMIT are skipped. Prints a markdown table last; writes JSON to --out.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from tqdm import tqdm

from flashformer.kernels import decode
from flashformer.kernels.cache_append import (rotate_and_append, rotate_and_append_packed,
                                              rotate_and_append_packed_reference, rotate_and_append_reference)
from flashformer.kernels.decode import choose_num_splits, decode_attention
from flashformer.kernels.kvcache import flash_attn_with_kvcache
from flashformer.profiling import benchmark_provenance, capture_cuda_graph, host_profile

HEADS_Q, HEADS_KV, HEAD_DIM = 32, 8, 128
PAGE_SIZE = 256
DTYPE = torch.bfloat16
MEMORY_LIMIT = 60e9  # peak bytes of one cell: the cache plus one other layout of it
METHODS = ("ours", "ours paged", "ours API", "ours API, tensor lengths", "SDPA flash", "SDPA cuDNN", "ours graph",
           "ours graph ALiBi", "SDPA cuDNN graph")
HOST_CALLS = 200


def _time(fn):
    """(median ms, output) of fn(), or (None, error text) when it cannot run this shape."""
    try:
        out = fn()
        return triton.testing.do_bench(fn, return_mode="median"), out
    except RuntimeError as error:  # e.g. a backend that refuses the shape
        return None, str(error).splitlines()[0]


def _time_graphed(fn):
    """_time of fn captured in a CUDA graph and replayed (same output tensor every replay)."""
    try:
        return _time(_graphed(fn))
    except RuntimeError as error:  # a capture failure is a result to report, not a crash
        return None, str(error).splitlines()[0]


def _graphed(fn):
    graph, out = capture_cuda_graph(fn)

    def replay():
        graph.replay()
        return out
    return replay


def _host_us(fn):
    """Microseconds of host time per call, over HOST_CALLS calls queued without waiting."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(HOST_CALLS):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / HOST_CALLS * 1e6


def _median_host_us(fn, repeats=7):
    """Median over ``repeats`` rounds of _host_us: one round is noisy on a shared host."""
    times = sorted(_host_us(fn) for _ in range(repeats))
    return times[len(times) // 2]


def parse_launch_config(spec):
    """(BLOCK_N, num_warps, num_stages) of a BLOCK_NxWARPSxSTAGES spec."""
    try:
        block_n, warps, stages = (int(n) for n in spec.split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{spec!r} is not BLOCK_NxWARPSxSTAGES") from None
    return block_n, warps, stages


@contextlib.contextmanager
def launch_config(config):
    """decode.py's kernel launched with ``config`` (BLOCK_N, num_warps, num_stages) in place of
    _launch_config's choice; its plans and compiled launches are dropped on the way in and out."""
    chosen = decode._launch_config

    def forget():
        decode._PLANS.clear()
        decode._decode_launch.compiled.clear()
    decode._launch_config = lambda device, head_dim_pad, page_size: config
    forget()
    try:
        yield
    finally:
        decode._launch_config = chosen
        forget()


def run_cell(batch, length, split_sweep=(), launch_configs=()):
    """Times and max |ours - SDPA flash| of one (batch, cache length) cell; with ``split_sweep``, also the
    CUDA-graph TB/s of ours at each of those split counts; with ``launch_configs``, at each of those
    (BLOCK_N, num_warps, num_stages) with the automatic splits."""
    device = torch.device("cuda")
    scale = HEAD_DIM**-0.5
    q = torch.randn(batch, 1, HEADS_Q, HEAD_DIM, device=device, dtype=DTYPE)
    k_cache, v_cache = (torch.randn(batch, length, HEADS_KV, HEAD_DIM, device=device, dtype=DTYPE) for _ in range(2))
    seqlens = torch.full((batch,), length, dtype=torch.int32, device=device)
    times, outs = {}, {}
    with torch.inference_mode():
        def ours():
            return decode_attention(q, k_cache, v_cache, seqlens, None, length, scale, -1, 0, 0.0)[0]
        times["ours"], outs["ours"] = _time(ours)
        times["ours graph"], outs["ours graph"] = _time_graphed(ours)
        slopes = torch.rand(HEADS_Q, device=device)
        times["ours graph ALiBi"], _ = _time_graphed(lambda: decode_attention(
            q, k_cache, v_cache, seqlens, None, length, scale, -1, 0, 0.0, alibi_slopes=slopes)[0])
        host_us = _median_host_us(ours)
        times["ours API"], _ = _time(lambda: flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=length,
                                                                     causal=True))
        times["ours API, tensor lengths"], _ = _time(lambda: flash_attn_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=seqlens, causal=True))
        sweep_ms = {splits: _time_graphed(lambda s=splits: decode_attention(
            q, k_cache, v_cache, seqlens, None, length, scale, -1, 0, 0.0, s)[0])[0] for splits in split_sweep}
        config_ms, config_diffs = {}, {}
        for config in launch_configs:
            with launch_config(config):
                try:
                    config_ms[config], out = _time_graphed(ours)
                except Exception as error:  # e.g. Triton's OutOfResources: a config too big for the SM
                    config_ms[config], out = None, str(error).splitlines()[0]
            config_diffs[config] = (out.float() - outs["ours"].float()).abs().max().item() \
                if config_ms[config] is not None else out

        pages = length // PAGE_SIZE
        table = torch.randperm(batch * pages, device=device).view(batch, pages)
        k_pool, v_pool = (torch.empty(batch * pages, PAGE_SIZE, HEADS_KV, HEAD_DIM, device=device, dtype=DTYPE)
                          for _ in range(2))
        k_pool[table] = k_cache.view(batch, pages, PAGE_SIZE, HEADS_KV, HEAD_DIM)
        v_pool[table] = v_cache.view(batch, pages, PAGE_SIZE, HEADS_KV, HEAD_DIM)
        table = table.int()
        times["ours paged"], outs["ours paged"] = _time(lambda: decode_attention(
            q, k_pool, v_pool, seqlens, table, length, scale, -1, 0, 0.0)[0])
        del k_pool, v_pool

        q_sdpa = q.transpose(1, 2)
        k_sdpa, v_sdpa = k_cache.transpose(1, 2).contiguous(), v_cache.transpose(1, 2).contiguous()
        del k_cache, v_cache
        for name, backend in (("SDPA flash", SDPBackend.FLASH_ATTENTION), ("SDPA cuDNN", SDPBackend.CUDNN_ATTENTION)):
            def sdpa(backend=backend):
                with sdpa_kernel(backend):
                    return torch.nn.functional.scaled_dot_product_attention(q_sdpa, k_sdpa, v_sdpa, scale=scale,
                                                                            enable_gqa=True).transpose(1, 2)
            times[name], outs[name] = _time(sdpa)
            if name == "SDPA cuDNN" and times[name] is not None:
                times["SDPA cuDNN graph"], outs["SDPA cuDNN graph"] = _time_graphed(sdpa)
                cudnn_host_us = _median_host_us(sdpa)  # what an eager caller of the fastest alternative pays

    kv_bytes = 2 * batch * length * HEADS_KV * HEAD_DIM * torch.finfo(DTYPE).bits // 8
    reference = outs["SDPA flash"]
    diffs = {name: (outs[name].float() - reference.float()).abs().max().item()
             if times[name] is not None and times["SDPA flash"] is not None else None
             for name in ("ours", "ours paged", "ours graph")}
    return {
        "batch": batch, "cache_len": length,
        "num_splits": choose_num_splits(batch * HEADS_KV, length, device),
        "ms": times,
        "ours_host_us": host_us,
        "cudnn_host_us": cudnn_host_us if times.get("SDPA cuDNN") is not None else None,
        "tb_per_s": {name: kv_bytes / (times[name] * 1e-3) / 1e12 if times.get(name) is not None else None
                     for name in METHODS},
        "errors": {name: outs.get(name) for name in METHODS if times.get(name) is None},
        "max_abs_diff_vs_sdpa_flash": diffs,
        "split_sweep_tb_per_s": {str(splits): kv_bytes / (ms * 1e-3) / 1e12 if ms is not None else None
                                 for splits, ms in sweep_ms.items()},
        "launch_config_tb_per_s": {"x".join(map(str, config)): kv_bytes / (ms * 1e-3) / 1e12 if ms is not None
                                   else None for config, ms in config_ms.items()},
        # against the default config's output: a config that breaks the kernel shows here (or its error)
        "launch_config_max_abs_diff": {"x".join(map(str, config)): diff for config, diff in config_diffs.items()},
    }


def _fmt(value, spec):
    return "–" if value is None else format(value, spec)


def plot_cells(cells, path):
    """TB/s against cache length, a panel per batch: eager and CUDA-graph lines for ours and SDPA.
    Returns False (and writes nothing) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    measured = [c for c in cells if "skipped" not in c]
    batches = sorted({c["batch"] for c in measured})
    fig, axes = plt.subplots(1, len(batches), figsize=(4.5 * len(batches), 3.6), squeeze=False, sharey=True)
    for ax, batch in zip(axes[0], batches):
        row = sorted((c for c in measured if c["batch"] == batch), key=lambda c: c["cache_len"])
        for name in ("ours", "ours graph", "SDPA cuDNN", "SDPA cuDNN graph", "SDPA flash"):
            points = [(c["cache_len"], c["tb_per_s"][name]) for c in row if c["tb_per_s"][name] is not None]
            if points:
                ax.plot(*zip(*points), marker="o", linestyle="--" if "graph" in name else "-", label=name)
        ax.set_xscale("log", base=2)
        ax.set_title(f"batch {batch}", fontsize=10)
        ax.set_xlabel("cache length (tokens)")
        ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel("K + V read, TB/s")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def markdown(cells):
    header = (["batch", "cache length", "splits"] + [f"{name} TB/s" for name in METHODS]
              + ["graph: ours / cuDNN", "eager: API, tensor lengths / cuDNN", "ours host µs", "cuDNN host µs",
                 "max abs diff vs SDPA flash (ours / paged / graph)"])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for cell in cells:
        if "skipped" in cell:
            lines.append(f"| {cell['batch']} | {cell['cache_len']} | {cell['skipped']} |" + " |" * (len(header) - 3))
            continue
        diffs = cell["max_abs_diff_vs_sdpa_flash"]
        rates = cell["tb_per_s"]
        ratio, eager_ratio = (rates[ours] / rates[cudnn] if rates[ours] is not None and rates[cudnn] is not None
                              else None for ours, cudnn in (("ours graph", "SDPA cuDNN graph"),
                                                            ("ours API, tensor lengths", "SDPA cuDNN")))
        row = ([str(cell["batch"]), str(cell["cache_len"]), str(cell["num_splits"])]
               + [_fmt(rates[name], ".2f") for name in METHODS]
               + [_fmt(ratio, ".2f"), _fmt(eager_ratio, ".2f"), f"{cell['ours_host_us']:.0f}",
                  _fmt(cell["cudnn_host_us"], ".0f"),
                  " / ".join(_fmt(diffs[name], ".1e") for name in ("ours", "ours paged", "ours graph"))])
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


class _LaunchRecorder:
    """Stands in for one of decode.py's CompiledLaunch objects: forwards each launch and keeps its
    (grid, args, meta), so that a launch can be replayed and timed alone."""

    def __init__(self, compiled_launch):
        self.compiled_launch, self.launches = compiled_launch, []

    def launch_keyed(self, signature, grid, *args, **meta):
        self.launches.append((grid, args, meta))
        self.compiled_launch.launch_keyed(signature, grid, *args, **meta)


def _recorded_launches(fn):
    """{name: (CompiledLaunch, grid, args, meta)} of the launches that fn() makes in kernels/decode.py."""
    from flashformer.kernels import decode

    names = ("_decode_launch", "_combine_launch")
    recorders = {name: _LaunchRecorder(getattr(decode, name)) for name in names}
    try:
        for name, recorder in recorders.items():
            setattr(decode, name, recorder)
        fn()
    finally:
        for name, recorder in recorders.items():
            setattr(decode, name, recorder.compiled_launch)
    return {name: (recorder.compiled_launch, *recorder.launches[0]) for name, recorder in recorders.items()
            if recorder.launches}


def host_breakdown(length=4096):
    """Host µs per call of the launcher and of its parts (batch 1, a cache short enough that the GPU
    never makes the host wait), each the median of 7 rounds of HOST_CALLS calls: what a decoding step
    pays before the GPU sees work, and how much of it is Triton's launch path."""
    q = torch.randn(1, 1, HEADS_Q, HEAD_DIM, device="cuda", dtype=DTYPE)
    k_cache, v_cache = (torch.randn(1, length, HEADS_KV, HEAD_DIM, device="cuda", dtype=DTYPE) for _ in range(2))
    seqlens = torch.full((1,), length, dtype=torch.int32, device="cuda")
    before_new = seqlens - 1  # the step's token rewrites the cache's last entry
    k_new, v_new = (torch.randn(1, 1, HEADS_KV, HEAD_DIM, device="cuda", dtype=DTYPE) for _ in range(2))
    splits = choose_num_splits(HEADS_KV, length, q.device)
    one_each = torch.tensor([0, 1], dtype=torch.int32, device="cuda")  # cu_seqlens of the packed form
    one_page = torch.zeros(1, 1, dtype=torch.int32, device="cuda")  # the contiguous cache as one page
    q_sdpa = q.transpose(1, 2)
    k_sdpa, v_sdpa = k_cache.transpose(1, 2).contiguous(), v_cache.transpose(1, 2).contiguous()
    scale = HEAD_DIM**-0.5

    def launcher(num_splits):
        return lambda: decode_attention(q, k_cache, v_cache, seqlens, None, length, scale, -1, 0, 0.0, num_splits)

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q_sdpa, k_sdpa, v_sdpa, scale=scale,
                                                                    enable_gqa=True)

    parts = {
        f"launcher, automatic splits ({splits})": launcher(0),
        f"launcher, {splits} splits given": launcher(splits),
        "launcher, one split (no combine launch)": launcher(1),
        "launcher, int cache length (no lengths tensor)": lambda: decode_attention(
            q, k_cache, v_cache, length, None, length, scale, -1, 0, 0.0),
        "flash_attn_with_kvcache (int cache_seqlens)": lambda: flash_attn_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=length, causal=True),
        "flash_attn_with_kvcache (tensor cache_seqlens)": lambda: flash_attn_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=seqlens, causal=True),
        "flash_attn_with_kvcache (tensor cache_seqlens, one token appended)": lambda: flash_attn_with_kvcache(
            q, k_cache, v_cache, k_new, v_new, cache_seqlens=before_new, causal=True),
        "the append alone: cache_append's kernel": lambda: rotate_and_append(
            q, k_cache, v_cache, k_new, v_new, before_new, None, None, None, triton_path=True),
        "the append alone: PyTorch (add, two index_put_)": lambda: rotate_and_append_reference(
            q, k_cache, v_cache, k_new, v_new, before_new, None, None, None),
        "packed form (cu_seqlens_q, one token appended)": lambda: flash_attn_with_kvcache(
            q[0], k_cache, v_cache, k_new[0], v_new[0], cache_seqlens=before_new, cu_seqlens_q=one_each,
            cu_seqlens_k_new=one_each, max_seqlen_q=1, causal=True),
        "the packed append alone: cache_append's kernel": lambda: rotate_and_append_packed(
            q[0], k_cache, v_cache, k_new[0], v_new[0], before_new, one_page, one_each, one_each, None,
            triton_path=True),
        "the packed append alone: PyTorch (searchsorted, gathers, two index_put_)": lambda: (
            rotate_and_append_packed_reference(q[0], k_cache, v_cache, k_new[0], v_new[0], before_new, one_page,
                                               one_each, one_each, None)),
        "4 x torch.empty (outputs and partials)": lambda: [torch.empty(shape, device="cuda") for shape in (
            q.shape, (1, HEADS_Q, 1), (1, 1, HEADS_Q, splits, HEAD_DIM), (1, 1, HEADS_Q, splits))],
        "SDPA cuDNN (sdpa_kernel + call)": cudnn,
    }
    with torch.inference_mode():
        for label, num_splits in ((f"{splits} splits", splits), ("one split", 1)):
            for name, (launch, grid, args, meta) in _recorded_launches(launcher(num_splits)).items():
                parts[f"{name} alone, {label}: Triton JIT launch"] = (
                    lambda k=launch.kernel, g=grid, a=args, m=meta: k[g](*a, **m))
                parts[f"{name} alone, {label}: CompiledLaunch (ours)"] = (
                    lambda c=launch, g=grid, a=args, m=meta: c(g, *a, **m))
        rows = []
        for name, fn in parts.items():
            try:
                fn()
                rows.append((name, f"{_median_host_us(fn):.1f}"))
            except Exception as error:  # an internal API that moved is a result, not a crash
                rows.append((name, f"failed: {type(error).__name__}: {str(error).splitlines()[0][:80]}"))
    print(f"host breakdown (batch 1, cache {length}; median of 7 x {HOST_CALLS} calls):")
    print("| part | host µs per call |\n|---|---|")
    for name, value in rows:
        print(f"| {name} | {value} |")


def print_host_profiles(top, length=16384):
    """Print the ``top`` functions of most own host time per call of the launcher and of flash_attn_with_kvcache
    (int lengths; tensor lengths with a one-token append), batch 1 (flashformer.profiling.host_profile)."""
    q = torch.randn(1, 1, HEADS_Q, HEAD_DIM, device="cuda", dtype=DTYPE)
    k_cache, v_cache = (torch.randn(1, length, HEADS_KV, HEAD_DIM, device="cuda", dtype=DTYPE) for _ in range(2))
    k, v = (torch.randn(1, 1, HEADS_KV, HEAD_DIM, device="cuda", dtype=DTYPE) for _ in range(2))
    seqlens = torch.full((1,), length, dtype=torch.int32, device="cuda")
    before = seqlens - 1
    calls = {
        "the launcher": lambda: decode_attention(q, k_cache, v_cache, seqlens, None, length, HEAD_DIM**-0.5, -1, 0,
                                                 0.0),
        "flash_attn_with_kvcache, int cache_seqlens": lambda: flash_attn_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=length, causal=True),
        "flash_attn_with_kvcache, tensor cache_seqlens, one token appended": lambda: flash_attn_with_kvcache(
            q, k_cache, v_cache, k, v, cache_seqlens=before, causal=True),
    }
    with torch.inference_mode():
        for name, call in calls.items():
            call()
            print(f"\nhost profile, {name} (batch 1, cache {length}): function | calls | own µs | cumulative µs")
            for function, n_calls, own_ms, cumulative_ms in host_profile(call, top):
                print(f"  {function} | {n_calls} | {own_ms * 1e3:.1f} | {cumulative_ms * 1e3:.1f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 65536, 131072])
    parser.add_argument("--out", default="runs/bench_decode.json")
    parser.add_argument("--host-profile", type=int, default=0, metavar="TOP",
                        help="also time the host parts of a step and list each call's TOP functions of most host time")
    parser.add_argument("--plot", help="also draw TB/s against cache length into this PNG (needs matplotlib)")
    parser.add_argument("--split-sweep", type=int, nargs="+", default=[], metavar="SPLITS",
                        help="also time ours in CUDA graphs at each of these split counts (device time), to check "
                             "choose_num_splits")
    parser.add_argument("--launch-configs", type=parse_launch_config, nargs="+", default=[],
                        metavar="BLOCK_NxWARPSxSTAGES",
                        help="also time ours in CUDA graphs with each of these kernel configs (automatic splits), to "
                             "check decode._launch_config")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_decode.py needs a CUDA device")
    cells = []
    grid = [(b, n) for b in args.batches for n in args.lengths]
    for batch, length in tqdm(grid, desc="decode cells"):
        peak = 2 * 2 * batch * length * HEADS_KV * HEAD_DIM * torch.finfo(DTYPE).bits // 8
        if peak > MEMORY_LIMIT or length % PAGE_SIZE:
            reason = f"skipped ({peak / 1e9:.0f} GB)" if peak > MEMORY_LIMIT else f"skipped (not a multiple of {PAGE_SIZE})"
            cells.append({"batch": batch, "cache_len": length, "skipped": reason})
            continue
        cells.append(run_cell(batch, length, args.split_sweep, args.launch_configs))
        torch.cuda.empty_cache()
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({**benchmark_provenance(),
                   "heads_q": HEADS_Q, "heads_kv": HEADS_KV, "head_dim": HEAD_DIM, "dtype": str(DTYPE),
                   "page_size": PAGE_SIZE, "cells": cells}, f, indent=2)
    if args.host_profile:
        host_breakdown()
        print_host_profiles(args.host_profile)
    if args.plot and plot_cells(cells, args.plot):
        print(f"wrote {args.plot}")
    print(markdown(cells))
    if args.split_sweep:
        print("\n" + split_sweep_table(cells, args.split_sweep))
    if args.launch_configs:
        print("\n" + launch_config_table(cells, args.launch_configs))


def split_sweep_table(cells, split_counts):
    """Markdown: per cell, ours' CUDA-graph TB/s at each swept split count (the automatic count first)."""
    return _cell_table(cells, ["batch", "cache length", "automatic splits", "at automatic"]
                       + [f"{s} splits" for s in split_counts],
                       lambda cell: [str(cell["batch"]), str(cell["cache_len"]), str(cell["num_splits"]),
                                     _fmt(cell["tb_per_s"]["ours graph"], ".2f")]
                       + [_fmt(cell["split_sweep_tb_per_s"][str(s)], ".2f") for s in split_counts])


def launch_config_table(cells, configs):
    """Markdown: per cell, CUDA-graph TB/s of SDPA cuDNN, of ours as chosen, and of ours at each swept config."""
    names = ["x".join(map(str, config)) for config in configs]
    return _cell_table(cells, ["batch", "cache length", "cuDNN", "ours as chosen"] + names,
                       lambda cell: [str(cell["batch"]), str(cell["cache_len"]),
                                     _fmt(cell["tb_per_s"]["SDPA cuDNN graph"], ".2f"),
                                     _fmt(cell["tb_per_s"]["ours graph"], ".2f")]
                       + [_fmt(cell["launch_config_tb_per_s"][name], ".2f") for name in names])


def _cell_table(cells, header, row):
    """Markdown with ``header`` and one ``row(cell)`` per measured (not skipped) cell."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row(cell)) + " |" for cell in cells if "skipped" not in cell]
    return "\n".join(lines)

if __name__ == "__main__":
    main()
