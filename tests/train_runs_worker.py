"""Several runs in one torchrun launch, one after another: run by tests under torchrun.

    torchrun --nproc_per_node 2 --standalone tests/train_runs_worker.py RUN [--then RUN ...]

A RUN is ``flashformer train``'s arguments (a recipe, or --resume DIR with overrides), run on the CPU over gloo
through the command line's entry point; or ``--rewind RUN_DIR COPY_DIR STEP`` (rank 0 copies a finished run
and rewinds the copy, as if it had died after ckpt-STEP, for a later RUN to resume); or ``--lora-report RECIPE
REPORT`` (tests/lora_fsdp_worker.py's run and report). One launch and its processes' start-up (about 13 CPU-s)
then serve several runs. The exit code is the first failing run's (the later runs are not started), else 0.
"""

import faulthandler
import json
import shutil
import sys
from pathlib import Path

import torch.distributed as dist

from flashformer.cli import main

SEPARATOR = "--then"
# A launch that hangs is killed by its test at LAUNCH_TIMEOUT_S: each rank prints every thread's stack to stderr a
# minute before, so that the test's failure shows where the ranks waited.
LAUNCH_TIMEOUT_S = 600
STACKS_AFTER_S = LAUNCH_TIMEOUT_S - 60
REWIND = "--rewind"
LORA_REPORT = "--lora-report"


def rewind(run_dir, step: int) -> None:
    """``run_dir`` as if its run had died after its checkpoint at ``step``: no later checkpoint nor metrics record."""
    run_dir = Path(run_dir)
    for checkpoint in run_dir.glob("ckpt-*"):
        if int(checkpoint.name.split("-")[1]) > step:
            shutil.rmtree(checkpoint)
    metrics = run_dir / "metrics.jsonl"
    metrics.write_text("".join(line for line in metrics.read_text().splitlines(True)
                               if json.loads(line)["step"] <= step))


def rewind_args(run_dir, copy_dir, step: int) -> list[str]:
    """The RUN that rewinds a copy of ``run_dir`` at ``copy_dir`` to ``step``."""
    return [REWIND, str(run_dir), str(copy_dir), str(step)]


def rewind_copy(run_dir: str, copy_dir: str, step: str) -> int:
    if dist.get_rank() == 0:
        shutil.copytree(run_dir, copy_dir)
        rewind(copy_dir, int(step))
    dist.barrier()  # the next run may read the copy on any rank
    dist.destroy_process_group()
    return 0


def lora_report(recipe: str, report: str) -> int:
    from lora_fsdp_worker import train_and_report

    train_and_report(recipe, report)
    return 0


def train_each(args: list[str]) -> int:
    runs = [[]]
    for arg in args:
        if arg == SEPARATOR:
            runs.append([])
        else:
            runs[-1].append(arg)
    store, rank, world_size = next(dist.rendezvous("env://"))
    for index, run in enumerate(runs):
        # Each run's group under its own keys of torchrun's store (a run leaves the group at its end): a
        # group joined again under the same keys can read the last group's addresses, and its ranks hang.
        dist.init_process_group("gloo", store=dist.PrefixStore(f"run-{index}", store), rank=rank,
                                world_size=world_size)
        if run[0] == REWIND:
            code = rewind_copy(*run[1:])
        elif run[0] == LORA_REPORT:
            code = lora_report(*run[1:])
        else:
            code = main(["train", *run])
        if code:
            return code
    return 0


if __name__ == "__main__":
    faulthandler.dump_traceback_later(STACKS_AFTER_S)
    sys.exit(train_each(sys.argv[1:]))
