"""Where one attention call's kernels spend their cycles: Nsight Compute's counters per kernel, side by side.

For each (implementation, pass, seqlen) an ncu child runs hbm_traffic.py's --child (one warm-up forward +
backward, then one profiled causal bf16 call) with the sections below, and reads back every raw counter
they collect (``--page raw``). Per kernel the table shows its duration, registers, how busy the tensor
pipe and the issue slots were, the active warps, and the warp stall reasons that cost the most cycles per
issued instruction: the numbers that say whether a backward trails cuDNN on its matrix products, on
waiting, or on its other work. The JSON keeps every counter of every kernel.

On the H200 (ncu on PATH, counters readable; the clocks are left alone, as the device notes ask):

    python scripts/kernel_counters.py --impls ours ours-nondet sdpa-cudnn --passes bwd --seqlens 4096 16384

Each child takes ~20-60 s (start-up, warm-up, ncu's replays of each profiled kernel per section).
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import re
import subprocess

from hbm_traffic import IMPLS, PASSES, child_command, exit_without_counters, ncu_path  # scripts/ is sys.path[0]

SECTIONS = ("SpeedOfLight", "ComputeWorkloadAnalysis", "WarpStateStats", "Occupancy", "LaunchStats")
DURATION = "gpu__time_duration.sum"
REGISTERS = "launch__registers_per_thread"
ISSUE_BUSY = "sm__issue_active.avg.pct_of_peak_sustained_elapsed"  # issue slots busy, as the H200's ncu names it
WARPS_ACTIVE = "sm__warps_active.avg.pct_of_peak_sustained_active"
# the tensor pipe's share of active cycles: gmma (wgmma) on Hopper, hmma (mma) elsewhere; the busier one counts
TENSOR_PIPE = re.compile(r"sm__pipe_tensor_op_[a-z]+_cycles_active\.avg\.pct_of_peak_sustained_active$")
# cycles a warp spends stalled on each reason per issued instruction (WarpStateStats)
STALL = re.compile(r"smsp__average_warps?_issue_stalled_(\w+?)_per_issue_active\.ratio$")
TOP_STALLS = 4


def parse_raw_csv(text):
    """The kernels of ``ncu --page raw --csv`` output: one dict per kernel, counter name -> value (a float
    where it reads as a number, commas being thousands), beside "Kernel Name" and "ID". ncu's ``==PROF==``
    lines and the program's own output may surround the table: only quoted lines from the header on count;
    the line after the header holds the units."""
    lines = text.splitlines()
    header = next((i for i, line in enumerate(lines) if line.startswith('"ID"') and '"Kernel Name"' in line), None)
    if header is None:
        return []
    names, _units, *rows = csv.reader(line for line in lines[header:] if line.startswith('"'))
    kernels = []
    for row in rows:
        kernel = {}
        for name, value in zip(names, row):
            try:
                kernel[name] = float(value.replace(",", ""))
            except ValueError:
                kernel[name] = value
        kernels.append(kernel)
    return kernels


def summary(kernel):
    """The table's view of one kernel's counters; a counter ncu did not report is None."""
    def number(name):
        value = kernel.get(name)
        return value if isinstance(value, float) else None

    tensor = [value for name, value in kernel.items() if TENSOR_PIPE.match(name) and isinstance(value, float)]
    stalls = {match.group(1): value for name, value in kernel.items()
              if (match := STALL.match(name)) and isinstance(value, float)}
    duration = number(DURATION)
    return {"kernel": str(kernel.get("Kernel Name", "?")), "us": None if duration is None else duration / 1e3,
            "registers": number(REGISTERS), "tensor_pipe_pct": max(tensor, default=None),
            "issue_busy_pct": number(ISSUE_BUSY), "warps_active_pct": number(WARPS_ACTIVE),
            "top_stalls": sorted(stalls.items(), key=lambda item: -item[1])[:TOP_STALLS]}


def ncu_command(ncu, impl, pass_, seqlen, head_dim, batch, heads):
    sections = [arg for section in SECTIONS for arg in ("--section", section)]
    return [ncu, *sections, "--page", "raw", "--csv", "--print-units", "base", "--clock-control", "none",
            "--target-processes", "all", "--profile-from-start", "off",
            *child_command(impl, pass_, seqlen, head_dim, batch, heads)]


def measure(args, impl, pass_, seqlen, head_dim, batch):
    """One cell from its ncu child: its kernels' counters, or "error" saying why not."""
    cell = {"impl": impl, "pass": pass_, "seqlen": seqlen, "head_dim": head_dim, "batch": batch, "heads": args.heads}
    try:
        done = subprocess.run(ncu_command(args.ncu, impl, pass_, seqlen, head_dim, batch, args.heads),
                              capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {**cell, "error": f"ncu child ran past --timeout {args.timeout} s"}
    output = done.stdout + "\n" + done.stderr
    exit_without_counters(output)
    kernels = parse_raw_csv(output)
    if not kernels:
        tail = "\n".join(output.strip().splitlines()[-5:])
        return {**cell, "error": f"no kernel in ncu's output (exit {done.returncode}): {tail}"}
    return {**cell, "kernels": kernels}


def _fmt(value, spec):
    return "-" if value is None else format(value, spec)


def table(cells):
    """Markdown: one row per profiled kernel, cells in order; a failed cell gets one row saying why."""
    lines = ["| impl | pass | head_dim | seqlen | kernel | µs | registers | tensor pipe % | issue busy % "
             "| warps active % | top stalls (cycles per issued instruction) |", "|" + "---|" * 11]
    for cell in cells:
        where = f"| {cell['impl']} | {cell['pass']} | {cell['head_dim']} | {cell['seqlen']} |"
        if "error" in cell:
            lines.append(f"{where} error: {cell['error'][:120]} | | | | | | |")
            continue
        for kernel in map(summary, cell["kernels"]):
            stalls = ", ".join(f"{reason} {value:.1f}" for reason, value in kernel["top_stalls"]) or "-"
            lines.append(f"{where} {kernel['kernel'][:48]} | {_fmt(kernel['us'], '.1f')} | "
                         f"{_fmt(kernel['registers'], '.0f')} | {_fmt(kernel['tensor_pipe_pct'], '.1f')} | "
                         f"{_fmt(kernel['issue_busy_pct'], '.1f')} | {_fmt(kernel['warps_active_pct'], '.1f')} "
                         f"| {stalls} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--impls", nargs="+", choices=IMPLS, default=["ours", "ours-nondet", "sdpa-cudnn"])
    parser.add_argument("--passes", nargs="+", choices=PASSES, default=["bwd"])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[128])
    parser.add_argument("--batch", type=int, help="default: 16384 tokens per call, batch = 16384 // seqlen")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--timeout", type=float, default=240, help="seconds one ncu child may run")
    parser.add_argument("--ncu", default="ncu", help="the Nsight Compute CLI")
    parser.add_argument("--out", default="kernel_counters.json")
    args = parser.parse_args(argv)
    args.ncu = ncu_path(args.ncu)
    from flashformer.fileio import atomic_write_file
    from flashformer.profiling import benchmark_provenance

    cells = []
    # the implementations of one shape next to each other, as the table shows them
    for head_dim, pass_, seqlen, impl in itertools.product(args.head_dims, args.passes, args.seqlens, args.impls):
        cells.append(measure(args, impl, pass_, seqlen, head_dim, args.batch or max(1, 16384 // seqlen)))
        print(json.dumps({key: value for key, value in cells[-1].items() if key != "kernels"}), flush=True)
    record = {**benchmark_provenance(), "sections": list(SECTIONS), "causal": True, "dtype": "bfloat16",
              "cells": cells}
    atomic_write_file(args.out, lambda f: f.write(json.dumps(record, indent=1).encode()))
    print(table(cells))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
