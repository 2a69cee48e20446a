"""Several ``flashformer train`` runs in one torchrun launch, one after another: run by tests under torchrun.

    torchrun --nproc_per_node 2 --standalone tests/train_runs_worker.py RECIPE.yaml [RECIPE.yaml ...]

Every rank trains each recipe through the command line's entry point, which joins torchrun's process group
and leaves it again; one launch and its processes' start-up (about 13 CPU-s) then serve several runs. The
exit code is the first failing run's (the later runs are not started), else 0.
"""

import sys

from flashformer.cli import main


def train_each(recipes: list[str]) -> int:
    for recipe in recipes:
        code = main(["train", recipe])
        if code:
            return code
    return 0


if __name__ == "__main__":
    sys.exit(train_each(sys.argv[1:]))
