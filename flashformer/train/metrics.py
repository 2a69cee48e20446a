"""A run's records: ``metrics.jsonl`` (one JSON object per logged step or evaluation) and ``loss.png``.

    log = MetricsLog("runs/tiny/metrics.jsonl", keep_through_step=300)   # resuming from ckpt-300
    log.write({"step": 301, "loss": 1.93})
    records = read_metrics("runs/tiny")
"""

from __future__ import annotations

import json
import os

from ..fileio import atomic_write_file, raise_write_error

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "loss.png"


class MetricsLog:
    """Appends JSON records to a file, one per line, flushed as written.

    A resumed run first drops the records after its checkpoint (they belong to steps it will train
    again) and any line a kill cut short. That happens in one atomic rewrite, and only when there is
    something to drop; otherwise the file is only ever appended to. A kill at any moment leaves every
    record written before it.

    Args:
        path: the metrics file (created if missing).
        keep_through_step: the step training continues from (0 for a fresh start).
    """

    def __init__(self, path: str, keep_through_step: int):
        self.path = path
        text = ""
        if os.path.isfile(path):  # not a device: /dev/full would read forever
            with open(path, encoding="utf-8") as f:
                text = f.read()
        kept = [line for line in text.splitlines(keepends=True) if _step(line) is not None
                and _step(line) <= keep_through_step and line.endswith("\n")]
        if len(kept) != len(text.splitlines()):
            atomic_write_file(path, lambda f: f.write("".join(kept).encode("utf-8")))
        # Unbuffered: a record the disk refused is not retried (and refused again) when the file closes.
        self.file = open(path, "ab", buffering=0)

    def write(self, record: dict) -> None:
        """Append ``record``; fileio.WriteError naming the file when the disk refuses it."""
        unwritten = memoryview((json.dumps(record) + "\n").encode("utf-8"))
        try:
            while unwritten:  # a nearly full disk takes part of a write; the next part's write raises
                unwritten = unwritten[self.file.write(unwritten):]
        except OSError as error:
            raise_write_error(self.path, error)
            raise

    def close(self) -> None:
        self.file.close()


def _step(line: str) -> int | None:
    """The step of a record line; None for a line that is not a whole record."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return None
    return record.get("step") if isinstance(record, dict) and isinstance(record.get("step"), int) else None


def read_metrics(run_dir: str) -> list[dict]:
    """The records of a run's metrics.jsonl, in order (a last line cut short by a kill is skipped)."""
    with open(os.path.join(run_dir, METRICS_FILE), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip() and _step(line) is not None]


def plot_losses(run_dir: str) -> str | None:
    """Draw ``loss.png`` (train and eval loss against step) from metrics.jsonl; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no loss.png (pip install matplotlib)")
        return None
    records = read_metrics(run_dir)
    fig, ax = plt.subplots(figsize=(7, 4))
    for key, label in (("loss", "train"), ("eval_loss", "eval")):
        points = [(r["step"], r[key]) for r in records if key in r]
        if points:
            ax.plot(*zip(*points), label=label, marker="o" if key == "eval_loss" else None)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / token)")
    ax.grid(alpha=0.3)
    ax.legend()
    path = os.path.join(run_dir, PLOT_FILE)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def abridged(value, keep: int = 3):
    """A config dict for the console: lists longer than 2 x ``keep`` cut to their first ``keep`` entries
    (finetune-long's file lists run to hundreds of paths; the run directory's config.yaml keeps them all)."""
    if isinstance(value, dict):
        return {k: abridged(v, keep) for k, v in value.items()}
    if isinstance(value, list) and len(value) > 2 * keep:
        return value[:keep] + [f"... {len(value) - keep} more (see config.yaml in the run directory)"]
    return value
