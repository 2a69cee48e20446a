"""``flashformer train | generate | tokenizer``: argument parsing only, the work lives in the modules.

    flashformer train configs/tiny.yaml optim.lr=3e-4 steps=2000
    flashformer train --resume runs/tiny steps=4000
    torchrun --nproc_per_node 8 -m flashformer.cli train configs/gpt2-124m.yaml
    flashformer generate runs/tiny/ckpt-1500 --prompt "def "
    flashformer tokenizer train --files data/*.txt --vocab-size 8192 --out tokenizer.json
"""

from __future__ import annotations

import argparse
import sys

USAGE_ERROR_EXIT_CODE = 2


def _train(argv: list[str]) -> int:
    from .checkpoint import CheckpointError
    from .config import ConfigError
    from .data import DataError
    from .train import INTERRUPTED_EXIT_CODE, load_train_config, train

    parser = argparse.ArgumentParser(prog="flashformer train", description="Train a GPT from a YAML recipe.")
    parser.add_argument("config", nargs="?", help="training recipe, e.g. configs/tiny.yaml")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. optim.lr=3e-4")
    parser.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its latest checkpoint")
    args = parser.parse_args(argv)
    overrides = list(args.overrides)
    if args.resume and args.config:
        overrides.insert(0, args.config)  # with --resume, every positional is an override
    if not args.resume and not args.config:
        parser.error("give a CONFIG.yaml or --resume RUN_DIR")
    if any("=" not in override for override in overrides):
        parser.error(f"overrides look like key=value, got {[o for o in overrides if '=' not in o]}")
    try:
        cfg = load_train_config(None if args.resume else args.config, overrides, resume_dir=args.resume)
        result = train(cfg)
    except (ConfigError, DataError, CheckpointError, FileNotFoundError) as error:
        print(f"flashformer train: error: {error}", file=sys.stderr)
        return USAGE_ERROR_EXIT_CODE
    return INTERRUPTED_EXIT_CODE if result.interrupted else 0


def _tokenizer(argv: list[str]) -> int:
    from .tokenizer import train_bpe

    parser = argparse.ArgumentParser(prog="flashformer tokenizer", description="Tokenizer tools.")
    commands = parser.add_subparsers(dest="command", required=True)
    train_parser = commands.add_parser("train", help="train a byte-level BPE tokenizer.json")
    train_parser.add_argument("--files", nargs="+", required=True, help="text files to learn merges from")
    train_parser.add_argument("--vocab-size", type=int, required=True)
    train_parser.add_argument("--out", default="tokenizer.json", help="destination tokenizer.json")
    args = parser.parse_args(argv)
    tokenizer = train_bpe(args.files, args.vocab_size, args.out)
    print(f"wrote {args.out} ({tokenizer.vocab_size} tokens)")
    return 0


def _generate(argv: list[str]) -> int:
    from .generate import main

    return main(argv)


def _finetune_long(argv: list[str]) -> int:
    from .finetune_long import main

    return main(argv)


COMMANDS = {"train": _train, "generate": _generate, "tokenizer": _tokenizer, "finetune-long": _finetune_long}


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``flashformer`` command; returns the exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: flashformer {{{','.join(COMMANDS)}}} ...\n{__doc__}", file=sys.stderr)
        return 0 if argv[:1] in (["-h"], ["--help"]) else USAGE_ERROR_EXIT_CODE
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
