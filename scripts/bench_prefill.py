"""Prefill through a KV cache: many new query tokens per sequence appended to a cache and attending to it, as
``generate`` runs a prompt (an empty cache) and a server runs chunked prefill (a cache already holding tokens).

``python scripts/bench_prefill.py --out runs/bench_prefill.json`` (CUDA only). bf16; per cell (batch, heads
q:kv, head_dim, tokens cached, tokens new):

* ours API: flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=cached): the append and the
  attention, as the model's KVCache calls it (an int: one length for every row);
* ours API, tensor lengths: the same with cache_seqlens an int32 (batch,) tensor, as flash-attn users and
  servers pass it (a length per row, never read on the host);
* ours API, paged: the same over a paged copy of the cache (pages of --page-size entries in shuffled order,
  block_table), as servers keep it;
* ours decode kernel: the split-KV decode kernel on the same cache (decode.decode_attention, no append), which
  flash_attn_with_kvcache runs where decode.dense_forward_pays says no; "paged": the same over the paged copy;
* ours dense: flash_attn_func(q, k_cache[:, :end], v_cache[:, :end], causal=True) on the same cache, the
  dense forward alone (no append);
* SDPA cuDNN / flash: the same attention (bottom-right causal) on (batch, heads, seqlen, head_dim) copies.

TFLOP/s counts each query's visible keys (cached + its position + 1): 4 * pairs * head_dim * heads_q.
Each cell records the API calls' and the decode kernel's largest difference from ours dense, and each of our
calls' host time (flashformer.profiling.host_ms_per_call: calls queued behind a GPU sleep), which bounds a call
from below wherever it exceeds the kernels' time. Prints two markdown tables last (TFLOP/s; host against timed
µs per call), after --profile's per-call host profiles; writes JSON to --out after every cell. ``--kernel-times N``
adds the kernels of each API call (torch.profiler, device µs per call over N traced calls): which launch of a route
holds its device time where its timed µs exceed its host µs.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right
from tqdm import tqdm

from flashformer.kernels import flash_attn_func, flash_attn_with_kvcache
from flashformer.kernels.decode import decode_attention
from flashformer.profiling import benchmark_provenance, host_ms_per_call, host_profile, kernel_times

DTYPE = torch.bfloat16
METHODS = ("ours API", "ours API, tensor lengths", "ours API, paged", "ours decode kernel", "ours decode kernel, paged",
           "ours dense", "SDPA cuDNN", "SDPA flash")
# (batch, heads_q, heads_kv, head_dim, cached, new): prompts of a Llama-style model (32:8 at 128) and a
# GPT-2-style one (12:12 at 64), then chunks of a prompt arriving at a cache that already holds tokens.
DEFAULT_CELLS = [
    (1, 32, 8, 128, 0, 512), (1, 32, 8, 128, 0, 2048), (1, 32, 8, 128, 0, 8192), (1, 32, 8, 128, 0, 32768),
    (4, 32, 8, 128, 0, 2048), (1, 12, 12, 64, 0, 1024), (8, 12, 12, 64, 0, 1024),
    (1, 32, 8, 128, 8192, 512), (8, 32, 8, 128, 4096, 64), (8, 32, 8, 128, 4096, 128), (8, 32, 8, 128, 4096, 256),
    (1, 32, 8, 128, 16384, 64), (1, 32, 8, 128, 16384, 128),
]


def parse_cell(spec):
    """'BxHQ:HKVxDxCACHEDxNEW', e.g. 1x32:8x128x0x8192."""
    try:
        batch, heads, head_dim, cached, new = spec.split("x")
        heads_q, heads_kv = heads.split(":")
        return tuple(int(n) for n in (batch, heads_q, heads_kv, head_dim, cached, new))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a cell is BxHQ:HKVxDxCACHEDxNEW (e.g. 1x32:8x128x0x8192), got {spec!r}")


def causal_pairs(cached, new):
    """(query, key) pairs a bottom-right causal mask keeps: query i sees cached + i + 1 keys."""
    return new * cached + new * (new + 1) // 2


def _time(fn):
    """Median ms of fn(), L2 flushed between runs."""
    fn()
    return triton.testing.do_bench(fn, return_mode="median")


def _time_sdpa(fn, backend):
    """_time of an SDPA call under one backend, or None where the backend refuses the shape or the mask."""
    with sdpa_kernel(backend):
        try:
            return _time(fn)
        except (RuntimeError, NotImplementedError, ValueError):
            return None


def paged_copy(k_cache, v_cache, page_size):
    """(k_pool, v_pool, block_table): the caches (batch, entries, heads, head_dim) cut into pages of page_size
    entries (the last one padded), stored in one shuffled order."""
    batch, entries = k_cache.shape[:2]
    pages = triton.cdiv(entries, page_size)
    order = torch.randperm(batch * pages, device=k_cache.device)
    pools = []
    for cache in (k_cache, v_cache):
        rows = torch.nn.functional.pad(cache, (0, 0, 0, 0, 0, pages * page_size - entries))
        pool = torch.empty(batch * pages, page_size, *cache.shape[2:], device=cache.device, dtype=cache.dtype)
        pool[order] = rows.view(batch * pages, page_size, *cache.shape[2:])
        pools.append(pool)
    return *pools, order.view(batch, pages).int()


def run_cell(batch, heads_q, heads_kv, head_dim, cached, new, page_size, profile_top=0, kernel_iters=0):
    device = torch.device("cuda")
    end = cached + new
    k_cache, v_cache = (torch.randn(batch, end, heads_kv, head_dim, device=device, dtype=DTYPE) for _ in range(2))
    q = torch.randn(batch, new, heads_q, head_dim, device=device, dtype=DTYPE)
    k_new, v_new = k_cache[:, cached:].clone(), v_cache[:, cached:].clone()  # what the append rewrites
    k_seen, v_seen = k_cache[:, :end], v_cache[:, :end]
    q_t, k_t, v_t = (x.transpose(1, 2).contiguous() for x in (q, k_seen, v_seen))
    mask = causal_lower_right(new, end)
    cached_per_row = torch.full((batch,), cached, dtype=torch.int32, device=device)
    k_pool, v_pool, block_table = paged_copy(k_cache, v_cache, page_size)

    def sdpa():
        return torch.nn.functional.scaled_dot_product_attention(q_t, k_t, v_t, attn_mask=mask,
                                                                enable_gqa=heads_q != heads_kv)

    calls = {
        "ours API": lambda: flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=cached,
                                                    causal=True),
        "ours API, tensor lengths": lambda: flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new,
                                                                    cache_seqlens=cached_per_row, causal=True),
        "ours API, paged": lambda: flash_attn_with_kvcache(q, k_pool, v_pool, k_new, v_new,
                                                           cache_seqlens=cached_per_row, block_table=block_table,
                                                           causal=True),
        "ours decode kernel": lambda: decode_attention(q, k_cache, v_cache, end, None, end, head_dim ** -0.5, -1, 0,
                                                       0.0, return_lse=False)[0],
        "ours decode kernel, paged": lambda: decode_attention(q, k_pool, v_pool, end, block_table, end,
                                                              head_dim ** -0.5, -1, 0, 0.0, return_lse=False)[0],
        "ours dense": lambda: flash_attn_func(q, k_seen, v_seen, causal=True),
    }
    ms = {name: _time(fn) for name, fn in calls.items()}
    host_ms = {name: host_ms_per_call(fn) for name, fn in calls.items()}
    profiles = {name: host_profile(fn, profile_top) for name, fn in calls.items() if profile_top}
    kernels = {name: sorted(kernel_times(calls[name], kernel_iters)[0].items(), key=lambda item: -item[1])
               for name in METHODS[:3] if kernel_iters}
    for name, backend in (("SDPA cuDNN", SDPBackend.CUDNN_ATTENTION), ("SDPA flash", SDPBackend.FLASH_ATTENTION)):
        ms[name] = _time_sdpa(sdpa, backend)
    dense = calls["ours dense"]().float()
    diffs = {name: (calls[name]().float() - dense).abs().max().item() for name in METHODS[:5]}
    flops = 4 * batch * heads_q * head_dim * causal_pairs(cached, new)
    return {"batch": batch, "heads_q": heads_q, "heads_kv": heads_kv, "head_dim": head_dim, "cached": cached,
            "new": new, "page_size": page_size, "ms": ms, "tflops": {name: None if t is None else flops / t / 1e9 for name, t in ms.items()},
            "max_diff_from_dense": diffs, "host_ms": host_ms, "host_profiles": profiles, "kernel_ms": kernels}


def cell_columns(c):
    """A cell's leading table columns: batch, heads, head_dim, cached, new."""
    return f"| {c['batch']} | {c['heads_q']}:{c['heads_kv']} | {c['head_dim']} | {c['cached']} | {c['new']} | "


def markdown(cells):
    def fmt(value):
        return "-" if value is None else f"{value:.0f}"

    pairs = (("ours API", "ours decode kernel"), ("ours API, tensor lengths", "ours decode kernel"),
             ("ours API, paged", "ours decode kernel, paged"), ("ours API", "SDPA cuDNN"))
    lines = ["| batch | heads | head_dim | cached | new | " + " | ".join(METHODS) + " | API / decode kernel | "
             "API, tensor lengths / decode kernel | API, paged / decode kernel, paged | API / cuDNN |",
             "|" + "---|" * (len(METHODS) + 9)]
    for c in cells:
        t = c["tflops"]
        ratios = [t[a] / t[b] if t[a] and t[b] else None for a, b in pairs]
        lines.append(cell_columns(c) + " | ".join(fmt(t[m]) for m in METHODS) + " | "
                     + " | ".join("-" if r is None else f"{r:.2f}" for r in ratios) + " |")
    return "\n".join(lines)


def host_markdown(cells):
    """Host µs per call against the timed µs per call, for each of our calls."""
    ours = METHODS[:6]
    lines = ["| batch | heads | head_dim | cached | new | " + " | ".join(f"{m}: host / timed µs" for m in ours) + " |",
             "|" + "---|" * (len(ours) + 5)]
    for c in cells:
        lines.append(cell_columns(c) + " | ".join(f"{c['host_ms'][m] * 1e3:.0f} / {c['ms'][m] * 1e3:.0f}" for m in ours)
                     + " |")
    return "\n".join(lines)


def kernel_markdown(cells):
    """Each API call's kernels, device µs per call, largest first."""
    lines = ["| batch | heads | head_dim | cached | new | call | kernel | µs |", "|" + "---|" * 8]
    for c in cells:
        for name, kernels in c["kernel_ms"].items():
            lines += [cell_columns(c) + f"{name} | {kernel[:60]} | {ms * 1e3:.1f} |" for kernel, ms in kernels]
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", type=parse_cell, nargs="+", default=DEFAULT_CELLS,
                        metavar="BxHQ:HKVxDxCACHEDxNEW")
    parser.add_argument("--page-size", type=int, default=16, help="entries per page of the paged column (vLLM's "
                        "16 by default: each key tile then spans pages)")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="also print, per cell and call, the N functions of most own host time (cProfile)")
    parser.add_argument("--kernel-times", type=int, default=0, metavar="N",
                        help="also trace N calls of each API route and print its kernels' device µs per call")
    parser.add_argument("--out", default="runs/bench_prefill.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_prefill.py needs a CUDA device")
    cells = []
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    for cell in tqdm(args.cells, desc="prefill cells"):
        cells.append(run_cell(*cell, args.page_size, args.profile, args.kernel_times))
        torch.cuda.empty_cache()
        with open(args.out, "w") as f:  # after every cell: a run cut short keeps what it measured
            json.dump({**benchmark_provenance(), "dtype": str(DTYPE), "cells": cells}, f, indent=2)
    for c in cells:
        for name, rows in c["host_profiles"].items():
            print(f"\nhost profile, {cell_columns(c)}{name}: function | calls | own ms | cumulative ms")
            for function, calls, own, cumulative in rows:
                print(f"  {function} | {calls} | {own:.4f} | {cumulative:.4f}")
    if args.kernel_times:
        print(kernel_markdown(cells))
    print(markdown(cells))
    print(host_markdown(cells))


if __name__ == "__main__":
    main()
