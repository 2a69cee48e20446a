"""``python scripts/finetune_long.py CHECKPOINT --target-len N ...``: the same as ``flashformer finetune-long``."""

import sys

from flashformer.cli import main

if __name__ == "__main__":
    sys.exit(main(["finetune-long", *sys.argv[1:]]))
