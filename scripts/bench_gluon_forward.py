"""The Hopper Gluon forward's tile shapes side by side with the tl forward and SDPA cuDNN (one H200 run).

For every head_dim / causal / seqlen cell (flash-attention's grid: batch * seqlen = --tokens,
heads * head_dim = 2048, 8 heads at head_dim 256) each (BLOCK_N, NUM_STAGES) candidate of
flash_fwd_hopper is first checked against fp32 math on the same inputs (max abs error beside SDPA's
in bf16), then timed with do_bench; the table gives forward TFLOP/s and the ratio of the best
candidate to cuDNN. Writes the cells as JSON to --out. --check first checks the candidates of the
chosen head_dims on odd shapes. --variants persistent adds each candidate as the persistent kernel (one
program per SM walking kernels/tile_schedule.py's order; named ...-persistent), its tile boundaries overlapped
where the launcher's rule says (tuning.gluon_overlaps_tiles); in-turn and overlapped force that choice either way
(...-in-turn, ...-overlapped); all checked and timed too. --turns on / off / both times each variant with its
consumers issuing their products in rotation (...+turns; flash_fwd_hopper_tile.wait_turn), at their own pace
(...+own-pace), or both, instead of as the launcher's rule has it. --rounds N times every candidate N times, in
alternating order, and reports the median.

    python scripts/bench_gluon_forward.py --head-dims 64 128 256 --seqlens 1024 4096 16384
    python scripts/bench_gluon_forward.py --check --head-dims 64 --seqlens 1024 4096 16384
    python scripts/bench_gluon_forward.py --check --variants default persistent --head-dims 64 128 \
        --configs n128-s2-c2 n128-s2-c3 --seqlens 1024 2048 4096
    python scripts/bench_gluon_forward.py --check --variants overlapped in-turn --rounds 3 --head-dims 64 128
    python scripts/bench_gluon_forward.py --check --variants default persistent --turns both --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashformer.kernels import flash_attn_func, force_kernel_impl
from flashformer.kernels import flash_fwd_hopper
from flashformer.kernels.flash_fwd import log2_scales
from flashformer.kernels.launch import new_output, seq_strides
from flashformer.profiling import benchmark_provenance

# (BLOCK_N, NUM_STAGES, CONSUMERS); CONSUMERS warpgroups of 64 query rows each. At head_dim 64 BLOCK_N 256
# spills (1.4 KB at two consumers), and gl.arange takes powers of two only (no 192).
CANDIDATES = {64: [(128, 2, 2), (128, 3, 2), (128, 2, 3), (128, 3, 3), (64, 4, 3)],
              128: [(128, 2, 2), (64, 3, 2)], 256: [(64, 2, 2)]}


def gluon_forward(q, k, v, causal, config, window=(-1, -1), softcap=0.0, variant="default"):
    """(out, lse) of the Gluon kernel with one (BLOCK_N, NUM_STAGES, CONSUMERS) config, one tile per program
    (variant "default"), persistent by the launcher's rule, or persistent with its tile boundaries forced
    one after the other ("in-turn") or overlapped ("overlapped"); a "+turns" suffix has the consumers take
    turns on the tensor cores, a "+own-pace" one not (no suffix: the launcher's rule)."""
    variant, _, pace = variant.partition("+")
    block_n, num_stages, consumers = config
    head_dim_pad = max(16, triton.next_power_of_2(q.shape[-1]))
    out = new_output(q)
    lse = new_output(q, (q.shape[0], q.shape[2], q.shape[1]), torch.float32)
    qk_scale, softcap_log2 = log2_scales(q.shape[-1] ** -0.5, softcap)
    window_left, window_right = window[0], 0 if causal else window[1]
    flash_fwd_hopper.launch_forward(q, k, v, out, lse, qk_scale, softcap_log2, window_left, window_right, softcap,
                                    head_dim_pad, [s for t in (q, k, v, out) for s in seq_strides(t, False)],
                                    lse.stride()[:2], block_n=block_n, num_stages=num_stages, consumers=consumers,
                                    persistent=variant != "default",
                                    overlap_tiles={"in-turn": False, "overlapped": True}.get(variant),
                                    turns={"turns": True, "own-pace": False}.get(pace))
    return out, lse


# Odd shapes for --check: (seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, causal, window, softcap).
# At head_dim 64 with 3 consumers (192 rows), 239 and 128 query rows leave a consumer with no row to store.
CHECK_CASES = [(113, 203, 8, 2, 128, True, (-1, -1), 0.0), (239, 1, 8, 8, 64, False, (-1, -1), 0.0),
               (1023, 1024, 8, 1, 128, True, (-1, -1), 0.0), (200, 57, 8, 2, 80, False, (32, 8), 0.0),
               (128, 217, 8, 8, 64, True, (17, -1), 5.0), (1000, 1000, 8, 8, 256, False, (-1, -1), 15.0),
               (64, 128, 8, 8, 40, True, (40, -1), 0.0), (4096, 4096, 4, 4, 128, True, (-1, -1), 0.0),
               (577, 1100, 8, 2, 64, True, (-1, -1), 0.0), (400, 333, 8, 8, 64, False, (100, 50), 5.0),
               (2000, 2000, 4, 4, 64, True, (-1, -1), 0.0)]


def check_candidates(head_dims, variants, configs=None):
    """Every candidate (of ``configs``, by name), in each of ``variants``, of the padded head_dims ``head_dims``
    against fp64 math on odd shapes, by flash-attn's 2x rule against the tl kernel's error, for out and lse,
    with outputs NaN-poisoned before each launch (a freed buffer handed back by torch's allocator can hold
    the right answer in rows a kernel never writes)."""
    from flashformer.kernels import attention_materialized, launch
    launch.POISON_OUTPUTS = True
    failures = 0
    try:
        for seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, causal, window, softcap in CHECK_CASES:
            head_dim_pad = max(16, triton.next_power_of_2(head_dim))
            if head_dim_pad not in head_dims:
                continue
            q = torch.randn(2, seqlen_q, heads_q, head_dim, device="cuda", dtype=torch.bfloat16)
            k, v = (torch.randn(2, seqlen_k, heads_kv, head_dim, device="cuda", dtype=torch.bfloat16)
                    for _ in range(2))
            opts = dict(causal=causal, window_size=window, softcap=softcap)
            ref, ref_lse = attention_materialized(q.double(), k.double(), v.double(), **opts)
            seen = torch.isfinite(ref_lse)
            with force_kernel_impl("triton"):  # the tl kernel's error is the yardstick
                tl_out, tl_lse = flash_attn_func(q, k, v, return_lse=True, **opts)
            tl_error = (tl_out.double() - ref).abs().max().item()
            tl_lse_error = (tl_lse.double() - ref_lse)[seen].abs().max().item()
            for config, variant in candidates(head_dim_pad, variants, configs):
                label = (f"check s{seqlen_q}x{seqlen_k} h{heads_q}:{heads_kv} d{head_dim} causal={causal} w={window} "
                         f"cap={softcap} {candidate_name(config, variant)}")
                try:
                    out, lse = gluon_forward(q, k, v, causal, config, window, softcap, variant)
                except Exception as error:  # a candidate that does not compile or fit fails, the rest go on
                    failures += 1
                    print(f"{label}: FAIL {type(error).__name__}: {str(error)[:300]}")
                    continue
                error = (out.double() - ref).abs().nan_to_num(float("inf")).max().item()
                lse_ok = torch.equal(torch.isneginf(lse), ~seen) and (
                    (lse.double() - ref_lse)[seen].abs().nan_to_num(float("inf")).max().item()
                    <= 2 * tl_lse_error + 1e-5)
                ok = error <= 2 * tl_error + 1e-6 and lse_ok
                failures += not ok
                print(f"{label}: out {error:.2e} (tl {tl_error:.2e}), "
                      f"lse {'ok' if lse_ok else 'wrong'} {'ok' if ok else 'FAIL'}")
    finally:
        launch.POISON_OUTPUTS = False
    return failures


def candidates(head_dim, variants, configs=None):
    """(config, variant) pairs to check and time at padded ``head_dim``: CANDIDATES' (only those named in
    ``configs``, as n128-s2-c3, where given) in each of ``variants``."""
    return [(config, variant) for variant in variants for config in CANDIDATES[head_dim]
            if configs is None or candidate_name(config, "default") in configs]


def candidate_name(config, variant):
    block_n, num_stages, consumers = config
    return f"n{block_n}-s{num_stages}-c{consumers}" + ("" if variant == "default" else f"-{variant}")


def sdpa(backend, q, k, v, causal):
    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              is_causal=causal).transpose(1, 2)


def tl_forward(q, k, v, causal):
    with force_kernel_impl("triton"):
        return flash_attn_func(q, k, v, causal=causal)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--out", default="bench_gluon_forward.json")
    parser.add_argument("--check", action="store_true", help="first check every candidate on odd shapes")
    parser.add_argument("--variants", nargs="+", choices=["default", "persistent", "in-turn", "overlapped"],
                        default=["default"], help="one tile per program (default), the persistent kernel as the "
                        "launcher sets it, and/or the persistent kernel with its tile boundaries forced in turn or "
                        "overlapped")
    parser.add_argument("--turns", choices=["rule", "on", "off", "both"], default="rule",
                        help="the consumers in rotation on the tensor cores (+turns), at their own pace (+own-pace), "
                        "both, or as the launcher's rule has it")
    parser.add_argument("--rounds", type=int, default=1, help="time each candidate this many times, in alternating "
                        "order, and report the median")
    parser.add_argument("--configs", nargs="+", metavar="NAME",
                        help="only these candidates, as n128-s2-c3 (default: all of each head_dim's)")
    args = parser.parse_args(argv)
    known = {candidate_name(config, "default") for configs in CANDIDATES.values() for config in configs}
    if args.configs and not set(args.configs) <= known:
        parser.error(f"--configs: unknown {sorted(set(args.configs) - known)}; candidates are {sorted(known)}")
    paces = {"rule": [""], "on": ["+turns"], "off": ["+own-pace"], "both": ["+own-pace", "+turns"]}[args.turns]
    args.variants = [variant + pace for variant in args.variants for pace in paces]
    if args.check:
        print(f"check failures: {check_candidates(args.head_dims, args.variants, args.configs)}")
    causals = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    cells = []
    for head_dim in args.head_dims:
        heads = 8 if head_dim == 256 else 2048 // head_dim
        for causal in causals:
            for seqlen in args.seqlens:
                batch = max(1, args.tokens // seqlen)
                q, k, v = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16)
                           for _ in range(3))
                flops = 4 * batch * heads * seqlen * seqlen * head_dim / (2 if causal else 1)
                reference = sdpa(SDPBackend.MATH, q.float(), k.float(), v.float(), causal)
                cudnn = sdpa(SDPBackend.CUDNN_ATTENTION, q, k, v, causal)
                cell = {"head_dim": head_dim, "causal": causal, "seqlen": seqlen, "batch": batch,
                        "sdpa_bf16_error": (cudnn.float() - reference).abs().max().item(), "gluon": {}}
                timings = {"tl": lambda: tl_forward(q, k, v, causal),
                           "cudnn": lambda: sdpa(SDPBackend.CUDNN_ATTENTION, q, k, v, causal)}
                cell["tl_error"] = (tl_forward(q, k, v, causal).float() - reference).abs().max().item()
                for config, variant in candidates(head_dim, args.variants, args.configs):
                    name = candidate_name(config, variant)
                    try:
                        out, _ = gluon_forward(q, k, v, causal, config, variant=variant)
                    except Exception as error:  # a candidate that does not compile or fit is reported, not fatal
                        cell["gluon"][name] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
                        continue
                    cell["gluon"][name] = {"error_max": (out.float() - reference).abs().max().item(),
                                           "finite": bool(torch.isfinite(out).all())}
                    timings[name] = (lambda config=config, variant=variant:
                                     gluon_forward(q, k, v, causal, config, variant=variant))
                times = {name: [] for name in timings}
                for round_index in range(args.rounds):
                    for name in list(timings)[::-1 if round_index % 2 else 1]:
                        times[name].append(triton.testing.do_bench(timings[name], warmup=50, rep=200,
                                                                   return_mode="median"))
                for name, ms in times.items():
                    target = cell["gluon"][name] if name in cell["gluon"] else cell
                    key = f"{name}_tflops" if target is cell else "tflops"
                    target[key] = flops / statistics.median(ms) / 1e9
                    target[key.replace("tflops", "rounds_tflops")] = [flops / t / 1e9 for t in ms]
                cells.append(cell)
                del q, k, v, reference, cudnn
                torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump({**benchmark_provenance(), "cells": cells}, f, indent=1)
    print("| head_dim | causal | seqlen | cuDNN | tl | gluon candidates (TFLOP/s, max err vs sdpa bf16 err) | best/cuDNN |")
    print("|---|---|---|---|---|---|---|")
    for cell in cells:
        cands = {n: c for n, c in cell["gluon"].items() if "tflops" in c}
        best = max((c["tflops"] for c in cands.values()), default=0.0)
        text = ", ".join(f"{n} {c['tflops']:.0f} ({c['error_max']:.1e})" for n, c in cands.items())
        errors = [n for n, c in cell["gluon"].items() if "error" in c]
        print(f"| {cell['head_dim']} | {'yes' if cell['causal'] else 'no'} | {cell['seqlen']} | "
              f"{cell['cudnn_tflops']:.0f} | {cell['tl_tflops']:.0f} | {text}{' failed: ' + ','.join(errors) if errors else ''}"
              f" [sdpa {cell['sdpa_bf16_error']:.1e}] | {best / cell['cudnn_tflops']:.2f} |")


if __name__ == "__main__":
    main()
