"""Nothing lost, every mistake explained: kills, divergence, a second process, resume overrides, leftovers.

Kills, locks and signals go through real processes (the ``flashformer`` command in a subprocess).
"""

import copy
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

try:
    import resource
except ImportError:  # Windows
    resource = None

from flashformer.checkpoint import from_pretrained
from flashformer.cli import main as cli_main
from flashformer.config import ConfigError
from flashformer.weights import CheckpointError, read_weights
from flashformer.train import (
    TRAINER_STATE_FILE,
    Trainer,
    latest_checkpoint,
    load_train_config,
    lr_factor,
    read_metrics,
    train,
)
from flashformer.train.stops import Interrupted, interrupts_raise
from test_cli import run as run_here  # the command in this process, where its process is not what is tested
from test_train import (SUBPROCESS_ENV, cli_command, data_cache, losses, one_thread, tiny_recipe,  # noqa: F401
                        write_recipe)


def run_cli(*args, timeout=120):
    return subprocess.run(cli_command(*args), capture_output=True, text=True, env=SUBPROCESS_ENV, timeout=timeout)


def wait_for_first_record(process, run, timeout=300):
    deadline = time.time() + timeout
    metrics = run / "metrics.jsonl"
    while not metrics.exists() or os.path.getsize(metrics) == 0:
        assert process.poll() is None and time.time() < deadline, process.communicate()
        time.sleep(0.01)


def test_a_sigterm_while_tokenizing_exits_143_and_leaves_no_cache_or_run_directory(tmp_path):
    cache, run = tmp_path / "cache", tmp_path / "run"
    # A fresh cache of 40 MB of sources: tokenizing takes seconds, in a temporary directory beside the cache.
    config = write_recipe(tmp_path / "recipe.yaml", tiny_recipe(run, str(cache), data__stdlib_max_bytes=40_000_000))
    process = subprocess.Popen(cli_command("train", config), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               text=True, env=SUBPROCESS_ENV)
    deadline = time.time() + 120
    while not list(cache.glob(".*.tmp")):
        assert process.poll() is None and time.time() < deadline, process.communicate()
        time.sleep(0.01)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 143, stderr[-3000:]
    assert "flashformer train: stopped by SIGTERM before the first step: nothing to save" in stderr
    assert "Traceback" not in stderr
    assert not list(cache.glob(".*")) and not run.exists()  # no temporary left, no empty run


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_that_library_code_swallows_still_stops_the_setup(signum):
    """datasets catches every exception while it hashes a transform for its cache fingerprint: a signal that
    lands there raises Interrupted into that catch. The setup block then ends by raising it again."""
    finished, handlers = False, (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT))
    with pytest.raises(Interrupted) as stopped:
        with interrupts_raise():
            try:
                os.kill(os.getpid(), signum)
                time.sleep(1)  # the handler runs here, between bytecodes
            except BaseException:  # what such library code does
                pass
            finished = True
    assert finished and stopped.value.exit_code == 128 + signum
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == handlers  # put back


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


def skip_records(run):
    return [r for r in read_metrics(run) if "skipped" in r]


def rollback_records(run):
    return [r for r in read_metrics(run) if "rollback" in r]


def finite_weights(checkpoint) -> bool:
    return all(torch.isfinite(p).all() for p in from_pretrained(checkpoint).parameters())


def test_a_diverging_run_skips_its_nonfinite_steps_then_stops_naming_the_step(tmp_path, data_cache, capsys):
    # lr=1e6: the first update wrecks the weights, every later step's gradient norm or loss is NaN / inf.
    config = write_recipe(tmp_path / "recipe.yaml", tiny_recipe(tmp_path / "fresh", data_cache, log_every=5))
    assert cli_main(["train", config, "optim.lr=1e6", "max_nonfinite_skips=3"]) == 3
    fresh = capsys.readouterr().err
    assert "Traceback" not in fresh
    stop = re.search(r"error: step (\d+): the (loss|gradient norm) is (nan|inf).* \(4 steps in a row, "
                     r"max_nonfinite_skips=3\), so training stopped\. Lower optim.lr", fresh)
    assert stop, fresh[-2000:]
    skips = skip_records(tmp_path / "fresh")
    stop_step = int(stop.group(1))
    assert [r["step"] for r in skips] == list(range(stop_step - 3, stop_step))  # the 3 before the stop
    assert [r["skipped_steps"] for r in skips] == [1, 2, 3]
    assert all(f"warning: step {r['step']}: {r['skipped']}: skipped (no update)" in fresh for r in skips)
    assert all(r["step"] < stop_step for r in read_metrics(tmp_path / "fresh"))

    assert cli_main(["train", config, "optim.lr=1e6", "max_nonfinite_skips=0", f"out_dir={tmp_path / 'zero'}"]) == 3
    first = int(re.search(r"error: step (\d+):", capsys.readouterr().err).group(1))
    assert first == skips[0]["step"] and not skip_records(tmp_path / "zero")  # same run, stopped at the first


def test_no_checkpoint_is_saved_amid_nonfinite_steps(tmp_path, data_cache, capsys):
    run = tmp_path / "run"
    train(load_train_config(tiny_recipe(run, data_cache, steps=4, keep_checkpoints=1)))
    # ckpt_every=4 would save (and keep only) ckpt-8, amid the skipped steps, and prune the good ckpt-4.
    assert cli_main(["train", "--resume", str(run), "steps=40", "optim.lr=1e6", "log_every=5"]) == 3
    diverged = capsys.readouterr().err
    step = int(re.search(r"error: step (\d+):", diverged).group(1))
    assert step > 8 and skip_records(run)[0]["step"] <= 8
    assert f"{run / 'ckpt-4'} is intact: continue from it with `flashformer train --resume {run} optim.lr=...`" in diverged
    assert latest_checkpoint(str(run)) == str(run / "ckpt-4") and finite_weights(run / "ckpt-4")


def test_a_run_that_diverges_rolls_back_past_the_diverged_batches_and_finishes(tmp_path, data_cache):
    run = tmp_path / "run"
    train(load_train_config(tiny_recipe(run, data_cache, steps=4)))
    reference = tmp_path / "reference"
    shutil.copytree(run, reference)
    # lr=1e6 wrecks the weights at step 5; the rollback to ckpt-4 scales it down to 1e-3, which trains.
    rolled = run_here("train", "--resume", str(run), "steps=12", "optim.lr=1e6", "max_nonfinite_skips=1",
                     "max_rollbacks=2", "rollback_lr_scale=1e-9")
    assert rolled.returncode == 0, rolled.stderr[-3000:]
    [rollback] = rollback_records(run)
    window = rollback["skipped_data_steps"]
    assert (rollback["step"], rollback["rollback"], rollback["diverged_at"]) == (4, 1, 4 + window)
    assert f"warning: step {4 + window}: {rollback['problem']}: rolled back to {run / 'ckpt-4'} (rollback 1 of " \
           f"max_rollbacks=2); the batches of steps 5-{4 + window} are skipped, optim.lr is now 0.001" in rolled.stderr
    steps = [r["step"] for r in read_metrics(run)]
    assert steps == sorted(steps) and steps[-1] == 12  # the diverged window's records gave way to the rollback's
    state = torch.load(run / "ckpt-12" / TRAINER_STATE_FILE, weights_only=True)
    assert state["rollbacks"] == 1 and state["data_position"] == (12 + window) * 8
    assert finite_weights(run / "ckpt-12")
    saved = load_train_config(str(run / "config.yaml"))  # a resume goes on at the lowered lr
    assert saved.optim.lr == pytest.approx(1e-3, rel=1e-12) and saved.optim.min_lr == pytest.approx(1e-13)

    # Bit for bit the run resumed from ckpt-4 at that lr with its data position moved past the window.
    state_path = reference / "ckpt-4" / TRAINER_STATE_FILE
    state = torch.load(state_path, weights_only=True)
    state["data_position"] += window * 8
    torch.save(state, state_path)
    resumed = run_here("train", "--resume", str(reference), "steps=12", f"optim.lr={saved.optim.lr!r}",
                      f"optim.min_lr={saved.optim.min_lr!r}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [r for r in losses(run) if r[0] > 4] == [r for r in losses(reference) if r[0] > 4]
    rolled_weights, reference_weights = (read_weights(str(r / "ckpt-12")) for r in (run, reference))
    assert all(torch.equal(rolled_weights[name], reference_weights[name]) for name in reference_weights)


def test_rollbacks_that_do_not_get_past_a_divergence_stop_with_exit_3(tmp_path, data_cache):
    run = tmp_path / "run"
    train(load_train_config(tiny_recipe(run, data_cache, steps=4)))
    stopped = run_here("train", "--resume", str(run), "steps=40", "optim.lr=1e6", "max_nonfinite_skips=1",
                      "max_rollbacks=2")
    assert stopped.returncode == 3, stopped.stderr[-3000:]
    assert "Traceback" not in stopped.stderr
    error = stopped.stderr.strip().splitlines()[-1]
    assert re.match(r"flashformer train: error: step \d+: the (loss|gradient norm) is (nan|inf).* \(2 steps in a "
                    r"row, max_nonfinite_skips=1\), so training stopped\. 2 rollbacks \(max_rollbacks=2\) did not "
                    r"get past it\. Lower optim.lr", error), error
    assert f"{run / 'ckpt-4'} is intact: continue from it with `flashformer train --resume {run} optim.lr=...`" in error
    assert [(r["step"], r["rollback"]) for r in rollback_records(run)] == [(4, 1), (4, 2)]
    assert latest_checkpoint(str(run)) == str(run / "ckpt-4") and finite_weights(run / "ckpt-4")


def test_a_lora_run_rolls_its_adapters_back(tmp_path, data_cache):
    base = tmp_path / "base"
    train(load_train_config(tiny_recipe(base, data_cache, steps=2, ckpt_every=2)))
    run = tmp_path / "run"
    train(load_train_config(tiny_recipe(run, data_cache, steps=4, init_from=str(base), lora={"rank": 4})))
    overrides = ["steps=8", "optim.lr=1e6", "max_nonfinite_skips=1", "max_rollbacks=1", "rollback_lr_scale=1e-9"]
    assert train(load_train_config(None, overrides, resume_dir=str(run))).step == 8
    assert [(r["step"], r["rollback"]) for r in rollback_records(run)] == [(4, 1)]
    assert finite_weights(run / "ckpt-8")


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit, NaNs included."""
    a, b = a.detach().reshape(-1), b.detach().reshape(-1)
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_a_skipped_step_changes_no_parameter_nor_optimizer_state(tmp_path, data_cache):
    trainer = Trainer(load_train_config(tiny_recipe(tmp_path, data_cache)))
    trainer.train_step()  # the optimizer holds moments from here on
    embed = trainer.model.embed.weight
    good = embed.detach().clone()
    with torch.no_grad():
        embed.fill_(float("nan"))  # a real NaN through the real forward and backward
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    moments = copy.deepcopy(trainer.optimizer.state_dict()["state"])
    lr_step = trainer.scheduler.last_epoch
    loss, grad_norm, _ = trainer.train_step()
    assert not torch.isfinite(loss) and not torch.isfinite(grad_norm)
    after = dict(trainer.model.named_parameters())
    assert all(same_bits(after[name], p) for name, p in before.items())
    state = trainer.optimizer.state_dict()["state"]
    assert all(same_bits(state[i][key], value) for i in moments for key, value in moments[i].items())
    assert all(p.grad is None for p in trainer.model.parameters())
    assert trainer.scheduler.last_epoch == lr_step + 1  # the schedule follows the step count
    with torch.no_grad():
        embed.copy_(good)
    loss, grad_norm, _ = trainer.train_step()  # and training goes on
    assert torch.isfinite(loss) and torch.isfinite(grad_norm)
    assert not torch.equal(trainer.model.embed.weight, good)
    trainer.close()


def file_size_limit(max_bytes: int):
    """A preexec_fn: the child may write no file past ``max_bytes`` (writes past it fail with EFBIG)."""
    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the limit's signal would kill the process first
        resource.setrlimit(resource.RLIMIT_FSIZE, (max_bytes, max_bytes))
    return limit


@pytest.mark.skipif(resource is None, reason="no setrlimit")
def test_a_checkpoint_the_disk_refuses_leaves_the_last_one_to_resume_to_the_same_end(tmp_path, data_cache):
    reference = tmp_path / "reference"
    recipe = tiny_recipe(reference, data_cache, steps=8, ckpt_every=4, eval_every=4)
    train(load_train_config(recipe))
    # As if the run had stopped at ckpt-4: then its next checkpoint meets a limit below a weights file's size.
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    shutil.rmtree(run / "ckpt-8")
    weights = (reference / "ckpt-8" / "model.safetensors").stat().st_size
    failed = subprocess.run(cli_command("train", "--resume", str(run)), capture_output=True, text=True,
                            env=SUBPROCESS_ENV, timeout=120, preexec_fn=file_size_limit(weights // 2))
    assert failed.returncode == 1, failed.stderr[-3000:]
    error = failed.stderr.strip().splitlines()[-1]
    assert error.startswith(f"flashformer train: error: could not write {run / 'ckpt-8'}: File too large (EFBIG: "
                            "the file outgrew the file-size limit"), error
    assert f"{run / 'ckpt-4'} is intact: continue from it with `flashformer train --resume {run}`" in error
    assert "Traceback" not in failed.stderr
    assert sorted(p.name for p in run.iterdir() if "ckpt" in p.name) == ["ckpt-4"]  # no temporary left either
    assert latest_checkpoint(str(run)) == str(run / "ckpt-4")

    assert cli_main(["train", "--resume", str(run)]) == 0  # the limit gone
    assert losses(run) == losses(reference)
    resumed, uninterrupted = (read_weights(str(r / "ckpt-8")) for r in (run, reference))
    assert resumed.keys() == uninterrupted.keys()
    assert all(torch.equal(resumed[name], uninterrupted[name]) for name in uninterrupted)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full")
def test_a_full_disk_under_the_metrics_file_stops_the_run_naming_it(tmp_path, data_cache, capsys):
    run = tmp_path / "run"
    train(load_train_config(tiny_recipe(run, data_cache, steps=2, ckpt_every=2)))
    metrics = run / "metrics.jsonl"
    metrics.unlink()
    metrics.symlink_to("/dev/full")  # every write: ENOSPC
    assert cli_main(["train", "--resume", str(run), "steps=4"]) == 1
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith(f"flashformer train: error: could not write {metrics}: No space left on device (ENOSPC: "
                            "the disk is full)"), error
    assert f"{run / 'ckpt-2'} is intact" in error
    assert latest_checkpoint(str(run)) == str(run / "ckpt-2")


@pytest.mark.skipif(not sys.platform.startswith(("linux", "darwin")), reason="flock")
def test_a_second_run_beside_a_live_one_is_refused_and_the_lock_goes_with_the_process(tmp_path, data_cache):
    run = tmp_path / "run"
    config = write_recipe(tmp_path / "recipe.yaml", tiny_recipe(run, data_cache, steps=100_000, ckpt_every=100_000))
    first = subprocess.Popen(cli_command("train", config), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=SUBPROCESS_ENV)
    try:
        wait_for_first_record(first, run)
        # In this process: another process than the lock's holder, at once (the first trains on meanwhile).
        for args in (("train", config), ("train", "--resume", str(run))):
            second = run_here(*args)
            assert second.returncode == 2, second.stderr
            assert f"in use by another run: pid {first.pid} on this host" in second.stderr
            assert "Traceback" not in second.stderr
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=300)
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
    malformed = run_here("train", str(broken))
    assert malformed.returncode == 2 and "Traceback" not in malformed.stderr
    assert "broken.yaml: not valid YAML" in malformed.stderr and "line 3" in malformed.stderr
    assert cli_main(["train", str(tmp_path)]) == 2  # a directory where a recipe belongs
    empty = tmp_path / "empty.yaml"
    empty.write_text("# to be written\n")
    capsys.readouterr()
    assert cli_main(["train", str(empty)]) == 2
    assert f"{empty} is empty" in capsys.readouterr().err
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text("")
    assert cli_main(["train", "--resume", str(tmp_path / "run")]) == 2
    assert f"{tmp_path / 'run' / 'config.yaml'} does not hold a run's config" in capsys.readouterr().err


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
