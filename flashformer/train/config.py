"""The training recipe: dataclasses, YAML + dotted overrides, and what may change when a run resumes.

    cfg = load_train_config("configs/tiny.yaml", ["optim.lr=3e-4"])
    cfg = load_train_config(overrides=["steps=2000"], resume_dir="runs/tiny")
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field
from typing import Literal

from ..attention import resolve_backend
from ..config import ConfigError, config_to_dict, load_config, read_yaml
from ..data import DataConfig
from ..lora import LoRAConfig
from ..model import ModelConfig
from ..parallel import ParallelConfig

RUN_CONFIG_FILE = "config.yaml"

# What a resumed run may change: lengths, intervals, the optimizer's hyper-parameters, how the same
# computation is run (device, compile, memory savers) and the final sample. Everything else (the model,
# the data, the batch, the seed) shapes the checkpoint or the data order, so changing it on resume would
# train a different run under the old one's name.
RESUMABLE_KEYS = ("steps", "log_every", "eval_every", "eval_batches", "ckpt_every", "keep_checkpoints",
                  "max_nonfinite_skips", "max_rollbacks", "rollback_lr_scale", "optim.", "sample.", "parallel.",
                  "device", "precision", "compile", "activation_checkpointing", "chunked_loss", "peak_flops_per_gpu",
                  "attn_backend", "deterministic", "data.cache_dir")
# Not part of the comparison: where the run lives, and the tokenizer file, which a resumed run always
# takes from its checkpoint (the recorded path may point into a pruned checkpoint).
IGNORED_ON_RESUME = ("name", "out_dir", "resume", "data.tokenizer")


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
    # A step whose loss or gradient norm is NaN / inf changes nothing (no update, on every rank); this many
    # such steps in a row are skipped, the next one stops the run. 0 stops at the first.
    max_nonfinite_skips: int = 5
    # Where max_nonfinite_skips would stop the run, reload the latest checkpoint instead (weights, optimizer,
    # schedule, RNG) and train on from the batches after the ones that diverged, at most this many times;
    # then stop. Off by default: the rolled-back run trains on another data order than the recipe's (it is
    # no longer the run the recipe names), and repeated rollbacks can hide an lr that is too high.
    max_rollbacks: int = 0
    rollback_lr_scale: float = 1.0  # each rollback multiplies optim.lr and optim.min_lr by this
    resume: bool = False  # continue from the latest checkpoint in out_dir (fresh start if there is none)
    # fine-tune: our checkpoint / run directory, a Hugging Face directory, or a hub id ("org/name", from the
    # Hugging Face cache; downloaded unless HF_HUB_OFFLINE=1) at init_revision (branch, tag or commit)
    init_from: str | None = None
    init_revision: str | None = None
    freeze: list[str] = field(default_factory=list)  # fnmatch patterns of parameter names to keep fixed
    device: Literal["auto", "cpu", "cuda"] = "auto"
    precision: Literal["auto", "fp32", "bf16"] = "auto"  # auto: bf16 autocast on CUDA, fp32 elsewhere
    compile: bool = False
    # Recompute each block in backward; "offload" also keeps the block inputs in host memory until then.
    activation_checkpointing: bool | Literal["offload"] = False
    # LM head + cross-entropy in chunks, never holding (tokens x vocab) logits: costs one more LM-head
    # matmul, saves tens of GB at long context. None: chunk when data.seq_len >= CHUNKED_LOSS_MIN_SEQ_LEN.
    chunked_loss: bool | None = None
    peak_flops_per_gpu: float = 780e12  # for MFU; H200 dense bf16
    attn_backend: str = "auto"  # one of attention.ATTN_BACKENDS; a runtime choice, not saved with the weights
    # False: flash's faster backward that adds dQ in arrival order (gradients vary in the last bits)
    deterministic: bool = True
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    sample: SampleConfig = field(default_factory=SampleConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)  # off unless lora.rank > 0

    def validate(self) -> None:
        for name in ("steps", "batch_size", "micro_batch_size", "log_every", "eval_every", "eval_batches",
                     "ckpt_every", "keep_checkpoints"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_nonfinite_skips < 0:
            raise ConfigError(f"max_nonfinite_skips must be >= 0 (0 stops at the first non-finite step), "
                              f"got {self.max_nonfinite_skips}")
        if self.max_rollbacks < 0 or not 0 < self.rollback_lr_scale <= 1:
            raise ConfigError(f"need max_rollbacks >= 0 and 0 < rollback_lr_scale <= 1, got max_rollbacks="
                              f"{self.max_rollbacks}, rollback_lr_scale={self.rollback_lr_scale}")
        if self.batch_size % self.micro_batch_size:
            raise ConfigError(f"batch_size ({self.batch_size}) must be a multiple of "
                              f"micro_batch_size ({self.micro_batch_size})")
        if self.init_from is None and self.data.seq_len > self.model.max_seq_len:
            raise ConfigError(f"data.seq_len ({self.data.seq_len}) exceeds "
                              f"model.max_seq_len ({self.model.max_seq_len})")
        if not self.peak_flops_per_gpu > 0:
            raise ConfigError(f"peak_flops_per_gpu must be > 0, got {self.peak_flops_per_gpu}")
        try:
            resolve_backend(self.attn_backend)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        if self.parallel.context_parallel > 1:
            self._validate_context_parallel()
        if self.lora.enabled:
            if self.init_from is None:
                raise ConfigError("lora.rank > 0 adapts a trained model: set init_from to a checkpoint, a run "
                                  "directory or a Hugging Face directory")
            if self.freeze:
                raise ConfigError("freeze cannot be combined with lora.rank > 0: LoRA freezes everything but the "
                                  "adapters (lora.train_norms trains the norms too)")
            if self.lora.base_dtype == "bf16" and self.precision == "fp32":
                raise ConfigError("lora.base_dtype=bf16 needs bf16 autocast: set precision=bf16 (or auto on CUDA)")

    def _validate_context_parallel(self) -> None:
        """What the ring attention of parallel.context_parallel > 1 cannot do (the model's own attention,
        windows and softcaps, is checked once the model is built: init_from may bring it)."""
        ranks = self.parallel.context_parallel
        if self.data.seq_len % (2 * ranks):
            raise ConfigError(f"parallel.context_parallel={ranks} cuts every row into 2 x {ranks} chunks (zigzag): "
                              f"data.seq_len={self.data.seq_len} must be divisible by {2 * ranks}")
        if resolve_backend(self.attn_backend) != "flash":
            raise ConfigError(f"parallel.context_parallel={ranks} runs attention through the ring's flash kernels: "
                              f"attn_backend={self.attn_backend!r} is not used by it; set attn_backend=flash (or auto)")

    @property
    def run_dir(self) -> str:
        return self.out_dir or os.path.join("runs", self.name)


def load_train_config(source=None, overrides=(), resume_dir: str | None = None) -> TrainConfig:
    """The resolved TrainConfig of a YAML file (or dict) plus ``key=value`` overrides.

    Args:
        source: YAML path or dict; ignored when resume_dir is given.
        overrides: dotted ``a.b=value`` strings.
        resume_dir: a run directory to continue: its saved config.yaml, resume=true, out_dir=resume_dir.
    Raises:
        ConfigError: unknown keys (naming the closest valid one), wrong types, invalid values; with
            resume_dir, an override of a key that a resumed run cannot change.
    """
    if resume_dir is not None:
        path = os.path.join(resume_dir, RUN_CONFIG_FILE)
        if not os.path.isfile(path):
            raise ConfigError(f"--resume {resume_dir}: no {RUN_CONFIG_FILE} there (not a run directory)")
        source = read_yaml(path)
        if not isinstance(source, dict):
            raise ConfigError(f"--resume {resume_dir}: {path} does not hold a run's config (a mapping)")
        source.update(resume=True, out_dir=resume_dir)
        source, overrides = _attn_backend_at_top_level(source, overrides)
        saved = config_to_dict(load_config(TrainConfig, source))
        requested = load_config(TrainConfig, source, overrides)
        changes = resume_changes(saved, config_to_dict(requested))
        if changes:
            raise ConfigError(resume_refusal(changes, resume_dir))
        return requested
    elif isinstance(source, (str, os.PathLike)):
        source, overrides = _read_recipe(source, overrides)
    source, overrides = _attn_backend_at_top_level(source, overrides)
    return load_config(TrainConfig, source, overrides)


def _attn_backend_at_top_level(source: dict, overrides):
    """(source, overrides) with ``model.attn_backend``, where recipes and run configs written while it
    was a model field put it, moved to the top-level ``attn_backend``."""
    model = source.get("model") if isinstance(source, dict) else None
    if isinstance(model, dict) and "attn_backend" in model:
        model = dict(model)
        source = {"attn_backend": model.pop("attn_backend"), **source, "model": model}
    legacy = "model.attn_backend="
    overrides = [o.strip().replace(legacy, "attn_backend=", 1) if isinstance(o, str) and o.strip().startswith(legacy)
                 else o
                 for o in overrides]
    return source, overrides


def _read_recipe(path, overrides) -> tuple[dict, list]:
    """(recipe, the other overrides): the recipe YAML as a dict. A string ``model:`` names a model YAML
    (relative to the recipe's directory, e.g. ``models/gpt2-124m.yaml``) whose fields are inlined, so
    overrides still reach them; so does a ``model=FILE`` override (relative to the working directory or
    to the recipe's), which replaces the recipe's model."""
    if os.path.isdir(path):
        raise ConfigError(f"{path} is a directory, not a recipe file (to continue a run there: --resume {path})")
    if not os.path.isfile(path):
        raise ConfigError(f"{path}: no such recipe file")
    raw = read_yaml(path)
    if raw is None:
        raise ConfigError(f"{path} is empty: a recipe sets at least the run's model and data (start from "
                          f"configs/tiny.yaml)")
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping")
    recipe_dir = os.path.dirname(os.fspath(path))
    rest = []
    for override in overrides:
        key, _, value = override.partition("=") if isinstance(override, str) else ("", "", "")
        if key.strip() == "model" and value.strip():
            candidates = [value.strip(), os.path.join(recipe_dir, value.strip())]
            found = next((c for c in candidates if os.path.isfile(c)), None)
            if found is None:
                raise ConfigError(f"override model={value.strip()}: not a model file (looked for "
                                  f"{' and '.join(candidates)})")
            raw["model"] = read_yaml(found)
        else:
            rest.append(override)
    if isinstance(raw.get("model"), str):
        model_path = os.path.join(recipe_dir, raw["model"])
        if not os.path.isfile(model_path):
            raise ConfigError(f"{path}: model: {raw['model']!r} is not a file (looked for {model_path})")
        raw["model"] = read_yaml(model_path)
    return raw, rest


def _matches(key: str, prefixes) -> bool:
    return any(key == p or (p.endswith(".") and key.startswith(p)) or key.startswith(p + ".") for p in prefixes)


def _resumable(key: str) -> bool:
    return _matches(key, RESUMABLE_KEYS)


def _ignored(key: str) -> bool:
    return _matches(key, IGNORED_ON_RESUME)


def _flatten(value: dict, prefix: str = "") -> dict:
    """{"a": {"b": 1}} -> {"a.b": 1}."""
    flat = {}
    for key, item in value.items():
        if isinstance(item, dict) and item:
            flat.update(_flatten(item, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = item
    return flat


def saved_run_config(saved: dict) -> dict:
    """A checkpoint's recorded config as today's TrainConfig reads it: keys added since it was written take
    their defaults and moved keys their new place, so a run from an earlier version resumes."""
    source, _ = _attn_backend_at_top_level(copy.deepcopy(saved), [])
    return config_to_dict(load_config(TrainConfig, source))


def resume_changes(saved: dict, requested: dict, compare_model: bool = True) -> list[tuple[str, object, object]]:
    """The (key, saved value, requested value) a resumed run cannot apply: differences outside RESUMABLE_KEYS.

    Args:
        saved: the config a checkpoint was written under (``config_to_dict``).
        requested: the config asked for now.
        compare_model: False for a run whose model comes from ``init_from``: its recipe's model section
            was never used, the checkpoint's model is.
    """
    old, new = _flatten(saved), _flatten(requested)
    changes = []
    for key in sorted(set(old) | set(new)):
        if _resumable(key) or _ignored(key) or (not compare_model and key.startswith("model.")):
            continue
        if old.get(key) != new.get(key):
            changes.append((key, old.get(key), new.get(key)))
    return changes


def resume_refusal(changes, run_dir: str) -> str:
    """The message for keys a resumed run cannot change: which, and what to do instead."""
    shown = ", ".join(f"{key} (was {old!r}, asked {new!r})" for key, old, new in changes)
    return (f"resuming {run_dir}: {shown} cannot change when a run resumes (they shape the checkpoint or the data "
            f"order). Start a new run that fine-tunes from it instead: `flashformer train RECIPE.yaml "
            f"init_from={run_dir} name=...`. On resume you may change: {', '.join(k.rstrip('.') for k in RESUMABLE_KEYS)}")
