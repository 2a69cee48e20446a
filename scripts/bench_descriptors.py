"""What a TMA descriptor built inside a kernel costs per program, against one built on the host
and against plain pointer loads: the fixed cost per program that would weigh most in short-sequence
attention and batch-1 decoding, where programs run few tiles.

Each program streams TILES tiles of (BLOCK, HEAD_DIM) bf16 and reduces them, as attention programs
stream K/V. With TILES = 1 the per-program cost dominates; with many tiles only bandwidth counts.
The three variants must agree on every sum (checked before timing; on CPU, in Triton's interpreter,
only the check runs).

    python scripts/bench_descriptors.py               # H200: table of µs per launch and per program
"""

from __future__ import annotations

import argparse
import os

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from flashformer.kernels.launch import ensure_allocator

BLOCK, HEAD_DIM = 64, 128


@triton.jit
def _sum_through(desc, OUT, TILES: tl.constexpr, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr):
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK, HEAD_DIM], dtype=tl.float32)
    for t in tl.range(TILES):
        acc += desc.load([(pid * TILES + t) * BLOCK, 0]).to(tl.float32)
    tl.store(OUT + pid, tl.sum(acc))


@triton.jit
def _sum_device_descriptor(X, OUT, rows, TILES: tl.constexpr, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr):
    desc = tl.make_tensor_descriptor(X, shape=[rows, HEAD_DIM], strides=[HEAD_DIM, 1], block_shape=[BLOCK, HEAD_DIM])
    _sum_through(desc, OUT, TILES, BLOCK, HEAD_DIM)


@triton.jit
def _sum_host_descriptor(desc, OUT, TILES: tl.constexpr, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr):
    _sum_through(desc, OUT, TILES, BLOCK, HEAD_DIM)


@triton.jit
def _sum_pointers(X, OUT, TILES: tl.constexpr, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr):
    pid = tl.program_id(0)
    offsets = tl.arange(0, BLOCK)[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :]
    acc = tl.zeros([BLOCK, HEAD_DIM], dtype=tl.float32)
    for t in tl.range(TILES):
        acc += tl.load(X + (pid * TILES + t).to(tl.int64) * BLOCK * HEAD_DIM + offsets).to(tl.float32)
    tl.store(OUT + pid, tl.sum(acc))


def launchers(x, programs, tiles):
    """{variant: a function launching it over ``x`` (programs * tiles * BLOCK rows) into a fresh output}."""
    ensure_allocator(x.device)
    meta = dict(TILES=tiles, BLOCK=BLOCK, HEAD_DIM=HEAD_DIM)
    host_desc = TensorDescriptor.from_tensor(x, [BLOCK, HEAD_DIM])

    def run(kernel, *args):
        out = torch.empty(programs, device=x.device, dtype=torch.float32)
        kernel[(programs,)](*args[:1], out, *args[1:], **meta)
        return out

    return {
        "device descriptor": lambda: run(_sum_device_descriptor, x, x.shape[0]),
        "host descriptor": lambda: run(_sum_host_descriptor, host_desc),
        "pointers": lambda: run(_sum_pointers, x),
    }


def checked_launchers(programs, tiles, device):
    """{variant: launcher, or the error it raised}: each launcher's sums checked against torch's."""
    x = torch.randn(programs * tiles * BLOCK, HEAD_DIM, device=device, dtype=torch.bfloat16)
    expected = x.float().view(programs, -1).sum(1)
    runs = {}
    for name, run in launchers(x, programs, tiles).items():
        try:
            torch.testing.assert_close(run(), expected, rtol=1e-4, atol=1e-2)
            runs[name] = run
        except Exception as error:  # a variant this Triton cannot build is a result, not a crash
            runs[name] = f"{type(error).__name__}: {str(error).splitlines()[0][:100]}"
    return runs


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--programs", type=int, nargs="+", default=[1024, 8192])
    parser.add_argument("--tiles", type=int, nargs="+", default=[1, 8, 64])
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        if os.environ.get("TRITON_INTERPRET") != "1":
            parser.error("needs a CUDA GPU (or TRITON_INTERPRET=1 for the correctness check alone)")
        failed = {name: run for name, run in checked_launchers(4, 2, "cpu").items() if isinstance(run, str)}
        print(f"interpreter: failed {failed}" if failed else "interpreter: the three variants agree")
        return
    print("| programs | tiles each | variant | µs per launch | ns per program | GB/s |\n|---|---|---|---|---|---|")
    for programs in args.programs:
        for tiles in args.tiles:
            for name, run in checked_launchers(programs, tiles, "cuda").items():
                if isinstance(run, str):
                    print(f"| {programs} | {tiles} | {name} | {run} | | |")
                    continue
                ms = triton.testing.do_bench(run, return_mode="median")
                gbytes = programs * tiles * BLOCK * HEAD_DIM * 2 / 1e9
                print(f"| {programs} | {tiles} | {name} | {ms * 1e3:.1f} | {ms * 1e6 / programs:.0f} | "
                      f"{gbytes / (ms * 1e-3):.0f} |")


if __name__ == "__main__":
    main()
