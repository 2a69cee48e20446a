"""The Hopper Gluon backward (dQ and dK/dV kernels) beside the tl backward and SDPA cuDNN (one H200 run).

--variants picks the Gluon forms: two-kernel (dQ kernel + dK/dV kernel, every BLOCK_M candidate), fused (dQ formed in the dK/dV kernel, each share added by a TMA reduction, ordered by semaphores:
deterministic), fused-nondet (the same in arrival order), fused-split and fused-split-nondet (the same
two with the consumers' dS^T shared and dQ's columns split between them: flash_bwd_hopper's DQ_SPLIT,
half the reduce traffic). A variant's first call (but two-kernel's) runs in a child process under a timeout
first (--smoke): one that hangs or fails there is reported and left out of the rest of the run.

--check first compares dq/dk/dv of every variant (and of the whole Gluon path through
flash_attn_func, lse gradient included) with fp64 autograd on odd shapes, outputs
NaN-poisoned, by flash-attn's rule: at most twice the tl backward's error; the ordered fused forms must also give
bit-identical gradients on a second run; each line ends with the gradients' digest (two versions' logs, from
scripts/with_tree.py, say whether they computed the same bits). Then, for every
head_dim / causal / seqlen cell (batch * seqlen = --tokens, heads * head_dim = 2048, 8 heads at
head_dim 256), it times the backward alone (out, lse and dO given) with do_bench: TFLOP/s at 2.5x the
forward's FLOPs (--rounds N: N times in alternating order, the median), and the Gluon path's three launches
(preprocess, dQ, dK/dV) alone in ms. The markdown table comes last; the cells go to --out as JSON, rewritten after each cell (a run cut short
keeps what it measured).

    python scripts/bench_gluon_backward.py --check --head-dims 64 128 256 --seqlens 1024 4096 16384
    python scripts/bench_gluon_backward.py --check --variants two-kernel fused fused-nondet fused-split \
        fused-split-nondet --head-dims 128 --seqlens 4096 16384
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import json
import statistics
import subprocess
import sys

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashformer.kernels import attention_materialized, flash_attn_func, force_kernel_impl, launch
from flashformer.kernels import bwd_stats, flash_bwd, flash_bwd_dq_hopper, flash_bwd_hopper, tuning
from flashformer.kernels.flash_fwd import attention_forward, log2_scales
from flashformer.kernels.launch import seq_strides
from flashformer.kernels.sizes import pad_head_dim

# BLOCK_M candidates per padded head_dim (None: flash_bwd_hopper.config's choice)
CANDIDATES = {64: [None, 64], 128: [None, 32], 256: [None, 32]}

# Odd shapes for --check: (seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, causal, window, softcap)
CHECK_CASES = [(113, 203, 8, 2, 128, True, (-1, -1), 0.0), (239, 1, 8, 8, 64, False, (-1, -1), 0.0),
               (1023, 1024, 8, 1, 128, True, (-1, -1), 0.0), (200, 57, 8, 2, 80, False, (32, 8), 0.0),
               (128, 217, 8, 8, 64, True, (17, -1), 5.0), (1000, 1000, 8, 8, 256, False, (-1, -1), 15.0),
               (300, 77, 8, 4, 128, False, (-1, -1), 0.0), (333, 517, 8, 2, 256, True, (-1, -1), 0.0),
               (150, 150, 4, 4, 192, False, (40, 3), 0.0), (4096, 4096, 4, 4, 128, True, (-1, -1), 0.0)]


@contextlib.contextmanager
def gluon_candidate(block_m):
    """Inside this block the Gluon backward takes every head_dim it has a config for (not only those
    where it is the default), its dK/dV launch with BLOCK_M = ``block_m`` (None: its default)."""
    original, from_seqlen = flash_bwd_hopper.launch_dkdv, dict(tuning.GLUON_BACKWARD_FROM_SEQLEN)
    tuning.GLUON_BACKWARD_FROM_SEQLEN.update(dict.fromkeys(flash_bwd_hopper.CONFIGS, 1))
    if block_m is not None:
        flash_bwd_hopper.launch_dkdv = functools.partial(original, block_m=block_m)
    try:
        yield
    finally:
        flash_bwd_hopper.launch_dkdv = original
        tuning.GLUON_BACKWARD_FROM_SEQLEN.clear()
        tuning.GLUON_BACKWARD_FROM_SEQLEN.update(from_seqlen)


def window_bounds(causal, window):
    return window[0], 0 if causal else window[1]


VARIANTS = ("two-kernel", "fused", "fused-nondet", "fused-split", "fused-split-nondet")


SMOKE_TIMEOUT_S = 180


def backward(q, k, v, out, lse, grad_out, causal, window, softcap, gluon, block_m=None, grad_lse=None,
             variant="two-kernel"):
    """(dq, dk, dv) of the backward, a Gluon ``variant`` (VARIANTS) or tl, from a given forward."""
    window_left, window_right = window_bounds(causal, window)
    form = variant.removesuffix("-nondet")
    with gluon_candidate(block_m):
        return flash_bwd.attention_backward(grad_out, grad_lse, q, k, v, out, lse, q.shape[-1] ** -0.5,
                                            window_left, window_right, softcap,
                                            deterministic=not variant.endswith("-nondet"), gluon=gluon,
                                            gluon_form=form)


def smoke(variant):
    """One small call of ``variant`` per mask (causal GQA, window, full) at head_dim 128, synchronised:
    run in a child process, so that a kernel that never finishes costs a timeout, not the run."""
    for seqlen_q, seqlen_k, heads_kv, causal, window, softcap in ((300, 333, 2, True, (-1, -1), 0.0),
                                                                   (257, 190, 4, False, (40, 7), 0.0),
                                                                   (129, 1000, 4, False, (-1, -1), 0.0)):
        q = torch.randn(2, seqlen_q, 4, 128, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(2, seqlen_k, heads_kv, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        window_left, window_right = window_bounds(causal, window)
        out, lse = attention_forward(q, k, v, 128 ** -0.5, window_left, window_right, softcap)
        grads = backward(q, k, v, out, lse, torch.randn_like(q), causal, window, softcap, True, variant=variant)
        torch.cuda.synchronize()
        assert all(bool(torch.isfinite(g).all()) for g in grads), "non-finite gradients"
    print(f"smoke {variant}: ok", flush=True)


def smoke_variants(variants):
    """The variants whose smoke call finished in a child process (fused ones; two-kernel is trusted)."""
    kept = []
    for variant in variants:
        if variant == "two-kernel":
            kept.append(variant)
            continue
        try:
            done = subprocess.run([sys.executable, __file__, "--smoke", variant], capture_output=True, text=True,
                                  timeout=SMOKE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            print(f"smoke {variant}: hang (no result in {SMOKE_TIMEOUT_S} s), left out", flush=True)
            continue
        if done.returncode != 0:
            print(f"smoke {variant}: FAIL, left out: {(done.stdout + done.stderr)[-1500:]}", flush=True)
            continue
        print(done.stdout.strip(), flush=True)
        kept.append(variant)
    return kept


def max_error(got, ref):
    return (got.double() - ref).abs().nan_to_num(float("inf")).max().item()


def digest(tensors):
    """The first 12 hex digits of the sha256 of the tensors' bytes: two runs (two trees) with equal digests gave the
    same bits."""
    sha = hashlib.sha256()
    for t in tensors:
        sha.update(t.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return sha.hexdigest()[:12]


def check_candidates(variants):
    """Every variant's (and BLOCK_M candidate's) gradients against fp64 autograd, with outputs
    NaN-poisoned (a freed buffer handed back by torch's allocator can hold the right answer in rows
    a kernel never writes); the deterministic fused variant twice, bit for bit. Each check line ends with the
    gradients' digest, so that two versions' logs show whether they computed the same bits (the inputs are seeded)."""
    launch.POISON_OUTPUTS = True
    failures = 0
    try:
        for seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, causal, window, softcap in CHECK_CASES:
            torch.manual_seed(seqlen_q * 7 + seqlen_k)
            q = torch.randn(2, seqlen_q, heads_q, head_dim, device="cuda", dtype=torch.bfloat16)
            k, v = (torch.randn(2, seqlen_k, heads_kv, head_dim, device="cuda", dtype=torch.bfloat16)
                    for _ in range(2))
            grad_out = torch.randn_like(q)
            opts = dict(causal=causal, window_size=window, softcap=softcap)
            inputs = [t.double().requires_grad_() for t in (q, k, v)]
            ref_out, ref_lse = attention_materialized(*inputs, **opts)
            grad_lse = torch.where(torch.isfinite(ref_lse), torch.randn_like(ref_lse), 0.0)
            refs = torch.autograd.grad((ref_out, ref_lse), inputs, (grad_out.double(), grad_lse))
            refs = [r.nan_to_num(0.0) for r in refs]  # rows that see no key: lse -inf, gradient 0
            window_left, window_right = window_bounds(causal, window)
            out, lse = attention_forward(q, k, v, head_dim ** -0.5, window_left, window_right, softcap)
            grad_lse = grad_lse.float()
            tl_grads = backward(q, k, v, out, lse, grad_out, causal, window, softcap, False, grad_lse=grad_lse)
            tl_errors = [max_error(g, r) for g, r in zip(tl_grads, refs)]
            label = (f"s{seqlen_q}x{seqlen_k} h{heads_q}:{heads_kv} d{head_dim} causal={causal} w={window} "
                     f"cap={softcap}")
            covered = pad_head_dim(head_dim) in flash_bwd_hopper.CONFIGS
            runs = []  # (name, whether a second run must match bit for bit, closure)
            if "two-kernel" in variants:
                runs += [(f"m{block_m or 'default'}", False,
                          functools.partial(backward, q, k, v, out, lse, grad_out, causal, window, softcap, True,
                                            block_m, grad_lse))
                         for block_m in (CANDIDATES[pad_head_dim(head_dim)] if covered else [None])]
                runs.append(("flash_attn_func", False,
                             functools.partial(gluon_path_gradients, q, k, v, grad_out, grad_lse, opts)))
            fused = flash_bwd_hopper.fused_supports(pad_head_dim(head_dim), softcap)
            fallback = "" if fused else " (two-kernel fallback)"
            runs += [(variant + (fallback if variant.startswith("fused") else ""), not variant.endswith("-nondet"),
                      functools.partial(backward, q, k, v, out, lse, grad_out, causal, window, softcap, True,
                                        grad_lse=grad_lse, variant=variant))
                     for variant in variants if variant != "two-kernel"]
            for name, deterministic, run in runs:
                try:
                    grads = run()
                    repeat_same = not deterministic or all(torch.equal(a, b) for a, b in zip(grads, run()))
                except Exception as error:  # a candidate that does not compile or fit is reported, not fatal
                    failures += 1
                    print(f"check {label} {name}: {type(error).__name__}: {str(error)[:300]} FAIL")
                    continue
                errors = [max_error(g, r) for g, r in zip(grads, refs)]
                ok = all(e <= 2 * t + 1e-5 for e, t in zip(errors, tl_errors)) and repeat_same
                failures += not ok
                text = ", ".join(f"{n} {e:.2e} (tl {t:.2e})" for n, e, t in zip(("dq", "dk", "dv"), errors, tl_errors))
                text += "" if repeat_same else ", second run differs"
                print(f"check {label} {name}{'' if covered else ' (tl fallback)'}: {text} {'ok' if ok else 'FAIL'} "
                      f"digest {digest(grads)}")
    finally:
        launch.POISON_OUTPUTS = False
    return failures


def gluon_path_gradients(q, k, v, grad_out, grad_lse, opts):
    """(dq, dk, dv) through flash_attn_func on the Gluon path, out's and lse's gradients both."""
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    with force_kernel_impl("gluon"):
        out, lse = flash_attn_func(*inputs, return_lse=True, **opts)
        return torch.autograd.grad((out, lse), inputs, (grad_out, grad_lse))


def gluon_launches(q, k, v, out, lse, grad_out, causal):
    """Closures launching the Gluon backward's three kernels one by one (preprocess, dQ, dK/dV)."""
    head_dim = q.shape[-1]
    head_dim_pad = pad_head_dim(head_dim)
    scale = head_dim ** -0.5
    qk_scale, softcap_log2 = log2_scales(scale, 0.0)
    strides_lse = lse.stride()[:2]
    lse_log2, delta, strides_stats = bwd_stats.row_stats_buffers(lse, q.shape[1], False)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    window_right = 0 if causal else -1
    common = (lse_log2, delta, scale, qk_scale, softcap_log2, -1, window_right, 0.0, head_dim_pad)
    preprocess = functools.partial(bwd_stats.launch_preprocess, out, grad_out, lse, None, delta, lse_log2, None,
                                   q.shape[0], q.shape[1], strides_lse, strides_stats, head_dim, head_dim_pad, False)
    preprocess()
    return {"preprocess": preprocess,
            "dq": functools.partial(flash_bwd_dq_hopper.launch_dq, q, k, v, grad_out, dq, *common,
                                    [s for t in (q, k, v, grad_out, dq) for s in seq_strides(t, False)], strides_stats),
            "dkdv": functools.partial(flash_bwd_hopper.launch_dkdv, q, k, v, grad_out, dk, dv, *common,
                                      [s for t in (q, k, v, grad_out, dk, dv) for s in seq_strides(t, False)],
                                      strides_stats)}


def sdpa_backward(q, k, v, grad_out, causal):
    """A closure running SDPA cuDNN's backward alone (its forward done once here)."""
    inputs = [t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v)]
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        out = F.scaled_dot_product_attention(*inputs, is_causal=causal)
    grad = grad_out.transpose(1, 2)
    return lambda: torch.autograd.grad(out, inputs, grad, retain_graph=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--out", default="bench_gluon_backward.json")
    parser.add_argument("--check", action="store_true", help="first check every candidate on odd shapes")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--rounds", type=int, default=1, help="time each form this many times, in alternating "
                        "order, and report the median")
    parser.add_argument("--smoke", choices=VARIANTS[1:], help=argparse.SUPPRESS)  # the child of smoke_variants
    args = parser.parse_args(argv)
    if args.smoke:
        return smoke(args.smoke)
    variants = smoke_variants(args.variants)
    if args.check:
        print(f"check failures: {check_candidates(variants)}", flush=True)
    causals = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    cells = []
    for head_dim in args.head_dims:
        heads = 8 if head_dim == 256 else 2048 // head_dim
        head_dim_pad = pad_head_dim(head_dim)
        for causal in causals:
            for seqlen in args.seqlens:
                batch = max(1, args.tokens // seqlen)
                q, k, v, grad_out = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16)
                                     for _ in range(4))
                flops = 2.5 * 4 * batch * heads * seqlen * seqlen * head_dim / (2 if causal else 1)
                out, lse = attention_forward(q, k, v, head_dim ** -0.5, -1, 0 if causal else -1, 0.0)
                tl_grads = backward(q, k, v, out, lse, grad_out, causal, (-1, -1), 0.0, False)
                cell = {"head_dim": head_dim, "causal": causal, "seqlen": seqlen, "batch": batch, "gluon": {},
                        "gluon_is_default": flash_bwd_hopper.supports(q, seqlen, head_dim_pad, False, False)}
                timings = {"tl": functools.partial(backward, q, k, v, out, lse, grad_out, causal, (-1, -1), 0.0,
                                                   False)}
                try:
                    timings["cudnn"] = sdpa_backward(q, k, v, grad_out, causal)
                except Exception as error:
                    cell["cudnn_error"] = f"{type(error).__name__}: {str(error)[:300]}"
                runs = [(f"m{block_m or 'default'}", block_m, "two-kernel") for block_m in CANDIDATES[head_dim_pad]
                        if "two-kernel" in variants]
                runs += [(variant, None, variant) for variant in variants if variant != "two-kernel"
                         and (not variant.startswith("fused") or flash_bwd_hopper.fused_supports(head_dim_pad, 0.0))]
                for name, block_m, variant in runs:
                    run = functools.partial(backward, q, k, v, out, lse, grad_out, causal, (-1, -1), 0.0, True,
                                            block_m, variant=variant)
                    try:
                        grads = run()
                    except Exception as error:  # a candidate that does not compile or fit is reported, not fatal
                        cell["gluon"][name] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
                        continue
                    # against the tl backward: the same out and lse, so only the backward differs
                    cell["gluon"][name] = {"vs_tl_max": max(max_error(g, t.double()) for g, t in zip(grads, tl_grads)),
                                           "finite": all(bool(torch.isfinite(g).all()) for g in grads)}
                    timings[name] = run
                times = {name: [] for name in timings}
                for round_index in range(args.rounds):  # alternating order: a GPU at its power limit drifts
                    for name in list(timings)[::-1 if round_index % 2 else 1]:
                        times[name].append(triton.testing.do_bench(timings[name], warmup=25, rep=100,
                                                                   return_mode="median"))
                for name, ms in times.items():
                    target = cell["gluon"][name] if name in cell["gluon"] else cell
                    key = f"{name}_tflops" if target is cell else "tflops"
                    target[key] = flops / statistics.median(ms) / 1e9
                    target[key.replace("tflops", "rounds_tflops")] = [flops / t / 1e9 for t in ms]
                if head_dim_pad in flash_bwd_hopper.CONFIGS and "two-kernel" in variants:
                    try:
                        cell["gluon_ms"] = {name: triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
                                            for name, fn in gluon_launches(q, k, v, out, lse, grad_out, causal).items()}
                    except Exception as error:
                        cell["gluon_ms"] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
                cells.append(cell)
                print(json.dumps(cell), flush=True)
                with open(args.out, "w") as f:
                    json.dump(cells, f, indent=1)
                del q, k, v, grad_out, out, lse, tl_grads
                torch.cuda.empty_cache()
    print("| head_dim | causal | seqlen | cuDNN | tl | gluon variants (TFLOP/s, max diff vs tl) | best/cuDNN "
          "| best/tl | two-kernel ms: preprocess / dQ / dK,dV |")
    print("|---|---|---|---|---|---|---|---|---|")
    for cell in cells:
        cands = {n: c for n, c in cell["gluon"].items() if "tflops" in c}
        best = max((c["tflops"] for c in cands.values()), default=0.0)
        text = ", ".join(f"{n} {c['tflops']:.0f} ({c['vs_tl_max']:.1e}{'' if c['finite'] else ' NONFINITE'})"
                         for n, c in cands.items())
        errors = [n for n, c in cell["gluon"].items() if "error" in c]
        if not cell["gluon_is_default"]:
            text += " (default: tl)"
        cudnn = cell.get("cudnn_tflops", float("nan"))
        print(f"| {cell['head_dim']} | {'yes' if cell['causal'] else 'no'} | {cell['seqlen']} | {cudnn:.0f} | "
              f"{cell['tl_tflops']:.0f} | {text}{' failed: ' + ','.join(errors) if errors else ''} | "
              f"{best / cudnn:.2f} | {best / cell['tl_tflops']:.2f} | {launch_times(cell.get('gluon_ms'))} |")


def launch_times(times):
    """'a / b / c' ms of the Gluon path's launches, the error text, or '-'."""
    if not times:
        return "-"
    if "error" in times:
        return times["error"][:80]
    return " / ".join(f"{times[name]:.3f}" for name in ("preprocess", "dq", "dkdv"))


if __name__ == "__main__":
    main()
