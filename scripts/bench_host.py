"""Host time of one attention call against its kernels' device time, with and without direct launches.

A forward + backward at a short length spends as long in Python and Triton's launch path as on the GPU;
wherever the host is the slower, the step waits on it. For each shape, in a child process per launch
mode (FLASHFORMER_DIRECT_LAUNCH is read at import): host ms per call (the median of HOST_ROUNDS rounds of
HOST_CALLS calls queued behind a GPU sleep, so that the device neither runs them nor fills its launch queue,
which would hold the host to the device's pace), the kernels' device ms per call (torch.profiler), forward alone and forward +
backward (bf16, causal by default), and the same call through SDPA's cuDNN backend for scale.

    python3 scripts/bench_host.py --shapes 15x1024x16x128 16x1024x32x64 --out bench_host.json

Shapes are BATCHxSEQLENxHEADSxHEAD_DIM[:full]. Prints a markdown table last (CUDA only). With --profile N, the
direct-launch child also runs cProfile over our forward + backward (HOST_ROUNDS rounds of HOST_CALLS calls, queued
behind a GPU sleep as above) and prints its N functions of most own time, per call.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch

from flashformer.profiling import HOST_CALLS, HOST_ROUNDS, check_specs, host_ms_per_call, host_profile

DEFAULT_SHAPES = ["15x1024x16x128", "16x1024x32x64"]  # beside the 704-token shape's tuned one; gpt2's heads
MODES = {"direct": "1", "Triton's launch path": "0"}


def parse_shape(spec):
    """(batch, seqlen, heads, head_dim, causal) of a BATCHxSEQLENxHEADSxHEAD_DIM[:full] spec."""
    dims, _, mask = spec.partition(":")
    try:
        batch, seqlen, heads, head_dim = (int(n) for n in dims.split("x"))
    except ValueError:
        raise ValueError(f"--shapes: {spec!r} is not BATCHxSEQLENxHEADSxHEAD_DIM[:full]") from None
    if mask not in ("", "full", "causal") or min(batch, seqlen, heads, head_dim) < 1:
        raise ValueError(f"--shapes: {spec!r} needs sizes >= 1 and the mask full or causal")
    return batch, seqlen, heads, head_dim, mask != "full"


def host_and_device_ms(fn):
    """(host ms per call, device ms per call of the kernels it launches)."""
    from flashformer.profiling import kernel_times

    for _ in range(10):
        fn()
    host_ms = host_ms_per_call(fn)
    times, _ = kernel_times(fn, 20)
    return host_ms, sum(times.values())


def child(spec, profile_top):
    """One shape's timings in this process (its launch mode set by the parent), and with ``profile_top`` our
    forward + backward's host profile; one JSON line."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from flashformer.kernels import flash_attn_func

    batch, seqlen, heads, head_dim, causal = parse_shape(spec)
    q, k, v = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    grad_out = torch.randn_like(q)

    def ours_forward():
        with torch.no_grad():
            flash_attn_func(q, k, v, causal=causal)

    def ours_step():
        flash_attn_func(q, k, v, causal=causal).backward(grad_out)
        q.grad = k.grad = v.grad = None

    def cudnn(backward):
        def call():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION), torch.set_grad_enabled(backward):
                out = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)),
                                                                       is_causal=causal)
                if backward:
                    out.backward(grad_out.transpose(1, 2))
                    q.grad = k.grad = v.grad = None
        return call

    row = {"shape": spec}
    for name, fn in (("ours forward", ours_forward), ("ours forward + backward", ours_step),
                     ("cuDNN forward", cudnn(False)), ("cuDNN forward + backward", cudnn(True))):
        row[name] = dict(zip(("host_ms", "device_ms"), host_and_device_ms(fn)))
    if profile_top:
        row["host_profile"] = host_profile(ours_step, profile_top)
    print(json.dumps(row))


def run(spec, direct, profile_top):
    command = [sys.executable, os.path.abspath(__file__), "--child", spec, "--profile", str(profile_top)]
    done = subprocess.run(command, capture_output=True, text=True, env=dict(os.environ, FLASHFORMER_DIRECT_LAUNCH=direct), timeout=600)
    if done.returncode != 0:
        tail = done.stderr.strip().splitlines()
        return {"shape": spec, "error": tail[-1] if tail else f"exit {done.returncode}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def markdown(rows):
    lines = ["| shape | launches | call | host ms | device ms | host / device |", "|---|---|---|---|---|---|"]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['shape']} | {row['mode']} | error: {row['error'][:80]} | | | |")
            continue
        for call in ("ours forward", "ours forward + backward", "cuDNN forward", "cuDNN forward + backward"):
            host, device = row[call]["host_ms"], row[call]["device_ms"]
            lines.append(f"| {row['shape']} | {row['mode']} | {call} | {host:.3f} | {device:.3f} | {host / device:.2f} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES, metavar="BxSxHxD[:full]")
    parser.add_argument("--out", default="bench_host.json")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="also print the N functions of most host time in our forward + backward (direct launches)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args.child, args.profile)
    if args.profile < 0:
        parser.error("--profile: a count of functions, 0 or more")
    check_specs(parser, args.shapes, parse_shape)
    if not torch.cuda.is_available():
        raise SystemExit("bench_host.py times CUDA launches: no CUDA device here")
    from flashformer.profiling import benchmark_provenance

    specs = args.shapes
    rows = [{**run(spec, direct, args.profile if direct == "1" else 0), "mode": mode}
            for spec in specs for mode, direct in MODES.items()]
    with open(args.out, "w") as f:
        json.dump({**benchmark_provenance(), "host_calls": HOST_CALLS, "host_rounds": HOST_ROUNDS, "rows": rows}, f, indent=1)
    for row in rows:
        if row.get("host_profile"):
            print(f"\nhost profile, {row['shape']}, our forward + backward: function | calls | own ms | cumulative ms")
            for name, calls, own, cumulative in row["host_profile"]:
                print(f"  {name} | {calls} | {own:.4f} | {cumulative:.4f}")
    print(markdown(rows))


if __name__ == "__main__":
    main()
