"""``python scripts/train.py CONFIG.yaml key=value ...``: the same as ``flashformer train``."""

import sys

from flashformer.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
