"""Peak memory and speed of one batch-1 training step as the sequence grows, per attention backend.

Every cell is one training step (forward, backward, AdamW step) of a model config at one sequence
length, for one attention backend with or without activation checkpointing. The linear-memory
backend (flash) also runs the LM head and cross-entropy in chunks (``Transformer.loss``
with a forced chunk size); the other columns materialize the (tokens x vocab) logits, as a plain
training loop does. ``--no-chunked-loss`` materializes them everywhere.

Each cell runs in its own Python process, so an out-of-memory cell cannot poison the next one and
every peak starts clean. A cell runs a warm-up step, then a timed step (tokens/s), and reports:

* CUDA: ``torch.cuda.max_memory_allocated()`` of the timed step in GB (parameters, gradients and
  AdamW state included), bf16 autocast, fused AdamW.
* CPU: the process's peak RSS over both steps in MB, above its peak RSS once the model and the
  optimizer were built (so: activations, gradients, AdamW state), fp32.

An out-of-memory error, or a child killed by the kernel, marks the cell "OOM" and that column stops
growing; the sweep ends when every column has stopped or ``--max`` is reached.

    python scripts/memory_savings.py --config configs/models/llama-125m.yaml --out memory.json  # GPU: 1k .. 1M
    python scripts/memory_savings.py --set n_head=2 --seqlens 1024 4096 --backends naive flash  # CPU demo
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import signal
import subprocess
import sys
import time

import torch
from tqdm import tqdm

from flashformer.attention import ATTN_BACKENDS
from flashformer.config import config_to_dict, load_config
from flashformer.batches import Batch
from flashformer.losses import default_chunk_size
from flashformer.model import ModelConfig, Transformer
from flashformer.parallel import apply_activation_checkpointing
from flashformer.train.step import train_step

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_CONFIGS = {"cuda": "configs/models/llama-125m.yaml", "cpu": "configs/models/tiny-llama.yaml"}
DEFAULT_MAX_SEQLEN = {"cuda": 2**20, "cpu": 8192}
PEAK_UNITS = {"cuda": "GB", "cpu": "MB"}
PEAK_MEASURES = {"cuda": "torch.cuda.max_memory_allocated() of the timed step (bf16 autocast, fused AdamW)",
                 "cpu": "peak RSS of the process above its peak once model and optimizer were built (fp32)"}
# Backends whose attention memory grows linearly with the sequence; they get the chunked LM head.
LINEAR_MEMORY_BACKENDS = ("flash",)
# ru_maxrss is in kilobytes on Linux, in bytes on macOS.
RU_MAXRSS_BYTES = 1 if sys.platform == "darwin" else 1024
# RuntimeError texts of a failed allocation: the CPU allocator's, CUDA's, cuBLAS's.
OUT_OF_MEMORY_MESSAGES = ("can't allocate memory", "out of memory", "CUBLAS_STATUS_ALLOC_FAILED")
# The child's result travels on a stdout line that starts with this; anything else it prints is ignored.
RESULT_PREFIX = "MEMORY_SAVINGS_RESULT "


@dataclasses.dataclass(frozen=True)
class Column:
    """One combination of the table: attention backend, activation checkpointing, chunked LM head."""

    backend: str
    checkpointing: bool
    chunked_loss: bool

    @property
    def label(self) -> str:
        return "".join((self.backend, " + ckpt" if self.checkpointing else "",
                        " + chunked CE" if self.chunked_loss else ""))


# ----- the child: one cell -----

def _is_out_of_memory(err: BaseException) -> bool:
    """CUDA's caching allocator raises torch.OutOfMemoryError; the CPU allocator and CUDA calls that allocate
    on their own (cuBLAS workspaces) raise RuntimeErrors that say so."""
    return (isinstance(err, (torch.OutOfMemoryError, MemoryError))
            or (isinstance(err, RuntimeError) and any(text in str(err) for text in OUT_OF_MEMORY_MESSAGES)))


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * RU_MAXRSS_BYTES


def _limit_address_space(extra_mb: int) -> None:
    """Let the process map at most ``extra_mb`` MB more than it maps now (Linux), so that a small limit
    hits the training step rather than the interpreter and the parameters."""
    with open("/proc/self/statm") as statm:
        mapped_bytes = int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (mapped_bytes + extra_mb * 10**6, hard))


def _train_step(model, optimizer, input_ids, targets, chunked_loss: bool, bf16: bool) -> None:
    """The training step flashformer.train runs; without the chunked loss the full logits and their gradient
    are held, as a training loop without a fused loss holds them."""
    chunk_size = default_chunk_size(model.config.vocab_size) if chunked_loss else None
    train_step(model, optimizer, [Batch(input_ids, targets)], bf16=bf16, loss_chunk_size=chunk_size)


def measure_cell(cell: dict) -> dict:
    """Warm-up step, then a timed step, of one cell in this process.

    Args:
        cell: {"device", "config", "overrides", "seqlen", "backend", "checkpointing", "chunked_loss",
            "cpu_mem_limit_mb"} as ``run_cell`` sends it.
    Returns:
        {"status": "ok", "peak": GB on CUDA / MB on CPU, "tokens_per_s"} or {"status": "oom"}.
    """
    device = torch.device(cell["device"])
    seqlen = cell["seqlen"]
    config = load_config(ModelConfig, cell["config"], cell["overrides"])
    # Longer than the config's context: learned position tables must grow; memory is what is measured.
    config = dataclasses.replace(config, max_seq_len=max(config.max_seq_len, seqlen))
    torch.manual_seed(0)
    model = Transformer(config, attn_backend=cell["backend"]).to(device)
    if cell["checkpointing"]:
        apply_activation_checkpointing(model)
    on_cuda = device.type == "cuda"
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=on_cuda)
    tokens = torch.randint(0, config.vocab_size, (1, seqlen + 1), device=device)
    input_ids, targets = tokens[:, :-1], tokens[:, 1:]
    rss_before_step = _peak_rss_bytes()
    if cell["cpu_mem_limit_mb"] is not None and not on_cuda:
        _limit_address_space(cell["cpu_mem_limit_mb"])
    try:
        _train_step(model, optimizer, input_ids, targets, cell["chunked_loss"], bf16=on_cuda)
        if on_cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        _train_step(model, optimizer, input_ids, targets, cell["chunked_loss"], bf16=on_cuda)
        if on_cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    except Exception as err:
        if not _is_out_of_memory(err):
            raise
        return {"status": "oom"}
    peak = torch.cuda.max_memory_allocated() / 1e9 if on_cuda else (_peak_rss_bytes() - rss_before_step) / 1e6
    return {"status": "ok", "peak": peak, "tokens_per_s": seqlen / seconds}


# ----- the parent: the sweep -----

def run_cell(cell: dict, timeout_s: float | None) -> dict:
    """``measure_cell`` in a fresh Python process; a child killed by SIGKILL (the kernel's OOM killer) is OOM.

    Args:
        cell: what measure_cell takes.
        timeout_s: kill the child after this many seconds (None: wait).
    Returns:
        measure_cell's dict, {"status": "timeout"}, or {"status": "error", "message"} when the child failed otherwise.
    """
    env = dict(os.environ)
    if cell["device"] == "cuda":
        # Fewer fragmented reserved blocks at the largest lengths; a user's own setting wins.
        env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    try:
        child = subprocess.run([sys.executable, os.path.abspath(__file__), "--cell", json.dumps(cell)],
                               capture_output=True, text=True, env=env, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"status": "timeout"}
    if child.returncode == -signal.SIGKILL:
        return {"status": "oom"}
    result_lines = [line for line in child.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if child.returncode != 0 or not result_lines:
        return {"status": "error", "message": f"exit code {child.returncode}: {child.stderr[-2000:]}"}
    return json.loads(result_lines[-1][len(RESULT_PREFIX):])


def sweep(args, columns: list[Column], seqlens: list[int]) -> list[dict]:
    """Run every column at growing lengths until it fails (OOM, timeout, error); returns one record per cell run."""
    records = []
    stopped = set()
    progress = tqdm(total=len(columns) * len(seqlens), desc="cells", unit="cell")
    for seqlen in seqlens:
        for column in columns:
            if column not in stopped:
                progress.set_postfix_str(f"{column.label} @ {seqlen}")
                cell = dict(device=args.device, config=args.config, overrides=args.set, seqlen=seqlen,
                            cpu_mem_limit_mb=args.cpu_mem_limit_mb, **dataclasses.asdict(column))
                record = {"seqlen": seqlen, "column": column.label, **run_cell(cell, args.timeout_s)}
                records.append(record)
                if record["status"] != "ok":
                    stopped.add(column)
                # a line per cell, so that a run killed part way still shows what it measured
                progress.write(f"{seqlen:>9,} {column.label}: {_cell_text(record, PEAK_UNITS[args.device])}"
                               + (f", {record['message']}" if record["status"] == "error" else ""))
            progress.update()
        if len(stopped) == len(columns):
            break
    progress.close()
    return records


def _cell_text(record: dict | None, unit: str) -> str:
    if record is None:
        return "–"
    if record["status"] != "ok":
        return record["status"].upper()
    digits = 1 if unit == "GB" else 0
    return f"{record['peak']:,.{digits}f} {unit} / {record['tokens_per_s']:,.0f}"


def markdown_table(records: list[dict], columns: list[Column], unit: str) -> str:
    """Rows = sequence lengths, columns = combinations, cells "peak / tokens/s", "OOM" or "–" (not run)."""
    by_cell = {(r["seqlen"], r["column"]): r for r in records}
    seqlens = sorted({r["seqlen"] for r in records})
    lines = ["| seqlen | " + " | ".join(c.label for c in columns) + " |",
             "|---" * (len(columns) + 1) + "|"]
    for seqlen in seqlens:
        cells = [_cell_text(by_cell.get((seqlen, c.label)), unit) for c in columns]
        lines.append(f"| {seqlen:,} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def longest_lengths(records: list[dict], columns: list[Column]) -> dict[str, int | None]:
    """The longest sequence each column trained at (None: not even the first)."""
    return {c.label: max((r["seqlen"] for r in records if r["column"] == c.label and r["status"] == "ok"),
                         default=None) for c in columns}


def doubling_ratios(records: list[dict], column: Column) -> dict[int, float]:
    """peak(2n) / peak(n) of ``column``, keyed by 2n: about 2 where memory is linear in the length."""
    peaks = {r["seqlen"]: r["peak"] for r in records if r["column"] == column.label and r["status"] == "ok"}
    return {2 * n: peaks[2 * n] / peaks[n] for n in sorted(peaks) if 2 * n in peaks and peaks[n] > 0}


def plot_peaks(records: list[dict], columns: list[Column], unit: str, path: str) -> bool:
    """Peak memory against sequence length, log-log, one line per column, OOM as an x.

    Returns:
        False (and no file) when matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(8, 5))
    # a column's failure (its last cell) is drawn at the top of the plot, at the length that failed
    ceiling = max((r["peak"] for r in records if r["status"] == "ok"), default=1.0)
    for column in columns:
        # log axes cannot show a zero peak (a tiny CPU cell that stayed within the RSS of its setup)
        points = [(r["seqlen"], r["peak"]) for r in records
                  if r["column"] == column.label and r["status"] == "ok" and r["peak"] > 0]
        line = ax.plot(*zip(*points), marker="o", label=column.label)[0] if points else None
        failure = next((r for r in records if r["column"] == column.label and r["status"] != "ok"), None)
        if failure:
            ax.plot([failure["seqlen"]], [ceiling], marker="x", markersize=12, linestyle="none",
                    color=line.get_color() if line else None, label=f"{column.label}: {failure['status'].upper()}")
    ax.set(xscale="log", yscale="log", xlabel="sequence length (tokens, batch 1)", ylabel=f"peak memory ({unit})",
           title="One training step: peak memory vs sequence length")
    seqlens = sorted({r["seqlen"] for r in records})
    ax.set_xticks(seqlens, [f"{n:,}" for n in seqlens], minor=False)
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def parse_args(argv=None):
    """The command line; without ``--cell``, defaults filled in for the device."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--config", help="ModelConfig YAML (default: llama-125m on CUDA, tiny-llama on CPU)")
    parser.add_argument("--set", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                        help="ModelConfig overrides, e.g. --set n_head=2 d_model=32")
    parser.add_argument("--backends", nargs="+", choices=[b for b in ATTN_BACKENDS if b != "auto"],
                        help="default: naive sdpa and flash on CUDA / reference on CPU")
    parser.add_argument("--checkpointing", choices=("both", "off", "on"), default="both",
                        help="activation checkpointing columns to run")
    parser.add_argument("--no-chunked-loss", action="store_true",
                        help="materialize the logits for flash / reference too")
    parser.add_argument("--seqlens", nargs="+", type=_positive_int,
                        help="explicit lengths (otherwise --start doubling to --max)")
    parser.add_argument("--start", type=_positive_int, default=1024)
    parser.add_argument("--max", type=_positive_int, help="longest length (default: 1M tokens on CUDA, 8192 on CPU)")
    parser.add_argument("--cpu-mem-limit-mb", type=_positive_int,
                        help="CPU: address space a cell's training step may add (RLIMIT_AS, Linux)")
    parser.add_argument("--timeout-s", type=float, help="stop a cell (and its column) after this many seconds")
    parser.add_argument("--out", help="write the records as JSON here")
    parser.add_argument("--plot", default="memory_savings.png", help="PNG of peak memory vs sequence length")
    parser.add_argument("--cell", help=argparse.SUPPRESS)  # internal: run one cell, as run_cell asks
    args = parser.parse_args(argv)
    if args.cell is None:
        args.config = args.config or os.path.join(REPO_ROOT, DEFAULT_CONFIGS[args.device])
        args.backends = args.backends or ["naive", "sdpa", "flash"]
        if args.seqlens is None:
            longest = args.max or DEFAULT_MAX_SEQLEN[args.device]
            args.seqlens = [args.start * 2**i for i in range((longest // args.start).bit_length())]
        if not args.seqlens:
            parser.error(f"--start {args.start} is above --max {longest}")
    return args


def print_report(records: list[dict], columns: list[Column], device: str) -> dict:
    """Print the table, the longest length per column and the doubling ratios of the linear-memory
    checkpointed columns; returns {"longest", "doubling_ratios"} for the JSON."""
    print(markdown_table(records, columns, PEAK_UNITS[device]))
    print(f"\ncells: peak {PEAK_UNITS[device]} / tokens/s; peak = {PEAK_MEASURES[device]}.\n\"chunked CE\": "
          "LM head + cross-entropy in chunks of tokens (Transformer.loss); the other columns materialize "
          "the (tokens x vocab) logits.")
    longest = longest_lengths(records, columns)
    print("longest length trained: " + "; ".join(f"{label}: {n or 'none'}" for label, n in longest.items()))
    ratios = {c.label: doubling_ratios(records, c) for c in columns
              if c.backend in LINEAR_MEMORY_BACKENDS and c.checkpointing}
    for label, by_length in ratios.items():
        steps = ", ".join(f"{n // 2:,} -> {n:,}: {ratio:.2f}" for n, ratio in by_length.items())
        print(f"{label}, peak(2n) / peak(n): {steps or 'fewer than two doubled lengths'}")
    return {"longest": longest, "doubling_ratios": ratios}


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.cell is not None:
        print(RESULT_PREFIX + json.dumps(measure_cell(json.loads(args.cell))), flush=True)
        return
    config = load_config(ModelConfig, args.config, args.set)  # fail here, not in every child
    with torch.device("meta"):
        num_params = Transformer(config).num_params()
    checkpointing = {"both": (False, True), "off": (False,), "on": (True,)}[args.checkpointing]
    columns = [Column(backend, ckpt, backend in LINEAR_MEMORY_BACKENDS and not args.no_chunked_loss)
               for backend in args.backends for ckpt in checkpointing]
    print(f"{' '.join([args.config, *args.set])}: {num_params / 1e6:.1f}M parameters, batch 1, {args.device}")
    records = sweep(args, columns, sorted(set(args.seqlens)))
    summary = print_report(records, columns, args.device)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": args.device, "config": args.config, "overrides": args.set,
                       "model": config_to_dict(config), "num_params": num_params,
                       "peak_unit": PEAK_UNITS[args.device], "peak_measure": PEAK_MEASURES[args.device],
                       "columns": [dict(label=c.label, **dataclasses.asdict(c)) for c in columns],
                       "cells": records, **summary}, f, indent=2)
        print(f"wrote {args.out}")
    if plot_peaks(records, columns, PEAK_UNITS[args.device], args.plot):
        print(f"wrote {args.plot}")
    else:
        print("matplotlib is not installed: no plot (pip install matplotlib)")


if __name__ == "__main__":
    main()
