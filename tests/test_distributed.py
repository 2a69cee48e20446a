"""Two real processes (torchrun, gloo on CPU) reproduce one process's run with the same global batch."""

import json
import shutil
import subprocess
import sys

import pytest
import yaml

from flashformer.train import load_train_config, read_metrics, train
from test_train import SUBPROCESS_ENV, data_cache, one_thread, tiny_recipe  # noqa: F401 (fixtures)

TOLERANCE = 1e-5  # fp32: the two runs sum the same numbers in a different order


def torchrun(recipe: dict, tmp_path, *args) -> None:
    config = tmp_path / f"{len(list(tmp_path.glob('*.yaml')))}.yaml"
    config.write_text(yaml.safe_dump(recipe))
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
               "-m", "flashformer.cli", "train", *args]
    result = subprocess.run(command + ([] if "--resume" in args else [str(config)]), capture_output=True, text=True,
                            env=SUBPROCESS_ENV, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def assert_same_losses(run_dir, reference_dir):
    keys = ("loss", "eval_loss", "grad_norm")
    records, reference = read_metrics(run_dir), read_metrics(reference_dir)
    assert [r["step"] for r in records] == [r["step"] for r in reference]
    for record, expected in zip(records, reference):
        for key in keys:
            if key in expected:
                assert record[key] == pytest.approx(expected[key], rel=TOLERANCE, abs=TOLERANCE), (record, expected)


def test_ddp_with_packed_documents_matches_one_process(tmp_path, data_cache):
    # One process: 8 rows per micro batch. Two: 2 rows each, accumulated twice: the same 8 rows per step.
    fields = dict(steps=6, eval_every=3, batch_size=8, data__packing="packed", data__stdlib_max_bytes=1_000_000)
    train(load_train_config(tiny_recipe(tmp_path / "one", data_cache, micro_batch_size=8, **fields)))
    two = tiny_recipe(tmp_path / "two", data_cache, micro_batch_size=2, parallel={"mode": "ddp"}, **fields)
    torchrun(two, tmp_path)
    assert_same_losses(tmp_path / "two", tmp_path / "one")


def test_fsdp_matches_one_process_and_resumes(tmp_path, data_cache):
    # chunked_loss: the loss comes out of the sharded root module's forward (DDP above covers logits).
    fields = dict(steps=6, eval_every=3, ckpt_every=3, batch_size=8, micro_batch_size=4, chunked_loss=True)
    train(load_train_config(tiny_recipe(tmp_path / "one", data_cache, **fields)))
    sharded = tmp_path / "fsdp"
    torchrun(tiny_recipe(sharded, data_cache, parallel={"mode": "fsdp"}, **fields), tmp_path)
    assert_same_losses(sharded, tmp_path / "one")
    # As if the run had died after ckpt-3: the resumed processes must redo steps 4-6 identically.
    shutil.rmtree(sharded / "ckpt-6")
    metrics = sharded / "metrics.jsonl"
    metrics.write_text("".join(line for line in metrics.read_text().splitlines(True) if json.loads(line)["step"] <= 3))
    torchrun({}, tmp_path, "--resume", str(sharded))
    assert (sharded / "ckpt-6").is_dir()
    assert_same_losses(sharded, tmp_path / "one")
