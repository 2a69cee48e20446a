"""Two real processes (torchrun, gloo on CPU) reproduce one process's run with the same global batch."""

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
import yaml

from flashformer.checkpoint import from_pretrained
from flashformer.cli import main as cli_main
from flashformer.lora import read_adapter
from flashformer.train import NonFiniteLossError, latest_checkpoint, load_train_config, read_metrics, train
from test_train import SUBPROCESS_ENV, data_cache, one_thread, tiny_recipe, write_recipe  # noqa: F401 (fixtures)
from test_train_reliability import file_size_limit, resource
from session_cache import built_once
from train_runs_worker import LAUNCH_TIMEOUT_S, LORA_REPORT, rewind_args

TOLERANCE = 1e-5  # fp32: the two runs sum the same numbers in a different order
# Every run here trains on the CPU over gloo, as the tolerance above assumes: device "auto" would put
# both torchrun workers on GPU LOCAL_RANK (cuda:1 does not exist on a one-GPU machine), train in bf16
# autocast and through the Triton kernels, none of which fp32 CPU bit-closeness holds for.
CPU = dict(device="cpu")


def recipe_file(recipe: dict, tmp_path) -> str:
    return write_recipe(tmp_path / f"{len(list(tmp_path.glob('*.yaml')))}.yaml", recipe)


def launch(command: list[str], succeed: bool, timeout: int = 300, **popen) -> subprocess.CompletedProcess:
    """Run ``command`` (a torchrun launch) to its end, asserting its exit code is 0 exactly when ``succeed``;
    ``popen``: more subprocess.Popen arguments."""
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=SUBPROCESS_ENV,
                          **popen) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            # SIGTERM, not SIGKILL: torchrun then stops its workers, which live in sessions of their own and would
            # outlive it. The output's end names where the ranks waited (train_runs_worker prints their stacks).
            process.terminate()
            try:
                stdout, stderr = process.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                stdout, stderr = process.communicate()
            raise AssertionError(f"the launch ran past {timeout} s; its stderr ends:\n{stderr[-8000:]}") from None
    result = subprocess.CompletedProcess(command, process.returncode, stdout, stderr)
    assert (result.returncode == 0) == succeed, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def torchrun(recipe: dict, tmp_path, *args, succeed: bool = True, processes: int = 2) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes), "--standalone",
               "-m", "flashformer.cli", "train", *args]
    return launch(command + ([] if "--resume" in args else [recipe_file(recipe, tmp_path)]), succeed)


def torchrun_each(runs: list, tmp_path, succeed: bool = True) -> subprocess.CompletedProcess:
    """Train each run on two ranks, one after another in one launch (tests/train_runs_worker.py): the launch's
    start-up, most of a tiny run's cost, is paid once. A run is a recipe, or the arguments of ``train``."""
    from train_runs_worker import SEPARATOR

    worker = os.path.join(os.path.dirname(__file__), "train_runs_worker.py")
    args = []
    for run in runs:
        args += [*([SEPARATOR] if args else []), *([recipe_file(run, tmp_path)] if isinstance(run, dict) else run)]
    return launch([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone", worker,
                   *args], succeed, timeout=LAUNCH_TIMEOUT_S)


def assert_same_losses(run_dir, reference_dir):
    keys = ("loss", "eval_loss", "grad_norm")
    records, reference = read_metrics(run_dir), read_metrics(reference_dir)
    assert [r["step"] for r in records] == [r["step"] for r in reference]
    for record, expected in zip(records, reference):
        for key in keys:
            if key in expected:
                assert record[key] == pytest.approx(expected[key], rel=TOLERANCE, abs=TOLERANCE), (record, expected)


def two_rank_runs(directory, data_cache):
    """The one-process runs of the tests below, then their two-rank runs in one launch; the launch's output and
    the step the one-process diverging run stopped at go to files beside them."""
    # DDP, packed: one process takes 8 rows per micro batch; two take 2 rows each, accumulated twice: the same
    # 8 rows per step.
    packed = dict(steps=6, eval_every=3, batch_size=8, data__packing="packed", data__stdlib_max_bytes=1_000_000,
                  **CPU)
    train(load_train_config(tiny_recipe(directory / "packed-one", data_cache, micro_batch_size=8, **packed)))
    # DDP + LoRA, offloaded checkpointing, from a trained base.
    base = directory / "base"
    train(load_train_config(tiny_recipe(base, data_cache, steps=4, ckpt_every=4, eval_every=4, **CPU)))
    lora = dict(steps=4, eval_every=2, batch_size=8, init_from=str(base), activation_checkpointing="offload",
                lora={"rank": 4, "targets": ["q", "v", "up"]}, **CPU)
    train(load_train_config(tiny_recipe(directory / "lora-one", data_cache, micro_batch_size=8, **lora)))
    # FSDP, offloaded checkpointing, against one process without checkpointing.
    offload = dict(steps=4, eval_every=2, batch_size=8, micro_batch_size=4, chunked_loss=True,
                   activation_checkpointing="offload", **CPU)
    train(load_train_config(tiny_recipe(directory / "offload-one", data_cache,
                                        **{**offload, "activation_checkpointing": False})))
    # FSDP; chunked_loss: the loss comes out of the sharded root module's forward (DDP above covers logits).
    fsdp = dict(steps=6, eval_every=3, ckpt_every=3, batch_size=8, micro_batch_size=4, chunked_loss=True, **CPU)
    train(load_train_config(tiny_recipe(directory / "fsdp-one", data_cache, **fsdp)))
    # FSDP + LoRA from a trained base; the frozen base's report comes from tests/lora_fsdp_worker.py.
    lora_base = directory / "fsdp-lora-base"
    train(load_train_config(tiny_recipe(lora_base, data_cache, steps=2, ckpt_every=2, eval_every=2, **CPU)))
    fsdp_lora = dict(steps=4, eval_every=2, ckpt_every=2, batch_size=8, micro_batch_size=4, init_from=str(lora_base),
                     lora={"rank": 4, "targets": ["q", "v", "up"]}, **CPU)
    train(load_train_config(tiny_recipe(directory / "fsdp-lora-one", data_cache, **fsdp_lora)))

    # lr=1e6 wrecks the weights after ckpt-4; every rank must roll back at the same step, to the same data.
    rolled_base = directory / "rolled-base"
    train(load_train_config(tiny_recipe(rolled_base, data_cache, steps=4, batch_size=8, micro_batch_size=2, **CPU)))
    rolled_one, rolled_two = directory / "rolled-one", directory / "rolled-two"
    shutil.copytree(rolled_base, rolled_one)
    shutil.copytree(rolled_base, rolled_two)
    overrides = ["steps=8", "optim.lr=1e6", "max_nonfinite_skips=1", "max_rollbacks=1", "rollback_lr_scale=1e-9"]
    train(load_train_config(None, overrides, resume_dir=str(rolled_one)))
    # lr=1e6 wrecks the weights in one step. One process and two (the same global batch) must skip the same
    # steps and stop at the same one; ranks that disagreed would step apart and hang in their collectives.
    stopping = dict(steps=20, batch_size=8, log_every=5, max_nonfinite_skips=2, optim__lr=1e6, **CPU)
    with pytest.raises(NonFiniteLossError, match=r"^step (\d+):") as stopped:
        train(load_train_config(tiny_recipe(directory / "stop-one", data_cache, micro_batch_size=8, **stopping)))
    (directory / "stopped.txt").write_text(str(stopped.value))

    result = torchrun_each([
        tiny_recipe(directory / "packed", data_cache, micro_batch_size=2, parallel={"mode": "ddp"}, **packed),
        tiny_recipe(directory / "lora", data_cache, micro_batch_size=2, parallel={"mode": "ddp"}, **lora),
        tiny_recipe(directory / "offload", data_cache, parallel={"mode": "fsdp"}, **offload),
        tiny_recipe(directory / "fsdp", data_cache, parallel={"mode": "fsdp"}, **fsdp),
        # As if the FSDP run had died after ckpt-3: the resumed processes must redo steps 4-6 identically.
        rewind_args(directory / "fsdp", directory / "fsdp-resumed", 3), ["--resume", str(directory / "fsdp-resumed")],
        [LORA_REPORT, recipe_file(tiny_recipe(directory / "fsdp-lora", data_cache, parallel={"mode": "fsdp"},
                                              **fsdp_lora), directory), str(directory / "fsdp-lora-report.json")],
        # As if the run had died after ckpt-2: the resumed processes redo steps 3-4 identically.
        rewind_args(directory / "fsdp-lora", directory / "fsdp-lora-resumed", 2),
        ["--resume", str(directory / "fsdp-lora-resumed")],
        ["--resume", str(rolled_two), "parallel.mode=ddp", *overrides],
        # The stopping run last: a failed run ends the launch.
        tiny_recipe(directory / "stop-two", data_cache, micro_batch_size=2, parallel={"mode": "ddp"}, **stopping),
    ], directory, succeed=False)
    (directory / "stdout.txt").write_text(result.stdout)
    (directory / "stderr.txt").write_text(result.stderr)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_cache):
    """two_rank_runs' directory, built once however xdist hands these tests to its workers. Not the directory
    built_once renames into place: an adapter's checkpoint names its base by its path, which must not move."""
    def build(done):
        directory = done.parent / "two-rank-runs"
        shutil.rmtree(directory, ignore_errors=True)  # what a failed build left
        directory.mkdir()
        two_rank_runs(directory, data_cache)

    done = built_once(tmp_path_factory, "two-rank-runs-done", build)
    return done.parent / "two-rank-runs"


def test_ddp_and_fsdp_runs_match_one_process_and_fsdp_resumes(runs):
    """Two-rank runs beside the one process's run with the same global batch: DDP on packed documents, DDP + LoRA
    and FSDP with offloaded activation checkpointing, plain FSDP (then resumed)."""
    for run in ("packed", "lora", "offload", "fsdp"):
        assert_same_losses(runs / run, runs / f"{run}-one")
    assert (runs / "fsdp-resumed" / "ckpt-6").is_dir()
    assert_same_losses(runs / "fsdp-resumed", runs / "fsdp-one")


def test_ranks_roll_back_together_then_skip_the_same_nonfinite_steps_and_stop_after_the_same_one(runs):
    """Two runs, each beside one process's: a rollback, then a run that stops."""
    rolled_one, rolled_two = runs / "rolled-one", runs / "rolled-two"
    stderr = (runs / "stderr.txt").read_text()
    assert (rolled_two / "ckpt-8").is_dir()  # the rollback's run finished, the failure is the stopping run's

    assert stderr.count("rolled back to") == 1  # rank 0 says it
    keys = ("step", "rollback", "diverged_at", "skipped_data_steps", "skipped_steps")
    rollbacks = [[tuple(r[k] for k in keys) for r in read_metrics(run) if "rollback" in r]
                 for run in (rolled_one, rolled_two)]
    assert rollbacks[0] == rollbacks[1] and len(rollbacks[0]) == 1
    assert_same_losses(rolled_two, rolled_one)
    assert all(torch.isfinite(p).all() for p in from_pretrained(rolled_two / "ckpt-8").parameters())

    step = re.match(r"step (\d+):", (runs / "stopped.txt").read_text()).group(1)
    assert re.findall(r"error: step (\d+):", stderr) == [step, step], stderr[-3000:]  # both ranks
    skipped = [[(r["step"], r["skipped_steps"]) for r in read_metrics(run) if "skipped" in r]
               for run in (runs / "stop-one", runs / "stop-two")]
    assert skipped[0] == skipped[1], skipped
    # A wrecked model's loss is not NaN on every batch (which ones differs between CPUs), so the run may
    # skip in several streaks; it stops at the third non-finite step in a row.
    (before_last, _), (last, _) = skipped[0][-2:]
    assert last == before_last + 1 and int(step) == last + 1, (skipped, step)


@pytest.mark.skipif(resource is None, reason="no setrlimit")
def test_a_checkpoint_rank_0_cannot_write_stops_every_rank_and_keeps_the_previous_one(tmp_path, data_cache):
    run = tmp_path / "run"
    train(load_train_config(tiny_recipe(run, data_cache, steps=4, batch_size=8, micro_batch_size=2, **CPU)))
    weights = (run / "ckpt-4" / "model.safetensors").stat().st_size
    # The limit holds for torchrun and both workers; only rank 0 writes, and ckpt-8's weights outgrow it.
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
               "-m", "flashformer.cli", "train", "--resume", str(run), "steps=8", "parallel.mode=ddp"]
    failed = launch(command, succeed=False, timeout=180, preexec_fn=file_size_limit(weights // 2))
    # Each rank ends with its own error: none hangs. Both ranks write to one pipe, so rank 1's may follow rank
    # 0's progress bar or its error on one line: each error ends where the next begins or at its line's end.
    errors = re.findall(r"flashformer train: error: .*?(?=flashformer train: error: |$)", failed.stderr, re.M)
    assert len(errors) == 2, failed.stderr[-3000:]
    assert any(f"could not write {run / 'ckpt-8'}: File too large" in e for e in errors), errors
    assert any(f"rank 0 could not write {run / 'ckpt-8'}" in e for e in errors), errors
    assert all(f"{run / 'ckpt-4'} is intact" in e for e in errors), errors
    # The one traceback is the launcher's own report of a failed worker.
    assert failed.stderr.count("Traceback") == 1 and "ChildFailedError" in failed.stderr
    assert latest_checkpoint(str(run)) == str(run / "ckpt-4")
    assert sorted(p.name for p in run.iterdir() if "ckpt" in p.name) == ["ckpt-4"]
    assert train(load_train_config(None, [], resume_dir=str(run))).step == 8  # ckpt-4 loads


def worker_pid(rank: int, marker: str) -> int | None:
    """The torchrun worker of ``rank`` whose command line holds ``marker`` (Linux /proc), if it runs yet."""
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = f.read().split(b"\0")
        except (OSError, ValueError):
            continue
        if marker.encode() in cmdline and b"flashformer.cli" in cmdline and f"RANK={rank}".encode() in environ:
            return int(entry)
    return None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the worker through /proc")
def test_a_signal_to_one_rank_stops_every_rank_after_the_same_step(tmp_path, data_cache):
    # Ranks agree on stopping through an all-reduce read one step late: if they disagreed, one rank would
    # enter the checkpoint's collectives while the other trained on, and the run would hang or fail.
    run = tmp_path / "run"
    config = tmp_path / "recipe.yaml"
    config.write_text(yaml.safe_dump(tiny_recipe(run, data_cache, steps=100_000, ckpt_every=100_000,
                                                 parallel={"mode": "ddp"}, **CPU)))
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
               "-m", "flashformer.cli", "train", str(config)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=SUBPROCESS_ENV,
                               start_new_session=True)
    try:
        deadline = time.time() + 120
        while not (run / "metrics.jsonl").exists() or os.path.getsize(run / "metrics.jsonl") == 0:
            assert process.poll() is None and time.time() < deadline
            time.sleep(0.05)
        os.kill(worker_pid(1, str(config)), signal.SIGTERM)
        stdout, stderr = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    # Both ranks exit as SIGTERM's 143, the one that got it and the one that stopped with it.
    assert "Traceback" not in stdout and "exitcode  : 143" in stderr, stderr[-3000:]
    assert "stopped at step" in stdout + stderr
    checkpoint = latest_checkpoint(str(run))
    assert checkpoint is not None and checkpoint.endswith(f"ckpt-{read_metrics(run)[-1]['step']}")


def test_fsdp_lora_matches_one_process_leaves_the_base_alone_and_resumes(runs, tmp_path):
    one, sharded, resumed = runs / "fsdp-lora-one", runs / "fsdp-lora", runs / "fsdp-lora-resumed"
    found = json.loads((runs / "fsdp-lora-report.json").read_text())
    # The base is sharded, has no gradients and no AdamW state, and comes out of training bit for bit.
    assert len(found["frozen"]) > 10 and not found["not_sharded"] and not found["with_grad"] and not found["changed"]
    adapters = [name for name in found["optimized"] if name.endswith(("lora_a", "lora_b"))]
    assert len(adapters) == len(found["optimized"]) == 2 * 3 * 2 and found["optimizer_state"] == found["optimized"]

    def assert_same_adapters(run_dir):
        assert_same_losses(run_dir, one)
        ours, reference = (read_adapter(run / "ckpt-4")[1] for run in (run_dir, one))
        assert sorted(ours) == sorted(reference) == sorted(adapters)
        for name, value in reference.items():
            torch.testing.assert_close(ours[name], value, rtol=0, atol=TOLERANCE, msg=name)

    assert_same_adapters(sharded)
    # Merged into the base for transformers, as the one process's adapters are.
    assert cli_main(["merge-lora", str(sharded / "ckpt-4"), "--out", str(tmp_path / "hf"), "--format", "hf"]) == 0
    ids = torch.randint(0, 257, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(from_pretrained(tmp_path / "hf")(ids), from_pretrained(one / "ckpt-4")(ids),
                                   rtol=0, atol=TOLERANCE)
    assert_same_adapters(resumed)
