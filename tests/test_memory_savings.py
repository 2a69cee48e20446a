"""scripts/memory_savings.py on CPU: table and JSON shape, quadratic vs linear growth, OOM cells."""

import json
import os
import subprocess
import sys

import pytest

from flashformer.config import ConfigError
from test_bench_scripts import _load_script

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO_ROOT, "scripts", "memory_savings.py")
HEADS = 2
# One layer, 2 heads of 16 dims: the model is tiny, so naive's (heads x seqlen^2) scores dominate its peak.
TINY = ["--config", os.path.join(REPO_ROOT, "configs", "models", "tiny-llama.yaml"),
        "--set", "n_layer=1", f"n_head={HEADS}", f"n_kv_head={HEADS}", "d_model=32", "d_ff=64"]


def run_script(tmp_path, *args):
    """Run the script; returns (stdout, JSON record). A process of its own: a cell's child starts from its
    parent's peak RSS (Linux keeps it across fork and exec), so the parent must be as small as the script."""
    out = tmp_path / "memory.json"
    # One thread per cell: on a shared 2-core machine OpenMP threads that wait on busy cores
    # make a step ten times slower, and the peaks do not depend on the thread count.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.run([sys.executable, SCRIPT, "--device", "cpu", *TINY, "--out", str(out),
                              "--plot", str(tmp_path / "memory.png"), *args],
                             capture_output=True, text=True, env=env, timeout=300)
    assert process.returncode == 0, process.stderr[-3000:]
    return process.stdout, json.loads(out.read_text())


def test_naive_peak_grows_quadratically_flash_linearly(tmp_path):
    """With checkpointing, naive still holds one layer's scores (and their gradient) during recompute."""
    # 1k -> 4k: the scores' growth (~16x) stands well clear of the few tens of MB a process's peak RSS moves
    # by itself between cells (at 1k -> 2k flash's "growth" of ~20 MB once came within 4x of naive's).
    seqlens = [1024, 2048, 4096]
    stdout, record = run_script(tmp_path, "--backends", "naive", "flash", "--checkpointing", "on",
                                "--seqlens", *map(str, seqlens))
    naive, flash = labels = [column["label"] for column in record["columns"]]
    assert labels == ["naive + ckpt", "flash + ckpt + chunked CE"]
    assert [c["chunked_loss"] for c in record["columns"]] == [False, True]
    assert f"| seqlen | {naive} | {flash} |" in stdout
    assert all(f"| {n:,} | " in stdout for n in seqlens)
    assert record["peak_unit"] == "MB" and record["longest"] == {label: seqlens[-1] for label in labels}
    peaks = {(cell["column"], cell["seqlen"]): cell["peak"] for cell in record["cells"]}
    assert len(peaks) == 2 * len(seqlens) and all(cell["status"] == "ok" and cell["tokens_per_s"] > 0 for cell in record["cells"])
    short, long = seqlens[0], seqlens[-1]
    naive_growth = peaks[naive, long] - peaks[naive, short]
    flash_growth = peaks[flash, long] - peaks[flash, short]
    one_score_matrix_growth_mb = HEADS * (long**2 - short**2) * 4 / 1e6  # fp32, one layer
    assert naive_growth > one_score_matrix_growth_mb, peaks
    assert naive_growth > 4 * flash_growth, peaks
    assert list(record["doubling_ratios"]) == [flash]
    assert list(record["doubling_ratios"][flash]) == [str(n) for n in seqlens[1:]]
    assert f"{flash}, peak(2n) / peak(n): {short:,} -> {seqlens[1]:,}: " in stdout
    assert (tmp_path / "memory.png").stat().st_size > 0


def test_memory_limit_gives_oom_cell_and_stops_that_column(tmp_path):
    stdout, record = run_script(tmp_path, "--backends", "naive", "--checkpointing", "off",
                                "--seqlens", "4096", "8192", "--cpu-mem-limit-mb", "100")
    assert [(cell["seqlen"], cell["status"]) for cell in record["cells"]] == [(4096, "oom")]
    assert "| 4,096 | OOM |" in stdout and "8,192" not in stdout
    assert record["longest"] == {"naive": None}


def test_a_bad_override_fails_before_any_cell(capsys):
    """In the test process: the script's check needs no process of its own."""
    with pytest.raises(ConfigError, match="did you mean 'n_layer'"):
        _load_script("memory_savings").main(["--device", "cpu", "--set", "n_layers=2"])
    assert "cells" not in "".join(capsys.readouterr())
