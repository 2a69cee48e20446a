"""``flashformer finetune-long``: extend, evaluate, fine-tune, evaluate again, report.

    flashformer finetune-long runs/tiny --target-len 1024 --scaling linear --steps 200
    python scripts/finetune_long.py runs/tiny/ckpt-600 --target-len 1024 --scaling yarn batch_size=4

From a checkpoint (ours, a run directory, or a Hugging Face directory) trained at context L:

1. ``extended_model_config``: the model's config with RoPE scaled by ``factor = target / L`` and
   ``max_seq_len = target``; written as ``<run>/extended-init`` (same weights, new config).
2. ``long_context_train_config``: a TrainConfig from the checkpoint's run recipe (its config.yaml;
   defaults otherwise) with ``init_from=extended-init``, ``data.seq_len=target``,
   ``data.packing=packed`` (attention never crosses documents) and activation checkpointing, then
   ``flashformer.train.Trainer`` fine-tunes it: the same loop, checkpoints and metrics as ``train``.
3. Three models on the same held-out windows at each evaluated length: the original (RoPE as
   trained), the scaled one before fine-tuning (extended-init) and the fine-tuned one; perplexity
   and passkey retrieval (a 5-digit key hidden at several depths of filler text, scored by greedy
   decoding). Then the position-interpolation claim (Chen et al. 2023) as PASS / FAIL: the fine-tuned
   model at the target is no worse than the original at its own context L, while the original read
   at the target is more than CLAIM_DEGRADATION times worse. ``long_context_report.json``,
   ``long_context_report.md`` (table + verdict, also printed last) and ``perplexity_vs_length.png``
   land in the run directory.

Under torchrun (``parallel.context_parallel=N``, or data parallelism) every rank fine-tunes; rank 0 alone
writes the run's files and evaluates, as a single-device model (inference at the target must fit one
device), while the others wait for the training to start.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil

from ..checkpoint import from_pretrained
from ..config import ConfigError
from ..data import load_corpus
from ..fileio import atomic_write_file
from ..model import Transformer
from ..parallel import broadcast_from_main, init_distributed, raise_on_every_rank, shutdown_distributed
from ..tokenizer import TOKENIZER_FILE, load_tokenizer
from ..train import LOCK_FILE, RunLock, Trainer, latest_checkpoint
from ..train.model_setup import resolve_device
from .evaluate import evaluate_long_context, held_out_windows
from .extend import extended_model_config, long_context_train_config, resolve_checkpoint, save_extended_checkpoint
from .passkey import PASSKEY_TRAIN_DIR, mix_in_passkey_documents, passkey_prompts
from .report import MARKDOWN_FILE, MODELS, PLOT_FILE, REPORT_FILE, extension_claim, markdown_report, plot_perplexity


def _eval_lengths(requested, original_len: int, target_len: int) -> list[int]:
    """The requested lengths, or L, 2L, 4L and the target (those up to the target)."""
    if requested:
        if any(n < 1 for n in requested):
            raise ConfigError(f"--eval-lengths must be positive, got {requested}")
        return sorted(set(requested))
    return sorted({n for n in (original_len, 2 * original_len, 4 * original_len, target_len) if n <= target_len})


def _expected_time(trainer: Trainer, cfg, lengths: list[int], windows: int, prompts: dict[int, int]) -> str:
    """The run's expected wall time on this machine, from one timed training micro-batch and one timed
    forward at the target length (after a warm-up of each): the fine-tuning's steps, and three models'
    evaluation (perplexity windows and passkey prompts; a prompt's few greedy tokens counted as one more
    forward), with forward time taken as linear in length."""
    import time

    import torch

    target = max(lengths)
    # a private generator: the timing must not move the RNG streams that training and evaluation draw from
    tokens = torch.randint(0, trainer.model.config.vocab_size, (cfg.micro_batch_size, target),
                           generator=torch.Generator().manual_seed(0)).to(trainer.device)

    def timed(fn) -> float:
        fn()  # warm-up: kernel compilation, autotuning, allocator
        if trainer.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if trainer.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    def train_micro_batch():
        with torch.autocast(trainer.device.type, torch.bfloat16, enabled=trainer.bf16):
            loss = trainer.wrapped(tokens, targets=tokens)
        loss.backward()

    def forward_one_row():
        with torch.no_grad(), torch.autocast(trainer.device.type, torch.bfloat16, enabled=trainer.bf16):
            trainer.model(tokens[:1])

    step_seconds = timed(train_micro_batch) * cfg.batch_size / cfg.micro_batch_size
    trainer.model.zero_grad(set_to_none=True)
    forward_seconds = timed(forward_one_row)
    evaluate_seconds = 3 * sum(forward_seconds * n / target * (windows + 2 * prompts[n]) for n in lengths)
    train_seconds = step_seconds * cfg.steps

    def duration(seconds: float) -> str:  # a CPU example takes a minute or two: minutes alone round it to 0
        return f"~{seconds:.0f} s" if seconds < 120 else f"~{seconds / 60:.0f} min"

    return (f"expected time on this machine: {duration(train_seconds + evaluate_seconds)} "
            f"(fine-tuning {cfg.steps} steps x {step_seconds:.1f} s, evaluation {duration(evaluate_seconds)}: "
            f"3 models x {windows} windows and {max(prompts.values())} passkey prompts per length)")


def finetune_long(args: argparse.Namespace) -> tuple[int, dict | None]:
    """Extend, evaluate, fine-tune, evaluate again; every input is checked before any training, and the
    run directory is locked from the first file written into it to the report.

    Args:
        args: the parsed ``flashformer finetune-long`` arguments (cli.py).
    Returns:
        (exit code, the report, also written as JSON and markdown); the report is None when a signal
        stopped training (exit code 128 + its number), and on every rank but 0 under torchrun.
    """
    checkpoint = resolve_checkpoint(args.checkpoint)
    original = from_pretrained(checkpoint)
    original_len = original.config.max_seq_len
    extended_config = extended_model_config(original.config, args.target_len, args.scaling)
    if args.eval_windows < 1 or args.passkey_trials < 1:
        raise ConfigError(f"--eval-windows and --passkey-trials must be >= 1, got {args.eval_windows}, "
                          f"{args.passkey_trials}")
    if any(not 0.0 <= depth <= 1.0 for depth in args.passkey_depths):
        raise ConfigError(f"--passkey-depths must be in [0, 1], got {args.passkey_depths}")
    lengths = _eval_lengths(args.eval_lengths, original_len, args.target_len)
    cfg = long_context_train_config(args.checkpoint, extended_config, args.scaling, args.out_dir, args.steps,
                                    args.lr, args.warmup_steps, args.overrides)
    env = init_distributed(cfg.parallel, resolve_device(cfg.device))  # torchrun's group; nothing alone
    try:
        return _in_run_dir(args, cfg, env, checkpoint, original, extended_config, lengths)
    finally:
        shutdown_distributed()


def _in_run_dir(args, cfg, env, checkpoint: str, original: Transformer, extended_config, lengths):
    """The run under the lock of its directory, which rank 0 creates and holds."""
    created = not os.path.exists(cfg.run_dir)
    error = lock = None
    if env.is_main:
        try:
            os.makedirs(cfg.run_dir, exist_ok=True)
            lock = RunLock(cfg.run_dir).acquire()
        except OSError as failure:
            error = ConfigError(f"--out-dir {cfg.run_dir!r} cannot be created: {failure.strerror or failure}")
        except ConfigError as failure:
            error = failure
    raise_on_every_rank(error, ConfigError(f"rank 0 could not take --out-dir {cfg.run_dir!r} (it says why)"), env)
    try:
        return _extend_train_and_report(args, cfg, env, checkpoint, original, extended_config, lengths)
    finally:
        if lock is not None:
            lock.release()
        if env.is_main and created and set(os.listdir(cfg.run_dir)) <= {LOCK_FILE}:  # nothing written: no directory
            shutil.rmtree(cfg.run_dir, ignore_errors=True)


def _extend_train_and_report(args, cfg, env, checkpoint: str, original: Transformer, extended_config, lengths):
    original_len = original.config.max_seq_len
    original.attn_backend = cfg.attn_backend
    # Named explicitly (not left to the Trainer) so that the held-out corpus below is cached under
    # this tokenizer, not under the byte-level default.
    if cfg.data.tokenizer is None and os.path.isfile(os.path.join(checkpoint, TOKENIZER_FILE)):
        cfg.data.tokenizer = os.path.join(checkpoint, TOKENIZER_FILE)
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    held_out_data = cfg.data
    error = None
    if env.is_main:  # the files every rank trains from
        try:
            if args.passkey_train_fraction:
                cfg.data = mix_in_passkey_documents(cfg.data, tokenizer, args.passkey_train_fraction, original_len,
                                                    os.path.join(cfg.run_dir, PASSKEY_TRAIN_DIR), cfg.seed)
            save_extended_checkpoint(original, extended_config, cfg.init_from, tokenizer)
        except Exception as failure:  # raised below, on every rank
            error = failure
    raise_on_every_rank(error, ConfigError("rank 0 could not prepare the fine-tuning data or extended-init "
                                           "(it says why)"), env)
    cfg.data = broadcast_from_main(cfg.data, env)
    trainer = Trainer(cfg)

    def evaluate(model: Transformer, label: str) -> dict[int, dict]:
        return evaluate_long_context(model.to(trainer.device), tokenizer, windows, prompts, cfg.micro_batch_size,
                                     trainer.bf16, label)

    def load(path: str) -> Transformer:
        return from_pretrained(path, device=trainer.device, attn_backend=cfg.attn_backend)

    try:
        if env.is_main:
            windows = held_out_windows(load_corpus(held_out_data, tokenizer)[1], lengths, args.eval_windows)
            prompts = {n: passkey_prompts(tokenizer, n, args.passkey_depths, args.passkey_trials, cfg.seed)
                       for n in lengths}
            if not env.distributed:  # it times one process's training step
                print(_expected_time(trainer, cfg, lengths, args.eval_windows,
                                     {n: len(p) for n, p in prompts.items()}))
            results = {"original": evaluate(original, "original")}
            del original  # its memory is the fine-tuning's
            results["scaled"] = evaluate(load(cfg.init_from), "scaled")
        result = trainer.fit()
    finally:
        trainer.close()
    if result.interrupted or not env.is_main:
        return result.exit_code, None
    finetuned_dir = latest_checkpoint(trainer.run_dir)
    results["finetuned"] = evaluate(load(finetuned_dir), "finetuned")
    rows = [{"length": n, **{f"{metric}_{model}": results[model][n][metric]
                             for metric in ("ppl", "passkey", "passkey_by_depth") for model in MODELS}}
            for n in lengths]
    report = {
        "checkpoint": checkpoint,
        "run_dir": trainer.run_dir,
        "finetuned_checkpoint": finetuned_dir,
        "scaling": args.scaling,
        "rope_scaling": extended_config.rope_scaling,
        "rope_theta": extended_config.rope_theta,
        "original_length": original_len,
        "target_length": args.target_len,
        "steps": result.step,
        "train_loss": result.train_loss,
        "eval_windows": len(next(iter(windows.values()))),
        "passkey_train_fraction": args.passkey_train_fraction,
        "passkey_depths": list(args.passkey_depths),
        "passkey_prompts_per_length": {n: len(p) for n, p in prompts.items()},
        "lengths": rows,
        "claim": extension_claim(rows, original_len, args.target_len),
    }
    atomic_write_file(os.path.join(trainer.run_dir, REPORT_FILE),
                      lambda f: f.write(json.dumps(report, indent=2).encode()))
    atomic_write_file(os.path.join(trainer.run_dir, MARKDOWN_FILE),
                      lambda f: f.write((markdown_report(report) + "\n").encode()))
    plot_perplexity(report, os.path.join(trainer.run_dir, PLOT_FILE))
    return 0, report
