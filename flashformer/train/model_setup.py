"""The model a run trains: a new one, a checkpoint's, or a frozen base under LoRA adapters, with the
parameters the recipe freezes frozen."""

from __future__ import annotations

import fnmatch

import torch

from ..checkpoint import from_pretrained
from ..config import ConfigError
from ..context_parallel import check_ring_supports
from ..lora import apply_lora, load_adapter_weights, read_adapter
from ..model import Transformer
from .config import TrainConfig


def resolve_device(name: str) -> torch.device:
    """The recipe's ``device``: "auto" is CUDA where there is one, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device=cuda but no CUDA device is available")
    return torch.device(name)


def build_model(cfg: TrainConfig, device: torch.device, bf16: bool, init_dir: str | None, weights_from: str | None,
                resume_from: str | None) -> Transformer:
    """The run's model on ``device``; ``cfg.model`` becomes the loaded model's config.

    Args:
        cfg: the run's config.
        bf16: whether training runs under bf16 autocast (a LoRA base may then be loaded in bf16).
        init_dir: the checkpoint init_from names (LoRA's base, even on resume: a LoRA checkpoint holds
            adapters only).
        weights_from: the checkpoint to load (resume_from, else init_dir), or None for a new model.
        resume_from: the checkpoint a resumed run continues from.
    """
    if cfg.lora.enabled:
        model = from_pretrained(init_dir, dtype=_lora_base_dtype(cfg, device, bf16), device=device,
                                attn_backend=cfg.attn_backend)
    elif weights_from is not None:
        # fp32 master weights whatever the checkpoint stores: AdamW's small updates to bf16 weights round
        # away, and its moments take their parameter's dtype. bf16 is the autocast's, per matmul.
        model = from_pretrained(weights_from, dtype=torch.float32, device=device, attn_backend=cfg.attn_backend)
    else:
        model = Transformer(cfg.model, cfg.attn_backend).to(device)
    model.deterministic = cfg.deterministic
    if cfg.lora.enabled or weights_from is not None:
        cfg.model = model.config
        if cfg.data.seq_len > cfg.model.max_seq_len:
            raise ConfigError(f"data.seq_len ({cfg.data.seq_len}) exceeds the model's "
                              f"max_seq_len ({cfg.model.max_seq_len})")
    if cfg.parallel.context_parallel > 1:
        check_ring_supports(model.config)
    if cfg.lora.enabled:
        apply_lora(model, cfg.lora)
        if resume_from is not None:
            load_adapter_weights(model, read_adapter(resume_from)[1], resume_from)
    else:
        _freeze(model, cfg.freeze)
    return model


def _lora_base_dtype(cfg: TrainConfig, device: torch.device, bf16: bool) -> torch.dtype:
    """The frozen base's dtype: it is loaded straight into it, so a bf16 base never exists in fp32."""
    base_dtype = cfg.lora.base_dtype
    if base_dtype == "bf16" and not bf16:
        raise ConfigError(f"lora.base_dtype=bf16 needs bf16 autocast, which precision={cfg.precision} on "
                          f"{device.type} does not give: set precision=bf16")
    return torch.bfloat16 if base_dtype == "bf16" or (base_dtype == "auto" and bf16) else torch.float32


def _freeze(model: Transformer, patterns: list[str]) -> None:
    names = [name for name, _ in model.named_parameters()]
    for pattern in patterns:
        if not fnmatch.filter(names, pattern):
            raise ConfigError(f"freeze pattern {pattern!r} matches no parameter; names look like {names[:3]}")
    for name, param in model.named_parameters():
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns):
            param.requires_grad_(False)
    if not any(p.requires_grad for p in model.parameters()):
        raise ConfigError("freeze: every parameter is frozen, nothing would train")
