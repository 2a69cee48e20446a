"""``flashformer train | generate | finetune-long | merge-lora | tokenizer``: argument parsing and error reporting
only, the work lives in the modules.

    flashformer train configs/tiny.yaml optim.lr=3e-4 steps=2000
    flashformer train --resume runs/tiny steps=4000
    torchrun --nproc_per_node 8 -m flashformer.cli train configs/gpt2-124m.yaml
    flashformer generate runs/tiny/ckpt-1500 --prompt "def "
    flashformer finetune-long runs/tiny --target-len 1024 --scaling yarn --steps 60
    flashformer merge-lora runs/tiny-lora/ckpt-200 --out merged/
    flashformer tokenizer train --files data/*.txt --vocab-size 8192 --out tokenizer.json

Exit codes: 0 done; 1 another failure, e.g. a disk that refused a write (full, a file-size limit: the
message names the path); 2 a usage error (a config key, a file, a run directory in use), reported in one
line (``--debug`` shows the traceback); 3 training diverged (more NaN / inf losses in a row than
max_nonfinite_skips, and max_rollbacks rollbacks if any); 128 + N stopped by signal N after saving a checkpoint
(130 Ctrl-C, 143 SIGTERM), or before the first step with nothing to save.
"""

from __future__ import annotations

import argparse
import sys

USAGE_ERROR_EXIT_CODE = 2
FAILURE_EXIT_CODE = 1


def _guarded(prog: str, debug: bool, work) -> int:
    """Run ``work()`` and turn the errors a user can fix into one line on stderr and an exit code."""
    from .checkpoint import CheckpointError
    from .config import ConfigError
    from .data import DataError
    from .fileio import WriteError
    from .train import INTERRUPTED_EXIT_CODE, NONFINITE_EXIT_CODE, Interrupted, NonFiniteLossError

    if debug:
        return work()
    try:
        return work()
    except (ConfigError, DataError, CheckpointError, FileNotFoundError) as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        return USAGE_ERROR_EXIT_CODE
    except NonFiniteLossError as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        return NONFINITE_EXIT_CODE
    except WriteError as error:  # names the path and what to do: where in the code does not help
        print(f"{prog}: error: {error}", file=sys.stderr)
        return FAILURE_EXIT_CODE
    except OSError as error:
        print(f"{prog}: error: {error} (--debug shows where)", file=sys.stderr)
        return FAILURE_EXIT_CODE
    except Interrupted as error:
        print(f"{prog}: {error}", file=sys.stderr)
        return error.exit_code
    except KeyboardInterrupt:
        print(f"{prog}: aborted by a second Ctrl-C: nothing saved after the last checkpoint", file=sys.stderr)
        return INTERRUPTED_EXIT_CODE


def _check_overrides(parser: argparse.ArgumentParser, overrides: list[str]) -> None:
    if any("=" not in override for override in overrides):
        parser.error(f"overrides look like key=value, got {[o for o in overrides if '=' not in o]}")


def _debug_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")


def _run_of_checkpoint(prog: str, path: str) -> str:
    """The run directory ``--resume`` means: ``path`` itself, or the run of ``path`` when it is that run's
    latest checkpoint (a resumed run continues from its latest; an older one would drop the later ones)."""
    import os

    from .config import ConfigError
    from .train import TRAINER_STATE_FILE, latest_checkpoint

    if not os.path.isfile(os.path.join(path, TRAINER_STATE_FILE)):
        return path
    run_dir = os.path.dirname(os.path.abspath(path))
    latest = latest_checkpoint(run_dir)
    if latest is None or os.path.abspath(latest) != os.path.abspath(path):
        raise ConfigError(f"--resume {path}: a run resumes from its latest checkpoint ({latest}); to train on from "
                          f"this one, start a new run from it: flashformer train RECIPE.yaml init_from={path} "
                          f"name=...")
    print(f"{prog}: resuming the run {run_dir} ({os.path.basename(path)} is its latest checkpoint)")
    return run_dir


def _train(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="flashformer train", description="Train a GPT from a YAML recipe.")
    parser.add_argument("config", nargs="?", help="training recipe, e.g. configs/tiny.yaml")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. optim.lr=3e-4")
    parser.add_argument("--resume", metavar="RUN_DIR",
                        help="continue the run in RUN_DIR from its latest checkpoint; overrides may change its "
                             "length, intervals and optimizer, not its model or data")
    _debug_flag(parser)
    args = parser.parse_intermixed_args(argv)
    overrides = list(args.overrides)
    if args.resume and args.config:
        overrides.insert(0, args.config)  # with --resume, every positional is an override
    if not args.resume and not args.config:
        parser.error("give a CONFIG.yaml or --resume RUN_DIR")
    _check_overrides(parser, overrides)

    def work() -> int:
        from .train import load_train_config, train

        resume_dir = _run_of_checkpoint(parser.prog, args.resume) if args.resume else None
        cfg = load_train_config(None if args.resume else args.config, overrides, resume_dir=resume_dir)
        return train(cfg).exit_code

    return _guarded(parser.prog, args.debug, work)


def _finetune_long(argv: list[str]) -> int:
    from .longctx import DEFAULT_PASSKEY_DEPTHS, REPORT_FILE, SCALINGS

    parser = argparse.ArgumentParser(
        prog="flashformer finetune-long",
        description="Extend a checkpoint's context (RoPE scaling + fine-tuning on long packed documents) and "
                    "report perplexity and passkey retrieval of the original, scaled and fine-tuned models.")
    parser.add_argument("checkpoint", help="our checkpoint or run directory, or a Hugging Face directory")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="training overrides applied last, e.g. batch_size=4 micro_batch_size=2")
    parser.add_argument("--target-len", type=int, required=True, help="the new context length")
    parser.add_argument("--scaling", default="linear", choices=SCALINGS, help="RoPE scaling (default: linear)")
    parser.add_argument("--steps", type=int, default=200, help="fine-tuning optimizer steps")
    parser.add_argument("--lr", type=float, default=None, help="peak learning rate (default: a tenth of the recipe's)")
    parser.add_argument("--warmup-steps", type=int, default=None, help="default: a tenth of --steps")
    parser.add_argument("--out-dir", default=None, help="run directory (default: runs/<recipe name>-<scaling><target>)")
    parser.add_argument("--eval-lengths", type=int, nargs="+", default=None,
                        help="lengths to evaluate (default: L, 2L, 4L and the target, up to the target)")
    parser.add_argument("--eval-windows", type=int, default=8, help="held-out windows per length")
    parser.add_argument("--passkey-depths", type=float, nargs="+", default=list(DEFAULT_PASSKEY_DEPTHS))
    parser.add_argument("--passkey-trials", type=int, default=4, help="passkey prompts per depth and length")
    parser.add_argument("--passkey-train-fraction", type=float, default=0.0,
                        help="share of training tokens that are passkey examples (at most the original length)")
    _debug_flag(parser)
    args = parser.parse_intermixed_args(argv)  # overrides may follow the options
    _check_overrides(parser, args.overrides)

    def work() -> int:
        import os

        from .longctx import finetune_long, markdown_report

        exit_code, report = finetune_long(args)
        if report is not None:
            print(f"report: {os.path.join(report['run_dir'], REPORT_FILE)}")
            print(markdown_report(report))
        return exit_code

    return _guarded(parser.prog, args.debug, work)


def _tokenizer(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="flashformer tokenizer", description="Tokenizer tools.")
    commands = parser.add_subparsers(dest="command", required=True)
    train_parser = commands.add_parser("train", help="train a byte-level BPE tokenizer.json")
    train_parser.add_argument("--files", nargs="+", required=True, help="text files to learn merges from")
    train_parser.add_argument("--vocab-size", type=int, required=True)
    train_parser.add_argument("--out", default="tokenizer.json", help="destination tokenizer.json")
    _debug_flag(train_parser)
    args = parser.parse_args(argv)

    def work() -> int:
        from .tokenizer import train_bpe

        tokenizer = train_bpe(args.files, args.vocab_size, args.out)
        print(f"wrote {args.out} ({tokenizer.vocab_size} tokens)")
        return 0

    return _guarded("flashformer tokenizer train", args.debug, work)


def _merge_lora(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="flashformer merge-lora",
        description="Merge a LoRA adapter checkpoint into its base and write a full checkpoint.")
    parser.add_argument("adapter", help="a LoRA run's checkpoint (or run directory: its latest checkpoint)")
    parser.add_argument("--out", required=True, help="destination checkpoint directory (replaced)")
    parser.add_argument("--format", default="flashformer", choices=["flashformer", "hf"],
                        help="hf writes a directory transformers' AutoModelForCausalLM loads")
    _debug_flag(parser)
    args = parser.parse_args(argv)

    def work() -> int:
        from .checkpoint import from_pretrained
        from .train import latest_checkpoint
        from .tokenizer import load_tokenizer

        adapter = latest_checkpoint(args.adapter) or args.adapter
        merged = from_pretrained(adapter)
        merged.save_pretrained(args.out, format=args.format, tokenizer=load_tokenizer(adapter))
        print(f"wrote {args.out} ({merged.num_params() / 1e6:.2f}M parameters, adapters of {adapter} merged)")
        return 0

    return _guarded(parser.prog, args.debug, work)


def _generate(argv: list[str]) -> int:
    from .generate import main

    debug = "--debug" in argv
    argv = [arg for arg in argv if arg != "--debug"]
    return _guarded("flashformer generate", debug, lambda: main(argv))


COMMANDS = {"train": _train, "generate": _generate, "tokenizer": _tokenizer, "finetune-long": _finetune_long,
            "merge-lora": _merge_lora}
SUMMARIES = {
    "train": "train a GPT from a YAML recipe, or resume a run",
    "generate": "sample text from a checkpoint",
    "tokenizer": "train a BPE tokenizer on text files",
    "finetune-long": "extend a checkpoint's context (RoPE scaling + long-document fine-tuning) and report",
    "merge-lora": "merge a LoRA adapter checkpoint into its base as a full checkpoint",
}
USAGE = f"usage: flashformer [-h] [--version] {{{','.join(COMMANDS)}}} ..."


def _help() -> str:
    commands = "\n".join(f"  {name:<14} {SUMMARIES[name]}" for name in COMMANDS)
    examples = __doc__.split("\n\n", 1)[1]
    return f"{USAGE}\n\ncommands (flashformer COMMAND --help for its options):\n{commands}\n\n{examples}"


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``flashformer`` command; returns the exit code."""
    import difflib

    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] in (["-h"], ["--help"]):
        print(_help())
        return 0
    if argv[:1] == ["--version"]:
        from . import __version__

        print(f"flashformer {__version__}")
        return 0
    if not argv:
        print(f"{USAGE}\nflashformer: error: a command is required ({', '.join(COMMANDS)})", file=sys.stderr)
        return USAGE_ERROR_EXIT_CODE
    if argv[0] not in COMMANDS:
        close = difflib.get_close_matches(argv[0], COMMANDS, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else f"; the commands are {', '.join(COMMANDS)}"
        print(f"{USAGE}\nflashformer: error: unknown command '{argv[0]}'{hint}", file=sys.stderr)
        return USAGE_ERROR_EXIT_CODE
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
