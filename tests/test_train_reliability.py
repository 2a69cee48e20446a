"""Nothing lost, every mistake explained: kills, divergence, a second process, resume overrides, leftovers.

Kills, locks and signals go through real processes (the ``flashformer`` command in a subprocess).
"""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from flashformer.checkpoint import from_pretrained
from flashformer.cli import main as cli_main
from flashformer.config import ConfigError
from flashformer.weights import CheckpointError
from flashformer.train import (
    TRAINER_STATE_FILE,
    Trainer,
    latest_checkpoint,
    load_train_config,
    lr_factor,
    read_metrics,
    train,
)
from test_train import SUBPROCESS_ENV, cli_command, data_cache, one_thread, tiny_recipe, write_recipe  # noqa: F401


def run_cli(*args, timeout=120):
    return subprocess.run(cli_command(*args), capture_output=True, text=True, env=SUBPROCESS_ENV, timeout=timeout)


def wait_for_first_record(process, run, timeout=90):
    deadline = time.time() + timeout
    metrics = run / "metrics.jsonl"
    while not metrics.exists() or os.path.getsize(metrics) == 0:
        assert process.poll() is None and time.time() < deadline, process.communicate()
        time.sleep(0.01)


def test_a_kill_while_resuming_loses_no_metrics_record(tmp_path, data_cache):
    run = tmp_path / "run"
    train(load_train_config(tiny_recipe(run, data_cache, steps=4)))
    metrics = run / "metrics.jsonl"
    # Many records up to the checkpoint (so that rewriting them line by line takes a while), then one from a
    # step after it, which the resumed run must drop.
    with open(metrics, "a") as f:
        f.writelines(json.dumps({"step": 1 + i % 4, "padding": i}) + "\n" for i in range(200_000))
        f.write(json.dumps({"step": 7, "loss": 1.0}) + "\n")
    kept = [line for line in metrics.read_text().splitlines() if json.loads(line)["step"] <= 4]
    size = metrics.stat().st_size
    process = subprocess.Popen(cli_command("train", "--resume", str(run), "steps=8"), stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, env=SUBPROCESS_ENV)
    deadline = time.time() + 120
    while metrics.stat().st_size == size and process.poll() is None and time.time() < deadline:
        time.sleep(0.0005)
    process.kill()  # the moment the file changed
    process.wait()
    lines = metrics.read_text().splitlines()
    assert lines[: len(kept)] == kept
    assert all(json.loads(line)["step"] != 7 or "padding" in line for line in lines)


def test_a_diverging_run_stops_naming_the_step_and_keeps_the_finite_checkpoint(tmp_path, data_cache, capsys):
    config = write_recipe(tmp_path / "recipe.yaml", tiny_recipe(tmp_path / "fresh", data_cache, log_every=5))
    assert cli_main(["train", config, "optim.lr=1e6"]) == 3
    fresh = capsys.readouterr().err
    assert "Traceback" not in fresh
    assert re.search(r"error: step \d+: the (loss|gradient norm) is (nan|inf).*Lower optim.lr", fresh)

    run = tmp_path / "run"
    train(load_train_config(tiny_recipe(run, data_cache, steps=4, keep_checkpoints=1)))
    assert cli_main(["train", "--resume", str(run), "steps=40", "optim.lr=1e6", "log_every=5"]) == 3
    diverged = capsys.readouterr().err
    step = int(re.search(r"error: step (\d+):", diverged).group(1))
    assert "is finite: resume from it" in diverged
    latest = latest_checkpoint(str(run))
    assert int(latest.rsplit("-", 1)[1]) < step  # nothing saved at or after the first non-finite step
    assert all(torch.isfinite(p).all() for p in from_pretrained(latest).parameters())
    assert all(r["step"] < step for r in read_metrics(run))


@pytest.mark.skipif(not sys.platform.startswith(("linux", "darwin")), reason="flock")
def test_a_second_run_beside_a_live_one_is_refused_and_the_lock_goes_with_the_process(tmp_path, data_cache):
    run = tmp_path / "run"
    config = write_recipe(tmp_path / "recipe.yaml", tiny_recipe(run, data_cache, steps=100_000, ckpt_every=100_000))
    first = subprocess.Popen(cli_command("train", config), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=SUBPROCESS_ENV)
    try:
        wait_for_first_record(first, run)
        for args in (("train", config), ("train", "--resume", str(run))):
            second = run_cli(*args, timeout=60)
            assert second.returncode == 2, second.stderr
            assert f"in use by another run: pid {first.pid} on this host" in second.stderr
            assert "Traceback" not in second.stderr
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=60)
        assert first.returncode == 143
    finally:
        if first.poll() is None:
            first.kill()
    last = int(os.path.basename(latest_checkpoint(str(run))).split("-")[1])
    assert cli_main(["train", "--resume", str(run), f"steps={last + 2}"]) == 0


def test_resume_applies_what_can_change_and_refuses_what_cannot(tmp_path, data_cache, capsys):
    run = tmp_path / "run"
    train(load_train_config(tiny_recipe(run, data_cache, steps=4)))
    for override, message in (("model.n_layer=4", "model.n_layer (was 2, asked 4) cannot change"),
                              ("data.seq_len=16", "data.seq_len (was 32, asked 16) cannot change"),
                              ("batch_size=16", "batch_size (was 8, asked 16) cannot change")):
        assert cli_main(["train", "--resume", str(run), override]) == 2
        assert message in capsys.readouterr().err
    assert load_train_config(str(run / "config.yaml")).model.n_layer == 2  # nothing recorded
    with pytest.raises(ConfigError, match="model.n_layer"):  # resume=true in a recipe is checked too
        Trainer(load_train_config(tiny_recipe(run, data_cache, steps=6, resume=True, model__n_layer=3)))

    assert cli_main(["train", "--resume", str(run), "steps=6", "optim.lr=3e-4", "optim.weight_decay=0.0"]) == 0
    saved = load_train_config(str(run / "config.yaml"))
    assert (saved.steps, saved.optim.lr, saved.optim.weight_decay) == (6, 3e-4, 0.0)
    lrs = {r["step"]: r["lr"] for r in read_metrics(run) if "lr" in r}
    assert lrs[5] == pytest.approx(3e-4 * lr_factor(4, saved.optim, 6))  # trained with the new lr
    state = torch.load(run / "ckpt-6" / TRAINER_STATE_FILE, weights_only=True)
    assert state["config"]["optim"]["lr"] == 3e-4
    assert all(group["weight_decay"] == 0.0 for group in state["optimizer"]["param_groups"])
    capsys.readouterr()
    assert cli_main(["train", "--resume", str(run)]) == 0  # finished: said, not silently done
    assert "already at step 6 of steps=6: nothing to train" in capsys.readouterr().out


def test_leftovers_of_killed_writes_are_cleaned_when_the_run_starts(tmp_path, data_cache):
    run = tmp_path / "run"
    train(load_train_config(tiny_recipe(run, data_cache, steps=4)))
    # A real process killed inside a checkpoint write leaves its temporary directory behind.
    code = ("import os, signal, sys\nfrom flashformer.fileio import atomic_directory\n"
            "with atomic_directory(sys.argv[1]) as tmp:\n"
            "    open(os.path.join(tmp, 'model.safetensors'), 'wb').write(b'half a file')\n"
            "    os.kill(os.getpid(), signal.SIGKILL)\n")
    killed = subprocess.run([sys.executable, "-c", code, str(run / "ckpt-8")], env=SUBPROCESS_ENV)
    assert killed.returncode == -signal.SIGKILL
    assert list(run.glob(".ckpt-8.*.tmp"))
    # Killed between moving the previous ckpt-4 aside and moving its replacement in: ckpt-4 comes back.
    os.rename(run / "ckpt-4", run / ".ckpt-4.k1ll3d.old")
    result = train(load_train_config(tiny_recipe(run, data_cache, steps=6, resume=True)))
    assert result.step == 6
    assert not list(run.glob(".ckpt-*"))
    assert sorted(p.name for p in run.glob("ckpt-*")) == ["ckpt-4", "ckpt-6"]


def test_errors_are_one_line_and_debug_shows_the_traceback(tmp_path, capsys):
    assert cli_main(["train", str(tmp_path / "nope.yaml"), "steps=2"]) == 2
    missing = capsys.readouterr().err
    assert "Traceback" not in missing and "nope.yaml" in missing
    assert not (tmp_path / "runs").exists()
    debug = run_cli("train", str(tmp_path / "nope.yaml"), "--debug")
    assert debug.returncode == 1 and "Traceback" in debug.stderr
    broken = tmp_path / "broken.yaml"
    broken.write_text("name: a\nsteps: [1,\n")
    malformed = run_cli("train", str(broken))
    assert malformed.returncode == 2 and "Traceback" not in malformed.stderr
    assert "broken.yaml: not valid YAML" in malformed.stderr and "line 3" in malformed.stderr
    assert cli_main(["train", str(tmp_path)]) == 2  # a directory where a recipe belongs


def test_an_unreadable_trainer_state_names_the_checkpoint_to_fall_back_to(tmp_path, data_cache):
    run = tmp_path / "run"
    train(load_train_config(tiny_recipe(run, data_cache, steps=4, ckpt_every=2, keep_checkpoints=2)))
    state = run / "ckpt-4" / TRAINER_STATE_FILE
    state.write_bytes(state.read_bytes()[:100])  # a disk fault after the atomic write
    with pytest.raises(CheckpointError, match=f"ckpt-4/{TRAINER_STATE_FILE} is unreadable .*resume from ckpt-2"):
        train(load_train_config(None, ["steps=6"], resume_dir=str(run)))


def test_a_run_written_before_newer_config_keys_resumes(tmp_path, data_cache):
    """A checkpoint records its config; keys added since (lora, deterministic) take their defaults and a
    moved one (model.attn_backend, now top-level) its new place, so an older run still resumes."""
    run = tmp_path / "run"
    train(load_train_config(tiny_recipe(run, data_cache, steps=2, ckpt_every=2)))
    state_path = run / "ckpt-2" / TRAINER_STATE_FILE
    state = torch.load(state_path, weights_only=True)
    for key in ("lora", "deterministic", "attn_backend"):
        state["config"].pop(key)
    state["config"]["model"]["attn_backend"] = "auto"
    torch.save(state, state_path)
    assert train(load_train_config(None, ["steps=3"], resume_dir=str(run))).step == 3


def test_resume_takes_the_runs_latest_checkpoint_and_refuses_an_older_one(tmp_path, data_cache, capsys):
    run = tmp_path / "run"
    train(load_train_config(tiny_recipe(run, data_cache, steps=4, ckpt_every=2, keep_checkpoints=2)))
    capsys.readouterr()
    assert cli_main(["train", "--resume", str(run / "ckpt-2"), "steps=5"]) == 2
    assert "a run resumes from its latest checkpoint" in capsys.readouterr().err
    assert cli_main(["train", "--resume", str(run / "ckpt-4"), "steps=5"]) == 0
    assert "ckpt-4 is its latest checkpoint" in capsys.readouterr().out
    assert latest_checkpoint(str(run)).endswith("ckpt-5")
