"""Attention throughput on one GPU: flashformer's Triton kernels beside torch's SDPA backends.

flash-attention's grid: batch * seqlen = 16384 tokens, heads * head_dim = 2048, bf16. FLOPs of the
forward = 4 * batch * heads * seqlen^2 * head_dim, halved when causal; backward = 2.5 x forward.
Times are medians of ``triton.testing.do_bench`` after warm-up; every implementation runs on the same
inputs in the same process, and each cell also records ours' max abs difference from SDPA.

    python scripts/bench_attention.py --out bench.json            # head_dim 64 and 128, the full grid
    python scripts/bench_attention.py --head-dims 256 --heads-256 8
"""

from __future__ import annotations

import argparse
import json
import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from tqdm import tqdm

from flashformer.kernels import flash_attn_func

SDPA_BACKENDS = {
    "sdpa-flash": SDPBackend.FLASH_ATTENTION,
    "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION,
    "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION,
}


def attention_flops(batch, heads, seqlen, head_dim, causal):
    flops = 4 * batch * heads * seqlen * seqlen * head_dim
    return flops / 2 if causal else flops


def _ours(q, k, v, causal):
    return flash_attn_func(q, k, v, causal=causal)


def _sdpa(backend):
    def run(q, k, v, causal):
        # SDPA wants (batch, heads, seqlen, head_dim); transposes are views, as a model would pass.
        with sdpa_kernel(backend):
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 is_causal=causal)
        return out.transpose(1, 2)
    return run


def _flex():
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    compiled = torch.compile(flex_attention, dynamic=False)
    masks = {}

    def run(q, k, v, causal):
        seqlen = q.shape[1]
        block_mask = None
        if causal:
            if seqlen not in masks:
                masks[seqlen] = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, seqlen, seqlen)
            block_mask = masks[seqlen]
        out = compiled(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=block_mask)
        return out.transpose(1, 2)
    return run


def time_fwd_bwd(fn, q, k, v, causal, grad_out):
    """(forward ms, backward ms, output) of ``fn``; None times when the backend refuses the shape."""
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
        return None, None, None
    return fwd_ms, bwd_ms, out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--tokens", type=int, default=16384, help="batch * seqlen")
    parser.add_argument("--width", type=int, default=2048, help="heads * head_dim")
    parser.add_argument("--heads-256", type=int, default=8, help="heads at head_dim 256 (flash-attn uses 8)")
    parser.add_argument("--impls", nargs="+", default=["ours", *SDPA_BACKENDS, "flex"])
    parser.add_argument("--flex-seqlens", type=int, nargs="+", default=[1024, 4096, 16384],
                        help="FlexAttention compiles per shape: only these lengths")
    parser.add_argument("--flex-head-dims", type=int, nargs="+", default=[128])
    parser.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    parser.add_argument("--out", default="bench_attention.json")
    args = parser.parse_args(argv)

    impls = {"ours": _ours, **{name: _sdpa(b) for name, b in SDPA_BACKENDS.items()}}
    if "flex" in args.impls:
        impls["flex"] = _flex()
    impls = {name: fn for name, fn in impls.items() if name in args.impls}
    causals = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    cells = [(d, c, s) for d in args.head_dims for c in causals for s in args.seqlens]
    results = []
    for head_dim, causal, seqlen in tqdm(cells, desc="attention grid"):
        batch = max(1, args.tokens // seqlen)
        heads = args.heads_256 if head_dim == 256 else args.width // head_dim
        q, k, v = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        grad_out = torch.randn_like(q)
        flops = attention_flops(batch, heads, seqlen, head_dim, causal)
        row = {"head_dim": head_dim, "causal": causal, "seqlen": seqlen, "batch": batch, "heads": heads}
        outputs = {}
        for name, fn in impls.items():
            if name == "flex" and (seqlen not in args.flex_seqlens or head_dim not in args.flex_head_dims):
                continue
            fwd_ms, bwd_ms, out = time_fwd_bwd(fn, q, k, v, causal, grad_out)
            if fwd_ms is None:
                continue
            outputs[name] = out
            row[name] = {"fwd_tflops": flops / fwd_ms / 1e9, "bwd_tflops": 2.5 * flops / bwd_ms / 1e9,
                         "fwd_ms": fwd_ms, "bwd_ms": bwd_ms}
        if "ours" in outputs and "sdpa-flash" in outputs:
            row["max_abs_diff_vs_sdpa_flash"] = (outputs["ours"].float() - outputs["sdpa-flash"].float()).abs().max().item()
        results.append(row)
        tqdm.write(json.dumps(row))
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "results": results,
                   "autotuned_configs": autotuned_configs()}, f, indent=1)
    print(markdown_table(results, list(impls)))


def autotuned_configs():
    """The config each of our autotuned kernels picked, per autotune key (for docs/perf-notes.md)."""
    from flashformer.kernels import flash_bwd, flash_fwd

    tuners = {"fwd": flash_fwd._attn_fwd_tuned, "bwd_dkdv": flash_bwd._bwd_dkdv_tuned, "bwd_dq": flash_bwd._bwd_dq_tuned}
    return {name: {str(key): str(config) for key, config in tuner.cache.items()} for name, tuner in tuners.items()}


def markdown_table(results, names):
    """Fwd / bwd TFLOP/s per implementation, plus ours over the best SDPA backend."""
    head = "| head_dim | causal | seqlen | batch | " + " | ".join(names) + " | ours / best SDPA (fwd, bwd) | max diff |"
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
        diff = r.get("max_abs_diff_vs_sdpa_flash", math.nan)
        lines.append(f"| {r['head_dim']} | {'yes' if r['causal'] else 'no'} | {r['seqlen']} | {r['batch']} | "
                     + " | ".join(cells) + f" | {ratio} | {diff:.1e} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
