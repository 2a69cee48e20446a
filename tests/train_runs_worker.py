"""Several ``flashformer train`` runs in one torchrun launch, one after another: run by tests under torchrun.

    torchrun --nproc_per_node 2 --standalone tests/train_runs_worker.py TRAIN_ARGS [--then TRAIN_ARGS ...]

TRAIN_ARGS are ``flashformer train``'s (a recipe, or --resume DIR with overrides), run on the CPU over gloo.
Every rank runs each through the command line's entry point; one launch and its processes' start-up (about
13 CPU-s) then serve several runs. The exit code is the first failing run's (the later runs are not
started), else 0.
"""

import sys

import torch.distributed as dist

from flashformer.cli import main

SEPARATOR = "--then"


def train_each(args: list[str]) -> int:
    runs = [[]]
    for arg in args:
        if arg == SEPARATOR:
            runs.append([])
        else:
            runs[-1].append(arg)
    store, rank, world_size = next(dist.rendezvous("env://"))
    for index, run in enumerate(runs):
        # Each run's group under its own keys of torchrun's store (the trainer leaves the group at its end): a
        # group joined again under the same keys can read the last group's addresses, and its ranks hang.
        dist.init_process_group("gloo", store=dist.PrefixStore(f"run-{index}", store), rank=rank,
                                world_size=world_size)
        code = main(["train", *run])
        if code:
            return code
    return 0


if __name__ == "__main__":
    sys.exit(train_each(sys.argv[1:]))
