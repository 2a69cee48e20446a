"""ModelConfig: a Transformer's architecture hyper-parameters, validated (families.py fills and checks
a family's fields).

Below model.py so that what only reads or writes configs (hf.py's translation, the checkpoint files)
needs no model code.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Optional

from .config import ConfigError
from .families import FAMILY_NAMES, check_family, default_layer_types, family_defaults
from .kernels.sizes import HEAD_DIM_MULTIPLE, MAX_HEAD_DIM, MIN_HEAD_DIM
from .rope import normalize_rope_scaling

_CHOICES = {"family": FAMILY_NAMES, "norm": ("layernorm", "rmsnorm", "offset_rmsnorm"),
            "norm_placement": ("pre", "post", "both"), "mlp": ("gelu", "swiglu", "geglu"), "pos": ("learned", "rope"),
            "qk_norm": ("none", "per_head", "across_heads")}


@dataclasses.dataclass
class ModelConfig:
    """Architecture hyper-parameters.

    None for n_kv_head / head_dim / d_ff means the usual default; None for an architecture field
    (norm ... query_pre_attn_scalar) means the family's value, and a value the family cannot have
    is refused by validate() (see families.py).
    """

    family: Literal["gpt2", "llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "olmo2",
                    "custom"] = "llama"
    vocab_size: int = 50304
    d_model: int = 768
    n_layer: int = 12
    n_head: int = 12
    n_kv_head: Optional[int] = None  # None: n_head (no grouping)
    head_dim: Optional[int] = None  # None: d_model // n_head
    d_ff: Optional[int] = None  # None: 4 * d_model
    max_seq_len: int = 1024
    norm: Optional[Literal["layernorm", "rmsnorm", "offset_rmsnorm"]] = None  # offset: x_hat * (1 + w), Gemma's
    norm_eps: Optional[float] = None
    # pre: x + f(norm(x)); post: x + norm(f(x)) (OLMo 2); both: x + norm(f(norm(x))) (Gemma)
    norm_placement: Optional[Literal["pre", "post", "both"]] = None
    mlp: Optional[Literal["gelu", "swiglu", "geglu"]] = None  # gelu is GPT-2's tanh approximation; geglu Gemma's
    pos: Optional[Literal["learned", "rope"]] = None
    rope_theta: Optional[float] = None
    rope_local_theta: Optional[float] = None  # RoPE base of the sliding-window layers (Gemma 3); None: rope_theta
    rope_scaling: Optional[dict] = None  # HF-style, see rope.py; on the full layers only when rope_local_theta is set
    # RoPE rotates the first rotary_dim = int(head_dim * partial_rotary_factor) dims of each head (transformers'
    # count) and passes the rest through; scalings and LongRoPE's factor lists count over rotary_dim
    partial_rotary_factor: Optional[float] = None
    qkv_bias: Optional[bool] = None
    o_bias: Optional[bool] = None
    mlp_bias: Optional[bool] = None
    # RMSNorm of queries and keys before RoPE: per_head over head_dim (Qwen3, Gemma 3), across_heads over
    # the whole projection (OLMo 2)
    qk_norm: Optional[Literal["none", "per_head", "across_heads"]] = None
    scale_embeddings: Optional[bool] = None  # token embeddings times sqrt(d_model) (Gemma)
    tie_embeddings: Optional[bool] = None
    sliding_window: Optional[int] = None  # each query sees itself and the sliding_window - 1 keys before it
    # Per layer "full" or "sliding" (windowed); None: the family's pattern (Gemma 2 alternates, Gemma 3 has
    # every 6th layer full), else every layer sliding when sliding_window is set
    layer_types: Optional[tuple[Literal["full", "sliding"], ...]] = None
    attn_softcap: Optional[float] = None  # 0 disables it
    logit_softcap: Optional[float] = None  # final logits become c * tanh(logits / c); 0 disables it
    query_pre_attn_scalar: Optional[int] = None  # softmax scale is its ** -0.5; None: head_dim (Gemma sets it)
    init_std: float = 0.02

    def __post_init__(self):
        for name, value in family_defaults(self.family).items():
            if getattr(self, name) is None:
                setattr(self, name, value)
        positive_heads = isinstance(self.n_head, int) and self.n_head > 0
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        if self.head_dim is None and positive_heads and isinstance(self.d_model, int):
            if self.d_model % self.n_head:  # floor division would silently drop d_model % n_head dimensions
                raise ConfigError(f"d_model={self.d_model} is not a multiple of n_head={self.n_head}, so head_dim "
                                  f"(d_model / n_head by default) is not a whole number: change d_model or n_head, "
                                  f"or set head_dim explicitly")
            self.head_dim = self.d_model // self.n_head
        if self.d_ff is None and isinstance(self.d_model, int):
            self.d_ff = 4 * self.d_model
        if isinstance(self.layer_types, list):
            self.layer_types = tuple(self.layer_types)

    @property
    def rotary_dim(self) -> int:
        """How many leading dims of each head RoPE rotates."""
        return int(self.head_dim * self.partial_rotary_factor)

    def layer_kinds(self) -> tuple[str, ...]:
        """"full" or "sliding" for every layer: layer_types, or the family's pattern."""
        if self.layer_types is not None:
            return self.layer_types
        return default_layer_types(self.family, self.n_layer, self.sliding_window)

    def validate(self) -> None:
        """Raise ConfigError naming the first invalid field."""
        for name in ("vocab_size", "d_model", "n_layer", "n_head", "n_kv_head", "head_dim", "d_ff", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name} must be a positive int, got {value!r}")
        for name, choices in _CHOICES.items():
            if getattr(self, name) not in choices:
                raise ConfigError(f"{name}={getattr(self, name)!r}: expected one of {list(choices)}")
        if self.n_head % self.n_kv_head:
            raise ConfigError(f"n_head ({self.n_head}) must be a multiple of n_kv_head ({self.n_kv_head})")
        if self.head_dim % HEAD_DIM_MULTIPLE or not MIN_HEAD_DIM <= self.head_dim <= MAX_HEAD_DIM:
            raise ConfigError(f"head_dim={self.head_dim}: the attention kernels need a multiple of {HEAD_DIM_MULTIPLE} "
                              f"in [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}]")
        for name in ("norm_eps", "rope_theta", "init_std", "rope_local_theta", "query_pre_attn_scalar"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(f"{name} must be > 0, got {value!r}")
        for name in ("attn_softcap", "logit_softcap"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"{name} must be >= 0 (0 disables it), got {getattr(self, name)!r}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ConfigError(f"sliding_window must be None or >= 1, got {self.sliding_window!r}")
        if self.layer_types is not None:
            if len(self.layer_types) != self.n_layer:
                raise ConfigError(f"layer_types has {len(self.layer_types)} entries for n_layer={self.n_layer}")
            if not set(self.layer_types) <= {"full", "sliding"}:
                raise ConfigError(f"layer_types={list(self.layer_types)!r}: entries must be 'full' or 'sliding'")
            if "sliding" in self.layer_types and self.sliding_window is None:
                raise ConfigError("layer_types has 'sliding' layers but sliding_window is not set")
        if self.rope_local_theta is not None and self.pos != "rope":
            raise ConfigError("rope_local_theta is set but pos='learned' has no rotary embedding")
        if self.pos == "learned" and self.rope_scaling is not None:
            raise ConfigError("rope_scaling is set but pos='learned' has no rotary embedding")
        factor = self.partial_rotary_factor
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
            raise ConfigError(f"partial_rotary_factor must be in (0, 1] (the share of each head RoPE rotates), "
                              f"got {factor!r}")
        if self.pos == "learned" and factor != 1:
            raise ConfigError("partial_rotary_factor is set but pos='learned' has no rotary embedding")
        if self.rotary_dim < 2 or self.rotary_dim % 2:
            raise ConfigError(f"partial_rotary_factor={factor!r} rotates int(head_dim {self.head_dim} * {factor!r}) = "
                              f"{self.rotary_dim} dims; RoPE rotates pairs, so that must be even and at least 2")
        try:
            normalize_rope_scaling(self.rope_scaling, self.max_seq_len, self.rotary_dim if self.pos == "rope" else None)
            check_family(self)
        except ValueError as err:
            raise ConfigError(str(err)) from None
