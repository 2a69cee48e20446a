"""The training loop behind ``flashformer train CONFIG.yaml key=value ...``.

    cfg = load_train_config("configs/tiny.yaml", ["optim.lr=3e-4"])
    result = train(cfg)                       # or: Trainer(cfg).fit()

A run directory (``out_dir``, default ``runs/<name>``) holds the resolved ``config.yaml``,
``metrics.jsonl`` (one JSON record per logged step / eval), ``loss.png`` and checkpoints
``ckpt-<step>/``: the weights as ``save_pretrained`` writes them (loadable by ``from_pretrained``
and ``flashformer generate``) plus ``trainer_state.pt`` (optimizer, scheduler, RNG states, data
position, step, config). Resuming from one reproduces the uninterrupted run exactly on CPU.
"""

from __future__ import annotations

import fnmatch
import json
import math
import os
import random
import re
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
import yaml
from tqdm.auto import tqdm

from .checkpoint import atomic_directory, from_pretrained, write_pretrained_files
from .config import ConfigError, config_to_dict, load_config, save_config
from .data import DataConfig, TrainBatches, corpus_cache_dir, eval_batches, load_corpus
from .losses import default_chunk_size
from .model import ModelConfig, Transformer
from .parallel import (
    ParallelConfig,
    all_reduce,
    barrier,
    clip_grad_norm,
    full_state_dicts,
    gradient_sync,
    init_distributed,
    load_optimizer_state_dict,
    parallelize,
    shutdown_distributed,
)
from .tokenizer import TOKENIZER_FILE, load_tokenizer

TRAINER_STATE_FILE = "trainer_state.pt"
METRICS_FILE = "metrics.jsonl"
_CHECKPOINT_NAME = re.compile(r"^ckpt-(\d+)$")
CHUNKED_LOSS_MIN_SEQ_LEN = 8192  # chunked_loss=None chunks from here: the logits outgrow the activations
INTERRUPTED_EXIT_CODE = 130  # the shell's code for a process ended by Ctrl-C


@dataclass
class OptimConfig:
    """AdamW with linear warmup then cosine decay from ``lr`` to ``min_lr`` at the last step."""

    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 100
    weight_decay: float = 0.1  # only on >= 2-D parameters (matrices, embeddings)
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping

    def validate(self) -> None:
        if not self.lr > 0 or not 0 <= self.min_lr <= self.lr:
            raise ConfigError(f"optim: need lr > 0 and 0 <= min_lr <= lr, got lr={self.lr}, min_lr={self.min_lr}")
        if self.warmup_steps < 0 or self.weight_decay < 0 or self.grad_clip < 0 or not self.eps > 0:
            raise ConfigError("optim: warmup_steps, weight_decay and grad_clip must be >= 0, eps > 0")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ConfigError(f"optim: betas must be in [0, 1), got {self.beta1}, {self.beta2}")


@dataclass
class SampleConfig:
    """The short sample printed at the end of training (max_new_tokens 0 skips it)."""

    prompt: str = "def "
    max_new_tokens: int = 200
    temperature: float = 0.8
    top_k: int | None = 40
    top_p: float | None = None


@dataclass
class TrainConfig:
    """A training run. ``batch_size`` counts sequences per optimizer step over all ranks;
    gradient accumulation makes up the difference to ``micro_batch_size`` x ranks."""

    name: str = "run"
    out_dir: str | None = None  # default runs/<name>
    seed: int = 0
    steps: int = 1000
    batch_size: int = 32
    micro_batch_size: int = 8
    log_every: int = 10
    eval_every: int = 200
    eval_batches: int = 8  # held-out rows per evaluation: eval_batches x batch_size
    ckpt_every: int = 500
    keep_checkpoints: int = 2
    resume: bool = False  # continue from the latest checkpoint in out_dir (fresh start if there is none)
    init_from: str | None = None  # fine-tune: our checkpoint / run directory or a Hugging Face directory
    freeze: list[str] = field(default_factory=list)  # fnmatch patterns of parameter names to keep fixed
    device: Literal["auto", "cpu", "cuda"] = "auto"
    precision: Literal["auto", "fp32", "bf16"] = "auto"  # auto: bf16 autocast on CUDA, fp32 elsewhere
    compile: bool = False
    activation_checkpointing: bool = False
    # LM head + cross-entropy in chunks, never holding (tokens x vocab) logits: costs one more LM-head
    # matmul, saves tens of GB at long context. None: chunk when data.seq_len >= CHUNKED_LOSS_MIN_SEQ_LEN.
    chunked_loss: bool | None = None
    peak_flops_per_gpu: float = 780e12  # for MFU; H200 dense bf16
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    sample: SampleConfig = field(default_factory=SampleConfig)

    def validate(self) -> None:
        for name in ("steps", "batch_size", "micro_batch_size", "log_every", "eval_every", "eval_batches",
                     "ckpt_every", "keep_checkpoints"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.batch_size % self.micro_batch_size:
            raise ConfigError(f"batch_size ({self.batch_size}) must be a multiple of "
                              f"micro_batch_size ({self.micro_batch_size})")
        if self.init_from is None and self.data.seq_len > self.model.max_seq_len:
            raise ConfigError(f"data.seq_len ({self.data.seq_len}) exceeds "
                              f"model.max_seq_len ({self.model.max_seq_len})")
        if not self.peak_flops_per_gpu > 0:
            raise ConfigError(f"peak_flops_per_gpu must be > 0, got {self.peak_flops_per_gpu}")

    @property
    def run_dir(self) -> str:
        return self.out_dir or os.path.join("runs", self.name)


@dataclass
class TrainResult:
    """What a run ended with; losses are None where none was computed."""

    step: int
    train_loss: float | None
    eval_loss: float | None
    interrupted: bool
    run_dir: str


def load_train_config(source=None, overrides=(), resume_dir: str | None = None) -> TrainConfig:
    """The resolved TrainConfig of a YAML file (or dict) plus ``key=value`` overrides.

    Args:
        source: YAML path or dict; ignored when resume_dir is given.
        overrides: dotted ``a.b=value`` strings.
        resume_dir: a run directory to continue: its saved config.yaml, resume=true, out_dir=resume_dir.
    Raises:
        ConfigError: unknown keys (naming the closest valid one), wrong types, invalid values.
    """
    if resume_dir is not None:
        path = os.path.join(resume_dir, "config.yaml")
        if not os.path.isfile(path):
            raise ConfigError(f"--resume {resume_dir}: no config.yaml there (not a run directory)")
        with open(path, encoding="utf-8") as f:
            source = yaml.safe_load(f)
        source.update(resume=True, out_dir=resume_dir)
    elif isinstance(source, (str, os.PathLike)):
        source = _read_recipe(source)
    return load_config(TrainConfig, source, overrides)


def _read_recipe(path) -> dict:
    """A recipe YAML as a dict. A string ``model:`` names a model YAML (relative to the recipe's
    directory, e.g. ``models/gpt2-124m.yaml``) whose fields are inlined, so overrides still reach them."""
    with open(path, encoding="utf-8") as f:
        raw = yaml.safe_load(f) or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping")
    if isinstance(raw.get("model"), str):
        model_path = os.path.join(os.path.dirname(os.fspath(path)), raw["model"])
        if not os.path.isfile(model_path):
            raise ConfigError(f"{path}: model: {raw['model']!r} is not a file (looked for {model_path})")
        with open(model_path, encoding="utf-8") as f:
            raw["model"] = yaml.safe_load(f)
    return raw


def latest_checkpoint(run_dir: str) -> str | None:
    """The complete ``ckpt-<step>`` directory of ``run_dir`` with the highest step, or None.

    Checkpoints are moved into place only once complete, so a half-written one is never returned.
    """
    steps = sorted(_checkpoint_steps(run_dir))
    return os.path.join(run_dir, f"ckpt-{steps[-1]}") if steps else None


def _checkpoint_steps(run_dir: str) -> list[int]:
    if not os.path.isdir(run_dir):
        return []
    return [int(m.group(1)) for m in map(_CHECKPOINT_NAME.match, os.listdir(run_dir)) if m]


def _abridged(value, keep: int = 3):
    """A config dict for the console: lists longer than 2 x ``keep`` cut to their first ``keep`` entries
    (finetune-long's file lists run to hundreds of paths; the run directory's config.yaml keeps them all)."""
    if isinstance(value, dict):
        return {k: _abridged(v, keep) for k, v in value.items()}
    if isinstance(value, list) and len(value) > 2 * keep:
        return value[:keep] + [f"... {len(value) - keep} more (see config.yaml in the run directory)"]
    return value


def lr_factor(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Multiplier of ``cfg.lr`` for optimizer step ``step`` (0-based): linear warmup, cosine to min_lr."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
    min_factor = cfg.min_lr / cfg.lr
    return min_factor + (1 - min_factor) * 0.5 * (1 + math.cos(math.pi * progress))


def _capture_rng() -> dict:
    numpy_state = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "python": random.getstate(),
        # As a tensor and plain numbers, so that torch.load(weights_only=True) accepts it.
        "numpy": {"key": torch.from_numpy(numpy_state[1].astype(np.int64)), "rest": list(numpy_state[2:])},
    }


def _restore_rng(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"]:
        torch.cuda.set_rng_state_all(state["cuda"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    np.random.set_state(("MT19937", state["numpy"]["key"].numpy().astype(np.uint32), *state["numpy"]["rest"]))


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class _StopRequests:
    """Turns SIGINT / SIGTERM into a flag the loop checks between steps; a second Ctrl-C aborts at once."""

    def __init__(self):
        self.requested = False
        self._previous = {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True
        tqdm.write(f"{signal.Signals(signum).name}: saving a checkpoint after this step (with several "
                   "processes, the next), then exiting (Ctrl-C again aborts)", file=sys.stderr)

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class _MetricsLog:
    """Appends JSON records to ``metrics.jsonl``; a resumed run first drops the records after its checkpoint."""

    def __init__(self, path: str, keep_through_step: int):
        records = []
        if keep_through_step > 0 and os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                for line in f:
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError:  # a line cut short by a kill
                        continue
                    if record["step"] <= keep_through_step:
                        records.append(record)
        self.path = path
        self.file = open(path, "w", encoding="utf-8")
        for record in records:
            self.write(record)

    def write(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def read_metrics(run_dir: str) -> list[dict]:
    """The records of a run's metrics.jsonl, in order."""
    with open(os.path.join(run_dir, METRICS_FILE), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_losses(run_dir: str) -> str | None:
    """Draw ``loss.png`` (train and eval loss against step) from metrics.jsonl; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no loss.png (pip install matplotlib)")
        return None
    records = read_metrics(run_dir)
    fig, ax = plt.subplots(figsize=(7, 4))
    for key, label in (("loss", "train"), ("eval_loss", "eval")):
        points = [(r["step"], r[key]) for r in records if key in r]
        if points:
            ax.plot(*zip(*points), label=label, marker="o" if key == "eval_loss" else None)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / token)")
    ax.grid(alpha=0.3)
    ax.legend()
    path = os.path.join(run_dir, "loss.png")
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device=cuda but no CUDA device is available")
    return torch.device(name)


class Trainer:
    """Sets a run up (every check before any step), then ``fit()`` trains it.

    Args:
        cfg: the resolved training config.
    Raises:
        ConfigError / DataError / CheckpointError: bad config values, data paths, out_dir or init_from.
    """

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.run_dir = cfg.run_dir
        self.env = init_distributed(cfg.parallel, _resolve_device(cfg.device))
        self.device = self.env.device
        self.bf16 = cfg.precision == "bf16" or (cfg.precision == "auto" and self.device.type == "cuda")
        self.resume_from = self._check_run_dir()
        self.weights_from = self.resume_from or self._init_checkpoint()
        if cfg.data.tokenizer is None and self.weights_from is not None:
            # Fine-tuning a model that came with its own tokenizer: keep using it.
            candidate = os.path.join(self.weights_from, TOKENIZER_FILE)
            if os.path.isfile(candidate):
                cfg.data.tokenizer = candidate
        if cfg.data.tokenizer is not None and not os.path.exists(cfg.data.tokenizer):
            raise ConfigError(f"data.tokenizer: {cfg.data.tokenizer!r} does not exist")
        self.tokenizer = load_tokenizer(cfg.data.tokenizer)
        corpus_cache_dir(cfg.data)  # raises now, before any model is built, if a data file is missing
        _seed_everything(cfg.seed)
        self.model = self._build_model()
        train_corpus, eval_corpus = self._load_data()
        self.batches = TrainBatches(train_corpus, cfg.data, cfg.batch_size, cfg.micro_batch_size, cfg.seed,
                                    self.env.rank, self.env.world_size)
        self.eval_set = eval_batches(eval_corpus, cfg.data, cfg.eval_batches * cfg.batch_size, cfg.micro_batch_size,
                                     self.env.rank, self.env.world_size)
        self.wrapped = parallelize(self.model, cfg.parallel, self.env, cfg.activation_checkpointing, cfg.compile)
        self.optimizer = self._build_optimizer()
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: lr_factor(step, cfg.optim, cfg.steps))
        chunked = cfg.chunked_loss if cfg.chunked_loss is not None else cfg.data.seq_len >= CHUNKED_LOSS_MIN_SEQ_LEN
        self.loss_chunk_size = default_chunk_size(self.model.config.vocab_size) if chunked else None
        self.step = 0
        if self.resume_from is not None:
            self._load_trainer_state(self.resume_from)
        if self.env.is_main:
            save_config(cfg, os.path.join(self.run_dir, "config.yaml"))
            self._print_summary(train_corpus, eval_corpus)

    # ----- setup -----

    def _check_run_dir(self) -> str | None:
        """Make sure out_dir is writable and decide where to resume from."""
        try:
            os.makedirs(self.run_dir, exist_ok=True)
            with tempfile.TemporaryFile(dir=self.run_dir):
                pass
        except OSError as error:
            raise ConfigError(f"out_dir {self.run_dir!r} is not writable: {error.strerror or error}") from None
        latest = latest_checkpoint(self.run_dir)
        if latest is not None and not self.cfg.resume:
            raise ConfigError(
                f"{self.run_dir} already holds checkpoints ({os.path.basename(latest)}): continue with "
                f"`flashformer train --resume {self.run_dir}` (or resume=true), or choose another out_dir=/name=")
        if self.cfg.resume and latest is None and self.env.is_main:
            print(f"resume: no checkpoint in {self.run_dir} yet, starting from scratch")
        return latest if self.cfg.resume else None

    def _init_checkpoint(self) -> str | None:
        """The directory ``init_from`` names: a checkpoint, or a run directory's latest checkpoint."""
        if self.cfg.init_from is None:
            return None
        if not os.path.isdir(self.cfg.init_from):
            raise ConfigError(f"init_from: {self.cfg.init_from!r} is not a directory")
        return latest_checkpoint(self.cfg.init_from) or self.cfg.init_from

    def _build_model(self) -> Transformer:
        cfg = self.cfg
        if self.weights_from is not None:
            model = from_pretrained(self.weights_from, device=self.device, attn_backend=cfg.model.attn_backend)
            cfg.model = model.config
            if cfg.data.seq_len > cfg.model.max_seq_len:
                raise ConfigError(f"data.seq_len ({cfg.data.seq_len}) exceeds the model's "
                                  f"max_seq_len ({cfg.model.max_seq_len})")
        else:
            model = Transformer(cfg.model).to(self.device)
        if self.tokenizer.vocab_size > cfg.model.vocab_size:
            raise ConfigError(f"the tokenizer has {self.tokenizer.vocab_size} tokens "
                              f"but model.vocab_size is {cfg.model.vocab_size}")
        self._freeze(model)
        return model

    def _freeze(self, model: Transformer) -> None:
        names = [name for name, _ in model.named_parameters()]
        for pattern in self.cfg.freeze:
            if not fnmatch.filter(names, pattern):
                raise ConfigError(f"freeze pattern {pattern!r} matches no parameter; names look like {names[:3]}")
        for name, param in model.named_parameters():
            if any(fnmatch.fnmatchcase(name, pattern) for pattern in self.cfg.freeze):
                param.requires_grad_(False)
        if not any(p.requires_grad for p in model.parameters()):
            raise ConfigError("freeze: every parameter is frozen, nothing would train")

    def _load_data(self):
        # The main process tokenizes (once, cached); the others wait, then map the same files.
        corpora = load_corpus(self.cfg.data, self.tokenizer) if self.env.is_main else None
        barrier(self.env)
        return corpora or load_corpus(self.cfg.data, self.tokenizer, build=False)

    def _build_optimizer(self) -> torch.optim.AdamW:
        o = self.cfg.optim
        trainable = [p for p in self.wrapped.parameters() if p.requires_grad]
        groups = [{"params": [p for p in trainable if p.dim() >= 2], "weight_decay": o.weight_decay},
                  {"params": [p for p in trainable if p.dim() < 2], "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                                 fused=self.device.type == "cuda")

    def _print_summary(self, train_corpus, eval_corpus) -> None:
        cfg = self.cfg
        print(yaml.safe_dump(_abridged(config_to_dict(cfg)), sort_keys=False).rstrip())
        tokens_per_step = cfg.batch_size * cfg.data.seq_len
        print(f"model: {self.model.num_params() / 1e6:.2f}M parameters | device: {self.device} x {self.env.world_size} "
              f"| precision: {'bf16 autocast' if self.bf16 else 'fp32'}")
        print(f"data: {train_corpus.num_tokens:,} train tokens ({train_corpus.num_docs} docs), "
              f"{eval_corpus.num_tokens:,} eval tokens | {tokens_per_step:,} tokens/step, "
              f"grad accumulation {self.batches.grad_accum_steps}")
        if self.resume_from:
            print(f"resuming from {self.resume_from} (step {self.step})")
        print(f"run directory: {self.run_dir}")

    # ----- steps -----

    def _loss(self, batch) -> torch.Tensor:
        batch = batch.to(self.device)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            if self.loss_chunk_size:
                return self.wrapped(batch.input_ids, targets=batch.targets, loss_chunk_size=self.loss_chunk_size,
                                    **batch.model_kwargs())
            logits = self.wrapped(batch.input_ids, **batch.model_kwargs())
        return F.cross_entropy(logits.float().flatten(0, 1), batch.targets.flatten())

    def train_step(self) -> tuple[torch.Tensor, torch.Tensor, float]:
        """Queue one optimizer step; returns (mean loss over this rank's micro batches, grad norm, lr used),
        the first two as device tensors: nothing here waits for the GPU."""
        micro_batches = self.batches.next_step()
        loss_sum = torch.zeros((), device=self.device)
        for index, batch in enumerate(micro_batches):
            with gradient_sync(self.wrapped, enabled=index == len(micro_batches) - 1):
                loss = self._loss(batch)
                (loss / len(micro_batches)).backward()
            loss_sum += loss.detach()
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        grad_norm = clip_grad_norm(params, self.cfg.optim.grad_clip or math.inf)
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss_sum / len(micro_batches), grad_norm, lr

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss over the fixed held-out rows of all ranks."""
        self.wrapped.eval()
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)
        for batch in self.eval_set:
            totals[0] += self._loss(batch).double() * len(batch.input_ids)
            totals[1] += len(batch.input_ids)
        self.wrapped.train()
        totals = all_reduce(totals, self.env)
        return (totals[0] / totals[1]).item()

    # ----- checkpoints -----

    def save_checkpoint(self) -> str:
        """Write ``ckpt-<step>`` atomically (all ranks call it) and drop all but the newest keep_checkpoints."""
        model_state, optimizer_state = full_state_dicts(self.wrapped, self.optimizer)
        path = os.path.join(self.run_dir, f"ckpt-{self.step}")
        if self.env.is_main:
            state = {
                "step": self.step,
                "data_position": self.batches.position,
                "optimizer": optimizer_state,
                "scheduler": self.scheduler.state_dict(),
                "rng": _capture_rng(),
                "config": config_to_dict(self.cfg),
            }
            with atomic_directory(path) as tmp:
                write_pretrained_files(self._full_model(model_state), tmp, tokenizer=self.tokenizer)
                torch.save(state, os.path.join(tmp, TRAINER_STATE_FILE))
            for old in sorted(_checkpoint_steps(self.run_dir))[: -self.cfg.keep_checkpoints]:
                shutil.rmtree(os.path.join(self.run_dir, f"ckpt-{old}"), ignore_errors=True)
        barrier(self.env)
        return path

    def _full_model(self, model_state: dict) -> Transformer:
        """The unsharded model: the model itself, or under FSDP a CPU copy built from the gathered weights."""
        if self.cfg.parallel.mode != "fsdp" or not self.env.distributed:
            return self.model
        with torch.device("meta"):
            copy = Transformer(self.cfg.model)
        copy.load_state_dict(model_state, assign=True)
        return copy

    def _load_trainer_state(self, path: str) -> None:
        state = torch.load(os.path.join(path, TRAINER_STATE_FILE), map_location="cpu", weights_only=True)
        load_optimizer_state_dict(self.wrapped, self.optimizer, state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = state["step"]
        self.batches.position = state["data_position"]
        _restore_rng(state["rng"])

    # ----- the loop -----

    def fit(self) -> TrainResult:
        """Train until ``cfg.steps`` (or SIGINT / SIGTERM: checkpoint, then stop); returns the last losses."""
        cfg, main = self.cfg, self.env.is_main
        metrics = _MetricsLog(os.path.join(self.run_dir, METRICS_FILE), self.step) if main else None
        tokens_per_step = cfg.batch_size * cfg.data.seq_len
        flops_per_token = self.model.flops_per_token(cfg.data.seq_len)
        train_loss = eval_loss = None
        interrupted = False
        bar = tqdm(total=cfg.steps, initial=self.step, desc="train", unit="step", disable=not main, dynamic_ncols=True)
        # Training time only (evals and checkpoints do not count). Steps are queued without waiting for the
        # GPU, so the clock is read where the host has waited for the queued steps: at a logged loss, and
        # (synchronize) before an eval or a checkpoint.
        interval_seconds, interval_steps, clock = 0.0, 0, time.perf_counter()
        pending_stop = None
        with _StopRequests() as stop:
            while self.step < cfg.steps:
                loss, grad_norm, lr = self.train_step()
                self.step += 1
                interval_steps += 1
                bar.update(1)
                last = self.step == cfg.steps
                if self.step % cfg.log_every == 0 or self.step == 1 or last:
                    train_loss = (all_reduce(loss, self.env) / self.env.world_size).item()
                    now = time.perf_counter()
                    tokens_per_s = interval_steps * tokens_per_step / (interval_seconds + now - clock)
                    record = {"step": self.step, "loss": train_loss, "lr": lr,
                              "grad_norm": grad_norm.item(), "tokens": self.step * tokens_per_step,
                              "tokens_per_s": tokens_per_s}
                    postfix = {"loss": f"{train_loss:.3f}", "tok/s": f"{tokens_per_s:,.0f}"}
                    if self.device.type == "cuda":
                        record["mfu"] = flops_per_token * tokens_per_s / (cfg.peak_flops_per_gpu * self.env.world_size)
                        record["peak_memory_gb"] = torch.cuda.max_memory_allocated(self.device) / 1e9  # this rank's
                        postfix["mfu"] = f"{record['mfu']:.1%}"
                    bar.set_postfix(postfix)
                    if main:
                        metrics.write(record)
                    interval_seconds, interval_steps, clock = 0.0, 0, time.perf_counter()
                # Every rank stops after the same step. Across processes the requests are reduced each step
                # and read one step later, so that reading them waits for the previous step, not the one
                # just queued: the GPU keeps working while the host queues the next.
                if self.env.distributed:
                    stop_now = pending_stop is not None and bool(pending_stop)
                    pending_stop = all_reduce(torch.tensor(float(stop.requested), device=self.device), self.env,
                                              op=dist.ReduceOp.MAX)
                else:
                    stop_now = stop.requested
                evaluating = self.step % cfg.eval_every == 0 or last
                checkpointing = self.step % cfg.ckpt_every == 0 or last or stop_now
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
                    if stop_now:
                        bar.write(f"stopped at step {self.step}; checkpoint {path}; "
                                  f"continue with `flashformer train --resume {self.run_dir}`")
                if evaluating or checkpointing:
                    clock = time.perf_counter()
                if stop_now:
                    interrupted = True
                    break
        bar.close()
        if main:
            metrics.close()
            if not interrupted:
                plot_losses(self.run_dir)
                self._print_sample()
        return TrainResult(self.step, train_loss, eval_loss, interrupted, self.run_dir)

    def _print_sample(self) -> None:
        """Generate from the final checkpoint, exactly as ``flashformer generate`` would."""
        sample = self.cfg.sample
        if sample.max_new_tokens == 0 or not sample.prompt:
            return
        from .generate import generate

        model = from_pretrained(latest_checkpoint(self.run_dir), device=self.device,
                                attn_backend=self.cfg.model.attn_backend)
        prompt = torch.tensor([self.tokenizer.encode(sample.prompt)], device=self.device)
        output = generate(model, prompt, max_new_tokens=sample.max_new_tokens, temperature=sample.temperature,
                          top_k=sample.top_k, top_p=sample.top_p, stop_tokens=[self.tokenizer.eos_id],
                          seed=self.cfg.seed)
        print(f"--- sample (prompt {sample.prompt!r}) ---\n{self.tokenizer.decode(output[0].tolist())}\n---")


def train(cfg: TrainConfig) -> TrainResult:
    """Set up and run ``cfg`` (under torchrun: this process's share), then leave the process group."""
    try:
        return Trainer(cfg).fit()
    finally:
        shutdown_distributed()
