"""The Transformer's building blocks that several families configure: norms and the MLP."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 (as Llama does) and cast back.

    offset=True is Gemma's form: x / rms(x) * (1 + weight) in fp32, weight starting at 0, so that
    Gemma checkpoints load unchanged.
    """

    def __init__(self, dim: int, eps: float, offset: bool = False):
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))

    def forward(self, x):
        x_float = x.float()
        x_float = x_float * torch.rsqrt(x_float.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (x_float * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * x_float.to(x.dtype)


def make_norm(config, dim: Optional[int] = None) -> nn.Module:
    """The norm config.norm names, over ``dim`` features (default d_model)."""
    dim = dim or config.d_model
    if config.norm == "layernorm":
        return nn.LayerNorm(dim, eps=config.norm_eps)
    return RMSNorm(dim, config.norm_eps, offset=config.norm == "offset_rmsnorm")


class MLP(nn.Module):
    """GPT-2's gelu(up(x)), or gated: down(act(gate(x)) * up(x)) with silu (swiglu) or tanh-GELU (geglu)."""

    def __init__(self, config):
        super().__init__()
        self.kind = config.mlp
        if self.kind != "gelu":
            self.gate_proj = nn.Linear(config.d_model, config.d_ff, bias=config.mlp_bias)
        self.up_proj = nn.Linear(config.d_model, config.d_ff, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.d_ff, config.d_model, bias=config.mlp_bias)

    def forward(self, x):
        if self.kind == "swiglu":
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        if self.kind == "geglu":
            return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))
        return self.down_proj(F.gelu(self.up_proj(x), approximate="tanh"))
