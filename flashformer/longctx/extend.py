"""Context extension's model side: RoPE rescaled to a longer context, and the fine-tuning recipe.

    config = extended_model_config(model.config, target_len=1024, scaling="yarn")
    cfg = long_context_train_config("runs/tiny", config, "yarn", None, steps=200, lr=None, warmup_steps=None)
"""

from __future__ import annotations

import dataclasses
import os

import torch

from ..weights import CheckpointError, save_pretrained
from ..config import ConfigError, config_to_dict, read_yaml
from ..model import ModelConfig, Transformer
from ..train import TRAINER_STATE_FILE, TrainConfig, latest_checkpoint, load_train_config

SCALINGS = ("linear", "dynamic", "yarn", "llama3", "ntk")
# Llama 3.1's published band edges: wavelengths above L / 1 are interpolated, below L / 4 kept.
LLAMA3_LOW_FREQ_FACTOR, LLAMA3_HIGH_FREQ_FACTOR = 1.0, 4.0
EXTENDED_INIT_DIR = "extended-init"  # the scaled, not yet fine-tuned checkpoint in the run directory


def extended_model_config(config: ModelConfig, target_len: int, scaling: str) -> ModelConfig:
    """``config`` with RoPE rescaled from its context ``max_seq_len`` (L) to ``target_len``.

    ``factor = target_len / L``. linear / yarn / llama3 become Hugging Face ``rope_scaling`` dicts
    (yarn and llama3 with ``original_max_position_embeddings = L``); ntk (static NTK-aware, which
    HF has no rope_type for) becomes ``rope_theta * factor ** (head_dim / (head_dim - 2))``.

    Args:
        config: the trained model's config.
        target_len: the new context length, > L.
        scaling: one of SCALINGS.
    Returns:
        A new ModelConfig with the scaling and ``max_seq_len = target_len``.
    Raises:
        ConfigError: unknown scaling, target not above L, no RoPE, RoPE already scaled, or dynamic.
    """
    if scaling not in SCALINGS:
        raise ConfigError(f"unknown scaling {scaling!r}: valid are {', '.join(SCALINGS)}")
    original_len = config.max_seq_len
    if target_len <= original_len:
        raise ConfigError(f"target length {target_len} must exceed the model's context {original_len}")
    if config.pos != "rope":
        raise ConfigError(f"the model uses pos={config.pos!r}; only RoPE models can be rescaled")
    if config.rope_scaling is not None:
        raise ConfigError(f"the model already has rope_scaling={config.rope_scaling}; extending a scaled "
                          "model again is not supported")
    if scaling == "dynamic":
        raise ConfigError("scaling 'dynamic' rescales only beyond max_seq_len (as in transformers), which "
                          "fine-tuning at the target sets to the target, so it would never engage; use 'ntk' "
                          "(its static form) or 'yarn'")
    factor = target_len / original_len
    if scaling == "ntk":
        grown_theta = config.rope_theta * factor ** (config.rotary_dim / (config.rotary_dim - 2))
        return dataclasses.replace(config, rope_theta=grown_theta, max_seq_len=target_len)
    rope_scaling = {"rope_type": scaling, "factor": factor}
    if scaling in ("yarn", "llama3"):
        rope_scaling["original_max_position_embeddings"] = original_len
    if scaling == "llama3":
        rope_scaling.update(low_freq_factor=LLAMA3_LOW_FREQ_FACTOR, high_freq_factor=LLAMA3_HIGH_FREQ_FACTOR)
    return dataclasses.replace(config, rope_scaling=rope_scaling, max_seq_len=target_len)


def save_extended_checkpoint(model: Transformer, config: ModelConfig, out_dir: str, tokenizer) -> None:
    """Write ``model``'s weights under the extended ``config`` (RoPE has no weights: nothing else changes).

    Args:
        model: the trained model.
        config: from ``extended_model_config``.
        out_dir: destination checkpoint directory (replaced).
        tokenizer: saved alongside, so fine-tuning and evaluation keep using it.
    """
    with torch.device("meta"):
        extended = Transformer(config)
    extended.load_state_dict(model.state_dict(), assign=True)
    save_pretrained(extended, out_dir, tokenizer=tokenizer)


def resolve_checkpoint(path: str) -> str:
    """The checkpoint directory ``path`` names: itself, or a run directory's latest ``ckpt-<step>``.

    Raises:
        CheckpointError: ``path`` is not a directory.
    """
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint directory {path} not found")
    return latest_checkpoint(path) or path


def _run_recipe(path: str) -> dict | None:
    """The config.yaml of the run ``path`` is (a run directory) or belongs to (one of its checkpoints), or None."""
    run_dir = os.path.dirname(os.path.abspath(path)) if os.path.isfile(os.path.join(path, TRAINER_STATE_FILE)) else path
    recipe = os.path.join(run_dir, "config.yaml")
    if not os.path.isfile(recipe):
        return None
    return read_yaml(recipe)


def long_context_train_config(checkpoint_path: str, extended_config: ModelConfig, scaling: str,
                              out_dir: str | None, steps: int, lr: float | None, warmup_steps: int | None,
                              overrides=()) -> TrainConfig:
    """The fine-tuning TrainConfig: the checkpoint's run recipe (defaults without one) made long.

    Args:
        checkpoint_path: what the user named (a run directory or a checkpoint).
        extended_config: the model config to train (recorded; the Trainer reads it from init_from).
        scaling: its name, part of the run name ``<recipe name>-<scaling><target>``.
        out_dir: the fine-tuning run directory (None: runs/<run name>); init_from is its ``extended-init``.
        steps: optimizer steps.
        lr: peak learning rate; None: a tenth of the recipe's (fine-tuning moves trained weights).
        warmup_steps: None: a tenth of the steps.
        overrides: ``key=value`` strings applied last, e.g. ``batch_size=4``.
    Raises:
        ConfigError: an invalid override or value.
    """
    base = config_to_dict(load_train_config(_run_recipe(checkpoint_path)))
    lr = base["optim"]["lr"] / 10 if lr is None else lr
    name = f"{base['name']}-{scaling}{extended_config.max_seq_len}"
    out_dir = out_dir or os.path.join("runs", name)
    base.update(name=name, out_dir=out_dir, steps=steps,
                resume=False, init_from=os.path.join(out_dir, EXTENDED_INIT_DIR), activation_checkpointing=True,
                model=config_to_dict(extended_config))
    base["optim"].update(lr=lr, min_lr=lr / 10, warmup_steps=steps // 10 if warmup_steps is None else warmup_steps)
    base["data"].update(seq_len=extended_config.max_seq_len, packing="packed")
    return load_train_config(base, overrides)
