"""LoRA: low-rank adapters on a frozen base, applied to a Transformer from outside (model.py stays plain).

    apply_lora(model, LoRAConfig(rank=16, targets=["q", "k", "v", "o"]))   # base frozen, only A / B train
    write_adapter_files(adapters, model.config, directory, lora_config, base_dir)  # + a record of the base
    merged = merge_lora(model)                                             # plain nn.Linear, W + scale * B @ A

A targeted ``nn.Linear`` becomes a ``LoRALinear`` that holds the very same weight and bias Parameters
(no copy: the base can stay in bf16 while A and B train in fp32) and adds ``scale * B @ A @ x`` with
``scale = alpha / rank``. B starts at zero, so the adapted model starts equal to its base.

An adapter checkpoint is a directory with ``adapter.safetensors`` (keys ``<linear>.lora_a``,
``<linear>.lora_b``, and the norms' weights when they train too) and ``adapter_config.json`` (the LoRA
config, the base's path and model config); ``checkpoint.from_pretrained`` loads one as its base with
the adapters merged in.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from .config import ConfigError, config_to_dict
from .fileio import atomic_write_file
from .layers import RMSNorm
from .weights import (ADAPTER_CONFIG_FILE, ADAPTER_FILE, ADAPTER_FORMAT, CheckpointError, read_json,
                      read_safetensors_file)

# Config names of the targets -> the Linear attribute they name inside a block.
TARGET_MODULES = {"q": "attn.q_proj", "k": "attn.k_proj", "v": "attn.v_proj", "o": "attn.o_proj",
                  "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
NORM_TYPES = (nn.LayerNorm, RMSNorm)


@dataclass
class LoRAConfig:
    """``rank`` 0 (the default) trains the whole model; above 0 only the adapters (and the norms with
    ``train_norms``). ``base_dtype``: the frozen base's dtype; auto is bf16 under bf16 autocast, else fp32."""

    rank: int = 0
    alpha: float = 32.0
    dropout: float = 0.0
    targets: list[str] = field(default_factory=lambda: ["q", "k", "v", "o"])
    train_norms: bool = False
    base_dtype: Literal["auto", "fp32", "bf16"] = "auto"

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    def validate(self) -> None:
        if self.rank < 0:
            raise ConfigError(f"lora.rank must be >= 0 (0 disables LoRA), got {self.rank}")
        if not self.alpha > 0:
            raise ConfigError(f"lora.alpha must be > 0, got {self.alpha}")
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"lora.dropout must be in [0, 1), got {self.dropout}")
        unknown = [t for t in self.targets if t not in TARGET_MODULES]
        if unknown or not self.targets:
            raise ConfigError(f"lora.targets={self.targets!r}: expected a non-empty list of {list(TARGET_MODULES)}")
        if len(set(self.targets)) != len(self.targets):
            raise ConfigError(f"lora.targets={self.targets!r} names a target twice")


class LoRALinear(nn.Module):
    """``base(x) + scale * B(A(dropout(x)))`` around the Parameters of an existing ``nn.Linear``.

    Args:
        base: the Linear to adapt; its weight and bias are adopted (the same Parameter objects) and frozen.
        rank, alpha, dropout: as in LoRAConfig.
    """

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0):
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight.requires_grad_(False)
        self.bias = base.bias.requires_grad_(False) if base.bias is not None else None
        device = base.weight.device
        self.lora_a = nn.Parameter(torch.empty(rank, self.in_features, device=device, dtype=torch.float32))
        self.lora_b = nn.Parameter(torch.zeros(self.out_features, rank, device=device, dtype=torch.float32))
        # nn.Linear's own initialization for A; B at zero keeps the initial output equal to the base's.
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))
        self.scale = alpha / rank
        self.dropout = nn.Dropout(dropout) if dropout else nn.Identity()

    def forward(self, x):
        return F.linear(x, self.weight, self.bias) + F.linear(F.linear(self.dropout(x), self.lora_a),
                                                              self.lora_b) * self.scale

    def merged_weight(self) -> torch.Tensor:
        """``W + scale * B @ A`` in fp32, cast to the base weight's dtype."""
        delta = (self.lora_b.detach().float() @ self.lora_a.detach().float()) * self.scale
        return (self.weight.detach().float() + delta).to(self.weight.dtype)


def _targets(model: nn.Module, targets) -> list[tuple[nn.Module, str, str]]:
    """(parent module, attribute, full name) of every Linear ``targets`` names, block by block."""
    found = []
    for index, block in enumerate(model.blocks):
        for target in targets:
            path = TARGET_MODULES[target]
            parent_name, attribute = path.rsplit(".", 1)
            parent = block.get_submodule(parent_name)
            if not isinstance(getattr(parent, attribute, None), (nn.Linear, LoRALinear)):
                raise ConfigError(f"lora.targets: {target!r} names no layer of this model (block {index} has no "
                                  f"Linear {path})")
            found.append((parent, attribute, f"blocks.{index}.{path}"))
    return found


def apply_lora(model: nn.Module, config: LoRAConfig) -> nn.Module:
    """Freeze ``model`` and adapt the targeted Linears of every block in place (nothing is copied).

    Args:
        model: a Transformer (anything with ``model.blocks``), on the device it will train on.
        config: an enabled LoRAConfig; with ``train_norms`` the norms' weights train too, in fp32.
    Returns:
        ``model``, whose only trainable parameters are the adapters (and norms).
    Raises:
        ConfigError: a target this model does not have, or a model adapted already.
    """
    if any(isinstance(m, LoRALinear) for m in model.modules()):
        raise ConfigError("lora: the model carries adapters already")
    targets = _targets(model, config.targets)
    model.requires_grad_(False)
    for parent, attribute, _ in targets:
        setattr(parent, attribute, LoRALinear(getattr(parent, attribute), config.rank, config.alpha, config.dropout))
    if config.train_norms:
        for module in model.modules():
            if isinstance(module, NORM_TYPES):
                for param in module.parameters(recurse=False):
                    param.data = param.data.float()
                    param.requires_grad_(True)
    return model


def load_adapter_weights(model: nn.Module, tensors: dict, source) -> None:
    """Copy ``tensors`` (from ``read_adapter``) into an adapted model's trainable parameters.

    Raises:
        CheckpointError: names or shapes that differ from the model's adapters (all listed).
    """
    params = {name: p for name, p in model.named_parameters() if p.requires_grad}
    missing, unexpected = sorted(params.keys() - tensors.keys()), sorted(tensors.keys() - params.keys())
    misshapen = sorted(name for name in params.keys() & tensors.keys() if params[name].shape != tensors[name].shape)
    if missing or unexpected or misshapen:
        raise CheckpointError(f"{source} does not match the adapters: missing {missing}, unexpected {unexpected}, "
                              f"misshapen {misshapen}")
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(tensors[name])


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every LoRALinear into a plain ``nn.Linear`` (weight ``W + scale * B @ A``) in place, and make
    every parameter trainable again, as a model loaded from a full checkpoint is.

    Returns:
        ``model``, with the state-dict keys of an unadapted Transformer.
    """
    for name, module in list(model.named_modules()):
        if not isinstance(module, LoRALinear):
            continue
        parent_name, _, attribute = name.rpartition(".")
        linear = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None, device="meta")
        linear.weight = nn.Parameter(module.merged_weight())
        if module.bias is not None:
            linear.bias = module.bias
        setattr(model.get_submodule(parent_name), attribute, linear)
    return model.requires_grad_(True)


def write_adapter_files(adapters: dict, model_config, directory: str, config: LoRAConfig, base_dir: str) -> None:
    """Write an adapted model's adapters and ``adapter_config.json`` into an existing directory.

    Not atomic by itself (as weights.write_pretrained_files): a caller wraps it in fileio.atomic_directory.

    Args:
        adapters: the model's trainable tensors by parameter name, whole (a sharded model's gathered, as
            ``parallel.full_state_dicts(..., trainable_only=True)`` does).
        model_config: the adapted model's ModelConfig.
        directory: destination.
        config: the LoRAConfig it was adapted with.
        base_dir: the base checkpoint directory the adapters belong to (recorded as an absolute path).
    """
    from safetensors.torch import save_file

    tensors = {name: t.detach().cpu().contiguous() for name, t in adapters.items()}
    save_file(tensors, os.path.join(directory, ADAPTER_FILE), metadata={"format": "pt"})
    record = {"format": ADAPTER_FORMAT, "format_version": 1, "lora": config_to_dict(config),
              "base": {"path": os.path.abspath(base_dir), "model": config_to_dict(model_config)}}
    text = json.dumps(record, indent=2)
    atomic_write_file(os.path.join(directory, ADAPTER_CONFIG_FILE), lambda f: f.write(text.encode("utf-8")))


def is_adapter_checkpoint(directory) -> bool:
    return os.path.isfile(os.path.join(directory, ADAPTER_CONFIG_FILE))


def read_adapter(directory) -> tuple[dict, dict]:
    """(adapter_config.json as a dict, the adapter tensors on the CPU) of an adapter checkpoint.

    Raises:
        CheckpointError: a missing, unreadable or foreign file.
    """
    record = read_json(os.path.join(directory, ADAPTER_CONFIG_FILE))
    if record.get("format") != ADAPTER_FORMAT:
        raise CheckpointError(f"{os.path.join(directory, ADAPTER_CONFIG_FILE)}: format is not {ADAPTER_FORMAT!r}")
    return record, read_safetensors_file(os.path.join(directory, ADAPTER_FILE))
