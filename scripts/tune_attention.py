"""Offline tile-config sweep for the attention kernels on this GPU -> kernels/tuned_configs.json.

The autotuner times each candidate briefly at first use, and for sub-millisecond shapes its pick
changes from run to run (its few timings do not separate the candidates). This script times every candidate of each kernel's
autotune space (kernels/tuning.py) with long do_bench runs over bench_attention's grid (bf16,
batch * seqlen = 16384 tokens, heads * head_dim = 2048; 8 heads at head_dim 256), and records the
fastest per (kernel, head_dim, causal, seqlen). The launchers then use that table for dense and
varlen calls without window or softcap, and the autotuner for everything else.

Order: the forward; then the dK/dV kernel with dQ at its default config; then dQ with dK/dV at
its pick; then, alone, the dK/dV kernel that also accumulates dQ (deterministic=False). Every
candidate's results are compared with the default config's (a candidate that computes something
else is dropped and reported). Compilation, the slow part, is spread over
worker processes first (they fill Triton's on-disk cache).

    python scripts/tune_attention.py                     # the full grid, head_dim 64 / 128 / 256
    python scripts/tune_attention.py --head-dims 128 --seqlens 1024 4096 --dry-run
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import os
import re
import tempfile

import torch
import triton
from tqdm import tqdm

os.environ.setdefault("FLASHFORMER_AUTOTUNE", "0")  # every launch here names its configs

from flashformer.kernels import tuning
from flashformer.kernels.flash_bwd import attention_backward
from flashformer.kernels.flash_fwd import attention_forward

KINDS = ("fwd", "bwd_dkdv", "bwd_dq", "bwd_fused")  # bwd_fused: the deterministic=False backward


def candidates(kind, head_dim):
    """The autotune space of ``kind``, pruned for shared memory, as kernel meta-parameter dicts."""
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    configs = tuning.prune_configs(kind, tuning._gpu_configs(kind), {"HEAD_DIM_PAD": head_dim_pad})
    return [tuning.config_from_shape(tuning._shape(c)) for c in configs]


def make_inputs(batch, seqlen, heads, head_dim, seed=0):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v, grad_out = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16,
                                     generator=generator) for _ in range(4))
    return q, k, v, grad_out


def run_once(kind, inputs, causal, forced, forward=None):
    """One launch of ``kind`` with the kernel configs in ``forced``: the forward's (out, lse), or the
    backward's (dq, dk, dv) on ``forward`` = (out, lse), computed here when not given."""
    tuning.FORCED_CONFIGS.clear()
    tuning.FORCED_CONFIGS.update(forced)
    q, k, v, grad_out = inputs
    scale, window_right = q.shape[-1] ** -0.5, (0 if causal else -1)
    if kind == "fwd" or forward is None:
        forward = attention_forward(q, k, v, scale, -1, window_right, 0.0)
    if kind == "fwd":
        return forward
    out, lse = forward
    return attention_backward(grad_out, None, q, k, v, out, lse, scale, -1, window_right, 0.0,
                              deterministic=kind != "bwd_fused")


def default_configs(head_dim):
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    return {kind: tuning._default_gpu_config(kind, head_dim_pad) for kind in KINDS}


def _compile_jobs(jobs):
    """Worker: launch each (kind, config, head_dim, heads, causal) once on small inputs, filling
    Triton's disk cache. The inputs share the grid's specialisations (every size a multiple of 16)."""
    failed = []
    for kind, config, head_dim, heads, causal in jobs:
        try:
            run_once(kind, make_inputs(1, 256, heads, head_dim), causal, {**default_configs(head_dim), kind: config})
        except Exception as error:  # out of resources etc.: the timing pass skips it too
            failed.append((kind, config, head_dim, causal, repr(error)[:200]))
    torch.cuda.synchronize()
    return failed


def precompile(cells, workers):
    shapes = sorted({(head_dim, heads, causal) for head_dim, _, heads, causal in cells})
    jobs = [(kind, config, head_dim, heads, causal) for head_dim, heads, causal in shapes
            for kind in KINDS for config in candidates(kind, head_dim)]
    chunks = [jobs[i::workers] for i in range(workers)]
    context = multiprocessing.get_context("spawn")  # CUDA cannot be forked
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
        failed = [f for result in tqdm(pool.map(_compile_jobs, chunks), total=workers, desc="compile")
                  for f in result]
    for kind, config, head_dim, causal, error in failed:
        print(f"compile failed: {kind} d{head_dim} causal={causal} {config}: {error}")


def _close(got, want):
    """Same math, another tiling: bf16 rounding differences only."""
    return all(torch.isfinite(g).all() and (g.float() - w.float()).abs().max() <= 2e-2 * w.float().abs().max() + 1e-2
               for g, w in zip(got, want))


def tune_cell(head_dim, seqlen, heads, causal, tokens, rep_ms, fallback_table=None):
    """{kind: (best config, its ms, the default's ms, the fallback's ms)} for one grid point, plus rejected
    candidates. The fallback is ``fallback_table``'s config for the cell (another GPU's offline table, the one
    this GPU would launch with otherwise: tuning.table_for), timed among the candidates; NaN where there is none.
    A backward kernel's time includes the preprocess and the other backward kernel (held fixed)."""
    inputs = make_inputs(max(1, tokens // seqlen), seqlen, heads, head_dim)
    defaults = default_configs(head_dim)
    picks, rejected = {}, []
    forward = None
    for kind in KINDS:
        forced = {**defaults, **{done: picks[done][0] for done in picks}}
        if kind != "fwd" and forward is None:
            forward = run_once("fwd", inputs, causal, forced)
        reference = run_once(kind, inputs, causal, forced, forward)
        timings = {}
        configs = candidates(kind, head_dim)
        for config in configs + ([defaults[kind]] if defaults[kind] not in configs else []):
            trial = {**forced, kind: config}
            try:
                if not _close(run_once(kind, inputs, causal, trial, forward), reference):
                    rejected.append((kind, config, "results differ from the default config"))
                    continue
                ms = triton.testing.do_bench(lambda: run_once(kind, inputs, causal, trial, forward),
                                             rep=rep_ms, return_mode="median")
            except Exception as error:
                rejected.append((kind, config, repr(error)[:200]))
                continue
            timings[tuple(sorted(config.items()))] = ms
        default_ms = timings.get(tuple(sorted(defaults[kind].items())), float("nan"))
        fallback = tuning.config_in_table(fallback_table or {}, kind, max(16, triton.next_power_of_2(head_dim)),
                                          causal, seqlen)
        fallback_ms = timings.get(tuple(sorted(fallback.items())), float("nan")) if fallback else float("nan")
        best = min(timings, key=timings.get)
        picks[kind] = (dict(best), timings[best], default_ms, fallback_ms)
    tuning.FORCED_CONFIGS.clear()
    return picks, rejected


def read_tables(path):
    """Every GPU's offline table in the JSON file at ``path`` (none if it does not exist)."""
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def write_table(path, device_name, capability, results):
    """Merge this run's picks into the JSON table (other GPUs' entries kept), atomically."""
    table = read_tables(path)
    entries = table.setdefault(device_name, {})
    entries["capability"] = capability
    for r in results:
        for kind, (config, *_) in r["picks"].items():
            key = f"d{max(16, triton.next_power_of_2(r['head_dim']))}-{'causal' if r['causal'] else 'full'}"
            entries.setdefault(kind, {}).setdefault(key, {})[str(r["seqlen"])] = list(tuning.shape_of_config(config))
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), suffix=".json")
    with os.fdopen(fd, "w") as f:
        text = json.dumps(table, indent=1, sort_keys=True)
        f.write(re.sub(r"\[\s*([^\[\]{}]*?)\s*\]", lambda m: "[" + " ".join(m.group(1).split()) + "]", text) + "\n")
    os.replace(tmp, path)


def markdown_table(results, fallback_name=None):
    """Per grid point: each kernel's pick and its speed-up over the default config (the pick's
    time includes what the kernel needs first: the forward under the backward kernels); with
    ``fallback_name``, also the speed of that GPU's pick here as a share of the best's ("-": none for the cell)."""
    fallback = f" | {fallback_name}'s pick" if fallback_name else ""
    names = ("fwd", "dK/dV", "dQ", "fused (deterministic=False)")
    lines = ["| head_dim | causal | seqlen | " + " | ".join(f"{name} pick | x default{fallback}" for name in names) + " |",
             "|---|---|---|" + "---|" * (len(names) * (3 if fallback_name else 2))]
    for r in results:
        cells = []
        for kind in KINDS:
            config, ms, default_ms, fallback_ms = r["picks"][kind]
            cap = f" r{config['maxnreg']}" if "maxnreg" in config else ""
            cells += [f"{config['BLOCK_M']}x{config['BLOCK_N']} w{config['num_warps']} s{config['num_stages']}{cap}",
                      f"{default_ms / ms:.2f}"]
            if fallback_name:
                cells.append("-" if fallback_ms != fallback_ms else f"{ms / fallback_ms:.2f}")
        lines.append(f"| {r['head_dim']} | {'yes' if r['causal'] else 'no'} | {r['seqlen']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    parser.add_argument("--tokens", type=int, default=16384, help="batch * seqlen")
    parser.add_argument("--width", type=int, default=2048, help="heads * head_dim")
    parser.add_argument("--heads-256", type=int, default=8, help="heads at head_dim 256")
    parser.add_argument("--rep-ms", type=int, default=200, help="do_bench time per candidate")
    parser.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1), help="compile processes")
    parser.add_argument("--out", default=tuning.TUNED_CONFIGS_PATH)
    parser.add_argument("--json", default=None, help="also write every timing here")
    parser.add_argument("--dry-run", action="store_true", help="print the picks, leave --out alone")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (the table records that GPU's measurements)")
    causal_values = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    cells = [(d, s, args.heads_256 if d == 256 else args.width // d, c)
             for d in args.head_dims for c in causal_values for s in args.seqlens]
    precompile(cells, args.workers)
    device_name, capability = torch.cuda.get_device_name(), tuning.device_capability()
    # The table this GPU would launch with if it had none of its own, timed beside the sweep's picks.
    fallback_name, fallback_table = tuning.sibling_table(read_tables(args.out), device_name, capability)
    results = []
    for head_dim, seqlen, heads, causal in tqdm(cells, desc="tune"):
        picks, rejected = tune_cell(head_dim, seqlen, heads, causal, args.tokens, args.rep_ms, fallback_table)
        for kind, config, why in rejected:
            print(f"rejected d{head_dim} causal={causal} s{seqlen} {kind} {config}: {why}")
        results.append({"head_dim": head_dim, "seqlen": seqlen, "heads": heads, "causal": causal, "picks": picks})
        if not args.dry_run:  # after every cell: a run cut short by a time limit keeps what it measured
            write_table(args.out, device_name, capability, results[-1:])
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": device_name, "torch": torch.__version__, "triton": triton.__version__,
                           "fallback": fallback_name, "results": results}, f, indent=1)
    if not args.dry_run:
        print(f"wrote {args.out} [{device_name}]")
    print(markdown_table(results, fallback_name))


if __name__ == "__main__":
    main()
