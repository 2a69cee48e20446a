"""HBM traffic of one attention call: the DRAM bytes read and written, from Nsight Compute's counters.

Per (implementation, pass, seqlen) the script runs a child copy of itself under ``ncu``: the child makes
bf16 inputs, does one warm-up forward + backward (compilation, autotuning, cuDNN plans), then exactly one
profiled call between ``torch.cuda.profiler.start/stop`` (ncu runs with ``--profile-from-start off``).
The forward is profiled with inputs that require grad (it stores what the backward needs, as in
training); the backward is every kernel ``torch.autograd.grad(out, (q, k, v), dO)`` launches. Bytes are
``dram__bytes_read.sum`` and ``dram__bytes_write.sum`` summed over the profiled kernels. ncu replays each
kernel with L2 flushed first (its default ``--cache-control all``), so every kernel starts cold: a
kernel's re-reads of what the previous kernel left in L2 count as HBM reads here.

The floor is what any exact attention must move: forward reads q, k, v once and writes o and lse (fp32);
backward reads q, k, v, o, dO and lse and writes dq, dk, dv (delta = rowsum(o * dO) is computable from
what it reads). total / floor is how many times over that minimum an implementation goes.

On the H200 (needs ``ncu`` on PATH and permission to read GPU counters):

    python scripts/hbm_traffic.py --out hbm_traffic.json --plot hbm_traffic.png
    python scripts/hbm_traffic.py --head-dims 64 128 --impls ours sdpa-cudnn sdpa-flash --seqlens 4096

Budget of the default grid (ours, sdpa-cudnn, materialized x fwd, bwd x 1k, 4k, 16k; materialized stops
at 4k): 16 ncu children of ~15-30 s each (python and torch start-up, the warm-up, ncu's replay of each
profiled kernel), ~5-8 min in all, inside one 10-minute call. Each child has its own ``--timeout``.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import subprocess
import sys

METRICS = ("dram__bytes_read.sum", "dram__bytes_write.sum")
IMPLS = ("ours", "ours-nondet", "sdpa-cudnn", "sdpa-flash", "materialized")
PASSES = ("fwd", "bwd")
# ncu's byte units: SI prefixes are powers of 1000 (its "Mbyte"), with the binary ones for completeness
UNIT_BYTES = {"byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "Tbyte": 1e12, "KB": 1e3, "MB": 1e6,
              "GB": 1e9, "TB": 1e12, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def floor_bytes(batch, heads, seqlen, head_dim, pass_, element_size=2):
    """(bytes read, bytes written) that one exact attention call cannot avoid.

    Args:
        batch, heads, seqlen, head_dim: the shape of q, k, v, o (batch, seqlen, heads, head_dim).
        pass_: "fwd" (read q, k, v; write o, lse) or "bwd" (read q, k, v, o, dO, lse; write dq, dk, dv).
        element_size: bytes per element of q, k, v and their gradients (2 for bf16); lse is fp32.
    """
    tensor = batch * seqlen * heads * head_dim * element_size
    lse = batch * heads * seqlen * 4
    if pass_ == "fwd":
        return 3 * tensor, tensor + lse
    if pass_ == "bwd":
        return 5 * tensor + lse, 3 * tensor
    raise ValueError(f"pass_ must be one of {PASSES}, got {pass_!r}")


def parse_ncu_csv(text):
    """The metric rows of ``ncu --csv`` output as dicts keyed by its header ("ID", "Kernel Name", ...,
    "Metric Name", "Metric Unit", "Metric Value"). ncu's ``==PROF==`` lines and the program's own output
    may surround and interleave the table: only quoted lines from the header on are read."""
    lines = text.splitlines()
    header = next((i for i, line in enumerate(lines) if line.startswith('"ID"') and '"Metric Value"' in line), None)
    if header is None:
        return []
    table = [line for line in lines[header:] if line.startswith('"')]
    return list(csv.DictReader(table))


def dram_bytes(rows):
    """(bytes read, bytes written, kernels profiled) summed over the parsed ncu rows.

    Raises:
        ValueError: no row holds the DRAM metrics, or a value or unit is not a byte count.
    """
    totals = dict.fromkeys(METRICS, 0.0)
    kernels = set()
    for row in rows:
        name = row["Metric Name"]
        if name not in totals:
            continue
        unit, value = row["Metric Unit"], row["Metric Value"].replace(",", "")  # "1,234,567": thousands
        if unit not in UNIT_BYTES:
            raise ValueError(f"ncu reported {name} in unit {unit!r}, not one of {sorted(UNIT_BYTES)}")
        try:
            totals[name] += float(value) * UNIT_BYTES[unit]
        except ValueError:
            raise ValueError(f"ncu reported {name} = {row['Metric Value']!r} for kernel {row['Kernel Name']!r}, "
                             "not a number") from None
        kernels.add(row["ID"])
    if not kernels:
        raise ValueError(f"ncu's output holds no {' / '.join(METRICS)} rows: no kernel was profiled")
    return totals[METRICS[0]], totals[METRICS[1]], len(kernels)


def ncu_path(name):
    """The path of the Nsight Compute CLI ``name`` (--ncu), or exit saying how to get one."""
    path = shutil.which(name)
    if path is None:
        sys.exit(f"--ncu {name!r}: Nsight Compute's CLI is not on PATH; install Nsight Compute (it comes "
                 "with the CUDA toolkit) or pass --ncu /path/to/ncu")
    return path


def exit_without_counters(output):
    """Exit, saying why, where an ncu child's output says it may not read the GPU's counters: every other
    child would fail the same way."""
    if "ERR_NVGPUCTRPERM" in output:
        sys.exit("ncu may not read the GPU's counters (ERR_NVGPUCTRPERM): run as root, or load the driver "
                 "with NVreg_RestrictProfilingToAdminUsers=0")


def child_command(impl, pass_, seqlen, head_dim, batch, heads):
    """The argv of this script in --child mode: one profiled call of ``impl``'s ``pass_`` (causal, bf16)
    between cudaProfilerStart / Stop, for an ncu started with ``--profile-from-start off``."""
    return [sys.executable, os.path.abspath(__file__), "--child", impl, pass_, "--seqlens", str(seqlen),
            "--head-dims", str(head_dim), "--batch", str(batch), "--heads", str(heads)]


def ncu_command(ncu, impl, pass_, seqlen, head_dim, batch, heads):
    """The argv of one ncu child (child_command), the metrics printed as CSV in plain bytes."""
    return [ncu, "--metrics", ",".join(METRICS), "--csv", "--print-units", "base", "--target-processes", "all",
            "--profile-from-start", "off", *child_command(impl, pass_, seqlen, head_dim, batch, heads)]


def profiled_call(impl, pass_, seqlen, head_dim, batch, heads):
    """The child: one warm-up forward + backward, then one profiled forward or backward."""
    import torch

    from bench_attention import SDPA_BACKENDS, _ours, _ours_nondeterministic, _sdpa  # scripts/ is sys.path[0]
    from flashformer.kernels import attention_materialized

    fns = {"ours": _ours, "ours-nondet": _ours_nondeterministic,
           "materialized": lambda q, k, v, causal: attention_materialized(q, k, v, causal=causal, upcast=False)[0],
           **{name: _sdpa(b) for name, b in SDPA_BACKENDS.items()}}
    q, k, v = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    grad_out = torch.randn_like(q)
    torch.autograd.grad(fns[impl](q, k, v, True), (q, k, v), grad_out)
    torch.cuda.synchronize()
    out = None if pass_ == "fwd" else fns[impl](q, k, v, True)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    if pass_ == "fwd":
        fns[impl](q, k, v, True)
    else:
        torch.autograd.grad(out, (q, k, v), grad_out)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def measure(args, impl, pass_, seqlen, head_dim):
    """One grid cell from its ncu child: a result row, or a row with "error" saying why not."""
    row = {"impl": impl, "pass": pass_, "seqlen": seqlen, "head_dim": head_dim, "batch": args.batch,
           "heads": args.heads}
    floor_read, floor_written = floor_bytes(args.batch, args.heads, seqlen, head_dim, pass_)
    row.update(floor_read=floor_read, floor_written=floor_written)
    if impl == "materialized" and seqlen > args.materialized_max_seqlen:
        return {**row, "error": f"skipped: the score matrices do not fit above {args.materialized_max_seqlen}"}
    command = ncu_command(args.ncu, impl, pass_, seqlen, head_dim, args.batch, args.heads)
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {**row, "error": f"ncu child ran past --timeout {args.timeout} s"}
    output = done.stdout + "\n" + done.stderr  # the table, ncu's notes and the child's errors
    exit_without_counters(output)
    try:
        read, written, kernels = dram_bytes(parse_ncu_csv(output))
    except ValueError as error:
        tail = "\n".join(output.strip().splitlines()[-5:])
        return {**row, "error": f"{error} (exit {done.returncode}): {tail}"}
    return {**row, "read": read, "written": written, "kernels": kernels}


def table(rows):
    """The results as a markdown table, MB = 1e6 bytes."""
    lines = ["| impl | pass | head_dim | seqlen | kernels | read MB | written MB | total MB | floor MB | total / floor |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        floor = r["floor_read"] + r["floor_written"]
        if "error" in r:
            lines.append(f"| {r['impl']} | {r['pass']} | {r['head_dim']} | {r['seqlen']} | | | | | "
                         f"{floor / 1e6:.1f} | {r['error'].splitlines()[0]} |")
            continue
        total = r["read"] + r["written"]
        lines.append(f"| {r['impl']} | {r['pass']} | {r['head_dim']} | {r['seqlen']} | {r['kernels']} | "
                     f"{r['read'] / 1e6:.1f} | {r['written'] / 1e6:.1f} | {total / 1e6:.1f} | {floor / 1e6:.1f} | "
                     f"{total / floor:.2f} |")
    return "\n".join(lines)


def plot(rows, path):
    """Total bytes against seqlen on log-log axes, one line per impl and the floor dashed: a row of
    panels per head_dim, forward left, backward right. Returns False (writes nothing) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    head_dims = sorted({r["head_dim"] for r in rows})
    fig, axes = plt.subplots(len(head_dims), 2, figsize=(10, 3.6 * len(head_dims)), squeeze=False)
    for i, head_dim in enumerate(head_dims):
        for j, pass_ in enumerate(PASSES):
            ax, cells = axes[i][j], [r for r in rows if (r["head_dim"], r["pass"]) == (head_dim, pass_)]
            for impl in dict.fromkeys(r["impl"] for r in cells):
                done = sorted((r["seqlen"], r["read"] + r["written"]) for r in cells if r["impl"] == impl
                              and "error" not in r)
                if done:
                    ax.plot(*zip(*done), marker="o", label=impl)
            floor = sorted({(r["seqlen"], r["floor_read"] + r["floor_written"]) for r in cells})
            ax.plot(*zip(*floor), "k--", label="floor")
            ax.set(xscale="log", yscale="log", xlabel="seqlen", ylabel="HBM bytes per call",
                   title=f"{'forward' if pass_ == 'fwd' else 'backward'}, head_dim {head_dim}, causal")
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--impls", nargs="+", choices=IMPLS, default=["ours", "sdpa-cudnn", "materialized"])
    parser.add_argument("--passes", nargs="+", choices=PASSES, default=list(PASSES))
    parser.add_argument("--seqlens", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[128])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--materialized-max-seqlen", type=int, default=4096,
                        help="longer lengths skip materialized (its fp32 and bf16 score matrices outgrow the GPU)")
    parser.add_argument("--timeout", type=float, default=240, help="seconds one ncu child may run")
    parser.add_argument("--ncu", default="ncu", help="the Nsight Compute CLI")
    parser.add_argument("--out", default="hbm_traffic.json")
    parser.add_argument("--plot", default="hbm_traffic.png", help="PNG of bytes against seqlen (needs matplotlib)")
    parser.add_argument("--child", nargs=2, metavar=("IMPL", "PASS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        if args.child[0] not in IMPLS or args.child[1] not in PASSES:
            parser.error(f"--child takes one of {IMPLS} and one of {PASSES}, got {args.child}")
        return profiled_call(*args.child, args.seqlens[0], args.head_dims[0], args.batch, args.heads)
    args.ncu = ncu_path(args.ncu)

    from flashformer.fileio import atomic_write_file
    from flashformer.profiling import benchmark_provenance

    rows = []
    for head_dim in args.head_dims:
        for impl in args.impls:
            for pass_ in args.passes:
                for seqlen in args.seqlens:
                    rows.append(measure(args, impl, pass_, seqlen, head_dim))
                    print(json.dumps(rows[-1]), flush=True)
    record = {**benchmark_provenance(), "metrics": list(METRICS), "causal": True, "dtype": "bfloat16",
              "results": rows}
    atomic_write_file(args.out, lambda f: f.write(json.dumps(record, indent=1).encode()))
    print(table(rows))
    print(f"wrote {args.out}")
    if plot(rows, args.plot):
        print(f"wrote {args.plot}")
    else:
        print(f"no plot: matplotlib is not installed (pip install matplotlib), {args.plot} not written")


if __name__ == "__main__":
    main()
