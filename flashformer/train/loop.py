"""The training loop behind ``flashformer train CONFIG.yaml key=value ...``.

    cfg = load_train_config("configs/tiny.yaml", ["optim.lr=3e-4"])
    result = train(cfg)                       # or: Trainer(cfg).fit(), then close()

A run directory (``out_dir``, default ``runs/<name>``) holds the resolved ``config.yaml``,
``metrics.jsonl``, ``loss.png`` and checkpoints ``ckpt-<step>/`` (state.py). One process trains in
it at a time (its ``.lock``). Resuming reproduces the uninterrupted run exactly on CPU.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import yaml
from tqdm.auto import tqdm

from ..checkpoint import from_pretrained
from ..config import ConfigError, config_to_dict, save_config
from ..batches import Batch, TrainBatches, eval_batches
from ..chat import ChatTemplate, load_chat_corpus
from ..context_parallel import context_parallel
from ..data import corpus_cache_dir, load_corpus
from ..fileio import WriteError
from ..losses import default_chunk_size
from ..model import Transformer
from ..parallel import (all_reduce, barrier, full_state_dicts, init_distributed, load_optimizer_state_dict,
                        parallelize, raise_on_every_rank, shutdown_distributed)
from ..tokenizer import TOKENIZER_FILE, load_tokenizer
from ..weights import latest_checkpoint
from .config import RUN_CONFIG_FILE, TrainConfig
from .model_setup import build_model, resolve_device
from .metrics import METRICS_FILE, MetricsLog, abridged, plot_losses
from .run_dir import RunDirectory, init_checkpoint
from .state import (capture_rng, load_checkpoint_weights, prune_checkpoints, read_trainer_state, restore_rng,
                    seed_everything, write_checkpoint)
from .step import (build_optimizer, count_targets, lm_loss, lr_factor, nonfinite, set_hyperparameters,
                   shard_micro_batch, train_step)
from .stops import NonFiniteLossError, SkippedSteps, StepFlags, StopRequests, TrainResult, interrupts_raise

CHUNKED_LOSS_MIN_SEQ_LEN = 8192  # chunked_loss=None chunks from here: the logits outgrow the activations


class Trainer:
    """Sets a run up (every check before any step), then ``fit()`` trains it; ``close()`` lets the run
    directory go (``train`` does both).

    Args:
        cfg: the resolved training config.
    Raises:
        ConfigError / DataError / CheckpointError: bad config values, data paths, out_dir or init_from;
            RunDirLocked (a ConfigError): another live process trains in out_dir;
        Interrupted: SIGINT / SIGTERM before the setup was done.
    """

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.run_dir = cfg.run_dir
        self.env = init_distributed(cfg.parallel, resolve_device(cfg.device))
        self.device = self.env.device
        self.bf16 = cfg.precision == "bf16" or (cfg.precision == "auto" and self.device.type == "cuda")
        self.run = RunDirectory(self.run_dir, self.env)
        try:
            with interrupts_raise():
                self._setup()
        except BaseException:
            self.run.close(started=False)  # a run that never started leaves no directory behind
            raise

    def _setup(self) -> None:
        cfg = self.cfg
        init_dir = self.init_dir = init_checkpoint(cfg)
        self.run.open()
        self.resume_from, resume_state = self.run.resume_checkpoint(cfg)
        self.weights_from = self.resume_from or init_dir
        self._choose_tokenizer()
        self.tokenizer = load_tokenizer(cfg.data.tokenizer)
        corpus_cache_dir(cfg.data)  # raises now, before any model is built, if a data file is missing
        if cfg.data.format == "chat":
            ChatTemplate.of(self.tokenizer)  # and if the tokenizer cannot render chats
        seed_everything(cfg.seed)
        self.model = self._build_model()
        train_corpus, eval_corpus = self._load_data()
        # Data parallelism splits the rows; the ranks of a context-parallel group read the same rows.
        self.batches = TrainBatches(train_corpus, cfg.data, cfg.batch_size, cfg.micro_batch_size, cfg.seed,
                                    self.env.dp_rank, self.env.dp_size)
        self.eval_set = eval_batches(eval_corpus, cfg.data, cfg.eval_batches * cfg.batch_size, cfg.micro_batch_size,
                                     self.env.dp_rank, self.env.dp_size)
        self.wrapped = parallelize(self.model, cfg.parallel, self.env, cfg.activation_checkpointing, cfg.compile)
        self.optimizer = build_optimizer(self.wrapped, cfg.optim)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: lr_factor(step, cfg.optim, cfg.steps))
        chunked = cfg.chunked_loss if cfg.chunked_loss is not None else cfg.data.seq_len >= CHUNKED_LOSS_MIN_SEQ_LEN
        self.loss_chunk_size = default_chunk_size(self.model.config.vocab_size) if chunked else None
        self.step = 0
        self.skipped = SkippedSteps(cfg.max_nonfinite_skips)
        self.rollbacks = 0
        if self.resume_from is not None:
            self._load_trainer_state(resume_state)
        if self.env.is_main:
            save_config(cfg, os.path.join(self.run_dir, RUN_CONFIG_FILE))
            self._print_summary(train_corpus, eval_corpus)

    def close(self) -> None:
        """Release the run directory's lock (idempotent)."""
        self.run.close()

    # ----- setup -----

    def _choose_tokenizer(self) -> None:
        data = self.cfg.data
        candidate = os.path.join(self.weights_from, TOKENIZER_FILE) if self.weights_from else None
        # A checkpoint's own tokenizer is the one its model was trained with: a fine-tune without
        # data.tokenizer keeps it, and a resumed run always takes it (the recorded path may lie in a
        # checkpoint since pruned).
        if candidate and os.path.isfile(candidate) and (data.tokenizer is None or self.resume_from):
            data.tokenizer = candidate
        if data.tokenizer is not None and not os.path.exists(data.tokenizer):
            raise ConfigError(f"data.tokenizer: {data.tokenizer!r} does not exist")

    def _build_model(self) -> Transformer:
        model = build_model(self.cfg, self.device, self.bf16, self.init_dir, self.weights_from, self.resume_from)
        if self.tokenizer.vocab_size > self.cfg.model.vocab_size:
            raise ConfigError(f"the tokenizer has {self.tokenizer.vocab_size} tokens "
                              f"but model.vocab_size is {self.cfg.model.vocab_size}")
        return model

    def _load_data(self):
        # The main process tokenizes (once, cached); the others wait, then map the same files.
        load = load_chat_corpus if self.cfg.data.format == "chat" else load_corpus
        corpora = load(self.cfg.data, self.tokenizer) if self.env.is_main else None
        barrier(self.env)
        return corpora or load(self.cfg.data, self.tokenizer, build=False)

    def _print_summary(self, train_corpus, eval_corpus) -> None:
        cfg = self.cfg
        print(yaml.safe_dump(abridged(config_to_dict(cfg)), sort_keys=False).rstrip())
        tokens_per_step = cfg.batch_size * cfg.data.seq_len
        trainable = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        env = self.env
        layout = f" ({env.dp_size} data- x {env.context_parallel} context-parallel)" if env.context_parallel > 1 else ""
        print(f"model: {self.model.num_params() / 1e6:.2f}M parameters ({trainable / 1e6:.2f}M trainable) | "
              f"device: {self.device} x {env.world_size}{layout} | "
              f"precision: {'bf16 autocast' if self.bf16 else 'fp32'}")
        print(f"data: {train_corpus.num_tokens:,} train tokens ({train_corpus.num_docs} docs), "
              f"{eval_corpus.num_tokens:,} eval tokens | {tokens_per_step:,} tokens/step, "
              f"grad accumulation {self.batches.grad_accum_steps}")
        if train_corpus.loss_mask is not None:
            print(f"chat: the loss is on {int(train_corpus.loss_mask.sum()):,} assistant tokens of "
                  f"{train_corpus.num_tokens:,} in training; conversations longer than data.seq_len="
                  f"{cfg.data.seq_len} dropped: {train_corpus.dropped} train, {eval_corpus.dropped} eval")
        if self.resume_from:
            print(f"resuming from {self.resume_from} (step {self.step})")
            if self.step >= self.cfg.steps:
                print(f"the run is already at step {self.step} of steps={self.cfg.steps}: nothing to train "
                      f"(resume with steps=N above {self.step} to train on)")
        print(f"run directory: {self.run_dir}")

    # ----- steps -----

    def _local(self, batch: Batch) -> Batch:
        """``batch`` on the device; under context parallelism this rank's slice of it."""
        batch = batch.to(self.device)
        return batch if self.env.cp_group is None else shard_micro_batch(batch, self.env.cp_group)

    def _attention(self):
        """Context around the model's forward and backward: under context parallelism attention rings over
        the group (recomputed activations need it in backward too)."""
        return contextlib.nullcontext() if self.env.cp_group is None else context_parallel(self.env.cp_group)

    def train_step(self) -> tuple[torch.Tensor, torch.Tensor, float]:
        """Queue one optimizer step; returns (this rank's share of the loss: the mean over the ranks is the
        step's mean over all its targets, grad norm, lr used), the first two as device tensors: nothing here
        waits for the GPU."""
        lr = self.optimizer.param_groups[0]["lr"]
        micro_batches = [self._local(batch) for batch in self.batches.next_step()]
        env = self.env
        agree = (lambda flag: all_reduce(flag, env, op=dist.ReduceOp.MAX)) if env.distributed else None
        mean_over_ranks = (lambda count: all_reduce(count, env) / env.world_size) if env.distributed else None
        loss, grad_norm = train_step(self.wrapped, self.optimizer, micro_batches, bf16=self.bf16,
                                     loss_chunk_size=self.loss_chunk_size, scheduler=self.scheduler,
                                     max_grad_norm=self.cfg.optim.grad_clip or math.inf, skip_nonfinite=True,
                                     agree=agree, mean_over_ranks=mean_over_ranks, context=self._attention)
        return loss, grad_norm, lr

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss over every target of the fixed held-out rows of all ranks."""
        self.wrapped.eval()
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)
        for batch in self.eval_set:
            local = self._local(batch)
            with self._attention():
                totals[0] += lm_loss(self.wrapped, local, self.bf16, self.loss_chunk_size, divisor=1.0).double()
            totals[1] += count_targets(local)
        self.wrapped.train()
        totals = all_reduce(totals, self.env)
        return (totals[0] / totals[1]).item()

    # ----- checkpoints -----

    def save_checkpoint(self) -> str:
        """Write ``ckpt-<step>`` atomically (all ranks call it) and drop all but the newest keep_checkpoints."""
        lora = self.cfg.lora if self.cfg.lora.enabled else None
        # Under LoRA the adapters only: the frozen base is never gathered nor copied out.
        model_state, optimizer_state = full_state_dicts(self.wrapped, self.optimizer, trainable_only=lora is not None)
        path = os.path.join(self.run_dir, f"ckpt-{self.step}")
        failure = None
        if self.env.is_main:
            state = {
                "step": self.step,
                "data_position": self.batches.position,
                "skipped_steps": self.skipped.total,
                "rollbacks": self.rollbacks,
                "optimizer": optimizer_state,
                "scheduler": self.scheduler.state_dict(),
                "rng": capture_rng(),
                "config": config_to_dict(self.cfg),
            }
            model = self.model if lora is not None else self._full_model(model_state)
            try:
                write_checkpoint(path, model, self.tokenizer, state, lora, self.init_dir, adapters=model_state)
            except WriteError as error:
                failure = error
            else:
                prune_checkpoints(self.run_dir, self.cfg.keep_checkpoints)
        raise_on_every_rank(failure, WriteError(f"rank 0 could not write {path} (its error says why)"), self.env)
        return path

    def _full_model(self, model_state: dict) -> Transformer:
        """The unsharded model: the model itself, or under FSDP a CPU copy built from the gathered weights."""
        if self.cfg.parallel.mode != "fsdp" or not self.env.distributed:
            return self.model
        with torch.device("meta"):
            copy = Transformer(self.cfg.model)
        copy.load_state_dict(model_state, assign=True)
        return copy

    def _load_trainer_state(self, state: dict) -> None:
        load_optimizer_state_dict(self.wrapped, self.optimizer, state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        # The state dicts bring back the hyper-parameters they were saved with; use the ones asked for now.
        set_hyperparameters(self.optimizer, self.scheduler, self.cfg.optim,
                            lr_factor(self.scheduler.last_epoch, self.cfg.optim, self.cfg.steps))
        self.step = state["step"]
        self.batches.position = state["data_position"]
        self.skipped.total = state.get("skipped_steps", 0)  # absent from checkpoints of earlier versions
        self.rollbacks = state.get("rollbacks", 0)
        restore_rng(state["rng"])

    # ----- the loop -----

    def _flags(self, stop: StopRequests, step: int, loss, grad_norm) -> StepFlags:
        skipped = nonfinite(loss, grad_norm)
        flags = torch.stack([torch.full_like(skipped, float(stop.signal)), skipped])
        if self.env.distributed:
            flags = all_reduce(flags, self.env, op=dist.ReduceOp.MAX)
        return StepFlags(step, flags, loss, grad_norm)

    def _roll_back(self, flags: StepFlags, metrics: MetricsLog | None, bar) -> MetricsLog | None:
        """Reload the latest checkpoint (every rank does) and train on from the batches after the ones that
        diverged, optim.lr scaled by rollback_lr_scale; returns the metrics log, rewound to the checkpoint."""
        checkpoint = latest_checkpoint(self.run_dir)
        state = read_trainer_state(checkpoint)
        load_checkpoint_weights(self.model, checkpoint, adapters_only=self.cfg.lora.enabled)
        optim, scale = self.cfg.optim, self.cfg.rollback_lr_scale
        optim.lr, optim.min_lr = optim.lr * scale, optim.min_lr * scale
        # Everything as the checkpoint left it but the data (the window that diverged is not trained again)
        # and the counts of skipped steps and rollbacks, which are the run's.
        kept = self.batches.position, self.skipped.total, self.rollbacks + 1, self.step
        self._load_trainer_state(state)
        self.batches.position, self.skipped.total, self.rollbacks, diverged_at = kept
        self.skipped.in_a_row, bar.n = 0, self.step
        if metrics is None:
            return None
        bar.write(f"warning: step {flags.step}: {flags.problem()}: rolled back to {checkpoint} (rollback "
                  f"{self.rollbacks} of max_rollbacks={self.cfg.max_rollbacks}); the batches of steps "
                  f"{self.step + 1}-{diverged_at} are skipped, optim.lr is now {optim.lr:g}", file=sys.stderr)
        save_config(self.cfg, os.path.join(self.run_dir, RUN_CONFIG_FILE))  # a resumed run keeps the new lr
        metrics.close()
        metrics = MetricsLog(metrics.path, self.step)
        metrics.write({"step": self.step, "rollback": self.rollbacks, "diverged_at": flags.step,
                       "problem": flags.problem(), "skipped_data_steps": diverged_at - self.step, "lr": optim.lr,
                       "min_lr": optim.min_lr, "skipped_steps": self.skipped.total})
        return metrics

    def _divergence_advice(self) -> str:
        optim, limit = self.cfg.optim, self.cfg.max_rollbacks
        tried = "" if not limit else (f"{self.rollbacks} rollbacks (max_rollbacks={limit}) did not get past it. "
                                      if latest_checkpoint(self.run_dir) else "No checkpoint to roll back to. ")
        return (f"{tried}Lower optim.lr (it is {optim.lr:g}), raise optim.warmup_steps ({optim.warmup_steps}) or clip "
                f"harder (optim.grad_clip={optim.grad_clip:g}); {self.run.how_to_continue(' optim.lr=...')}")

    def fit(self) -> TrainResult:
        """Train until ``cfg.steps`` (or SIGINT / SIGTERM: checkpoint, then stop); returns the last losses.

        A step whose loss or gradient norm is NaN / inf leaves the weights and the optimizer as they were
        (on every rank); it is logged and counted (``skipped_steps`` in metrics.jsonl). Where more than
        ``max_nonfinite_skips`` in a row would stop the run, up to ``max_rollbacks`` times every rank reloads
        the latest checkpoint instead and trains on from the batches after the ones that diverged.

        Raises:
            NonFiniteLossError: more than ``max_nonfinite_skips`` steps in a row were not finite, and no
                rollback was left (found at the last of them when it is logged, evaluated or checkpointed,
                otherwise one step later).
            fileio.WriteError: the disk refused metrics.jsonl or a checkpoint (full, a file-size limit): the
                previous checkpoint is intact; the message says how to continue.
        """
        cfg, main = self.cfg, self.env.is_main
        metrics = MetricsLog(os.path.join(self.run_dir, METRICS_FILE), self.step) if main else None
        tokens_per_step = cfg.batch_size * cfg.data.seq_len
        flops_per_token = self.model.flops_per_token(cfg.data.seq_len)
        train_loss = eval_loss = None
        stop_signal = 0
        bar = tqdm(total=cfg.steps, initial=self.step, desc="train", unit="step", disable=not main, dynamic_ncols=True)
        # Training time only (evals and checkpoints do not count). Steps are queued without waiting for the
        # GPU, so the clock is read where the host has waited for the queued steps: at a logged loss, and
        # (synchronize) before an eval or a checkpoint.
        interval_seconds, interval_steps, clock = 0.0, 0, time.perf_counter()
        pending = None  # the previous step's flags, not yet read
        try:
            with StopRequests() as stop:
                while self.step < cfg.steps:
                    loss, grad_norm, lr = self.train_step()
                    self.step += 1
                    interval_steps += 1
                    bar.update(1)
                    last = self.step == cfg.steps
                    logging = self.step % cfg.log_every == 0 or self.step == 1 or last
                    evaluating = self.step % cfg.eval_every == 0 or last
                    checkpointing = self.step % cfg.ckpt_every == 0 or last
                    # Every rank reads the same flags at the same step, so all stop after the same one. The
                    # host waits here anyway when it logs, evaluates or checkpoints: read this step's flags
                    # then (a checkpoint is only written after its step proved finite); otherwise the previous
                    # step's, so the GPU keeps working while the host queues the next.
                    current = self._flags(stop, self.step, loss, grad_norm)
                    to_read = [f for f in (pending, current) if f is not None]
                    pending = None
                    if not (logging or evaluating or checkpointing):
                        to_read, pending = to_read[:-1], current
                    skipped = rolled_back = False  # this step's when logging: its flags are read last
                    for flags in to_read:
                        signum, skipped = flags.read()
                        stop_signal = stop_signal or signum
                        try:
                            warning = self.skipped.count(flags, skipped, self._divergence_advice)
                        except NonFiniteLossError:
                            if self.rollbacks >= cfg.max_rollbacks or latest_checkpoint(self.run_dir) is None:
                                raise
                            metrics, rolled_back = self._roll_back(flags, metrics, bar), True
                            break
                        if warning and main:
                            bar.write(warning, file=sys.stderr)
                            metrics.write({"step": flags.step, "skipped": flags.problem(),
                                           "skipped_steps": self.skipped.total})
                    if rolled_back:  # the steps queued since the checkpoint are forgotten, their flags too
                        pending, interval_seconds, interval_steps, clock = None, 0.0, 0, time.perf_counter()
                        continue
                    if logging and not skipped:  # a skipped step's record is its warning
                        train_loss = (all_reduce(loss, self.env) / self.env.world_size).item()
                        now = time.perf_counter()
                        tokens_per_s = interval_steps * tokens_per_step / (interval_seconds + now - clock)
                        record = {"step": self.step, "loss": train_loss, "lr": lr,
                                  "grad_norm": grad_norm.item(), "tokens": self.step * tokens_per_step,
                                  "tokens_per_s": tokens_per_s, "skipped_steps": self.skipped.total}
                        postfix = {"loss": f"{train_loss:.3f}", "tok/s": f"{tokens_per_s:,.0f}"}
                        if self.device.type == "cuda":
                            record["mfu"] = flops_per_token * tokens_per_s / (cfg.peak_flops_per_gpu
                                                                              * self.env.world_size)
                            record["peak_memory_gb"] = torch.cuda.max_memory_allocated(self.device) / 1e9
                            postfix["mfu"] = f"{record['mfu']:.1%}"
                        bar.set_postfix(postfix)
                        if main:
                            metrics.write(record)
                        interval_seconds, interval_steps, clock = 0.0, 0, time.perf_counter()
                    # Amid non-finite steps only the last step or a stop saves: the weights of the step before
                    # them may already be the bad ones, and saving would prune an older, good checkpoint.
                    checkpointing = (checkpointing and (not self.skipped.in_a_row or last)) or bool(stop_signal)
                    if evaluating or checkpointing:
                        if self.device.type == "cuda":
                            torch.cuda.synchronize(self.device)
                        interval_seconds += time.perf_counter() - clock
                    if evaluating:
                        eval_loss = self.evaluate()
                        if main:
                            metrics.write({"step": self.step, "eval_loss": eval_loss})
                            bar.write(f"step {self.step}: eval loss {eval_loss:.4f}")
                    if checkpointing:
                        path = self.save_checkpoint()
                        if stop_signal:
                            bar.write(f"stopped at step {self.step}; checkpoint {path}; "
                                      f"continue with `flashformer train --resume {self.run_dir}`")
                    if evaluating or checkpointing:
                        clock = time.perf_counter()
                    if stop_signal:
                        break
        except WriteError as error:
            when = " once the disk takes writes again (space freed, a limit lifted)"
            raise WriteError(f"{error}. {self.run.how_to_continue(when=when)}, or resume a copy of {self.run_dir} on "
                             "another disk", error.errno) from error
        finally:
            bar.close()
            if main:
                metrics.close()
        if main and not stop_signal:
            plot_losses(self.run_dir)
            self._print_sample()
        return TrainResult(self.step, train_loss, eval_loss, bool(stop_signal), self.run_dir, stop_signal or None)

    def _print_sample(self) -> None:
        """Generate from the final checkpoint, exactly as ``flashformer generate`` would."""
        sample = self.cfg.sample
        if sample.max_new_tokens == 0 or not sample.prompt:
            return
        from ..generate import generate

        model = from_pretrained(latest_checkpoint(self.run_dir), device=self.device,
                                attn_backend=self.cfg.attn_backend)
        prompt = torch.tensor([self.tokenizer.encode(sample.prompt)], device=self.device)
        output = generate(model, prompt, max_new_tokens=sample.max_new_tokens, temperature=sample.temperature,
                          top_k=sample.top_k, top_p=sample.top_p, stop_tokens=[self.tokenizer.eos_id],
                          seed=self.cfg.seed)
        print(f"--- sample (prompt {sample.prompt!r}) ---\n{self.tokenizer.decode(output[0].tolist())}\n---")


def train(cfg: TrainConfig) -> TrainResult:
    """Set up and run ``cfg`` (under torchrun: this process's share), then release the run directory and
    leave the process group."""
    trainer = None
    try:
        trainer = Trainer(cfg)
        result = trainer.fit()
        # Every rank's collectives complete (a gloo barrier waits for all earlier work) before anything that
        # holds the group is freed: a gloo group destroyed with work in flight can block its rank for good.
        barrier(trainer.env)
        return result
    finally:
        if trainer is not None:
            trainer.close()
        # The model (DDP's reducer), optimizer and data go here, on every rank alike and while the group
        # exists, not at whatever point the caller's frame lets go of them.
        trainer = None
        shutdown_distributed()
