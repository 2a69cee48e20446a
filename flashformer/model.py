"""One decoder-only Transformer. GPT-2, Llama 2/3, Mistral and Qwen2 differ only in ModelConfig fields.

    GPT-2:   learned positions, LayerNorm (with bias), GELU(tanh) MLP, biases everywhere, tied embeddings
    Llama:   RoPE (+ rope_scaling, e.g. llama3), RMSNorm, SwiGLU, grouped-query attention
    Mistral: Llama + sliding_window
    Qwen2:   Llama + bias on q/k/v (not on the output projection)

The model is single-device and knows nothing of parallelism: ``model.blocks`` is a plain ModuleList
that data / tensor parallelism and activation checkpointing wrap from outside. Attention goes
through ``flashformer.attention.attention``, selected by ``model.attn_backend`` at every forward.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from .attention import ATTN_BACKENDS, attention, cached_attention, resolve_backend
from .config import ConfigError
from .losses import lm_head_loss
from .rope import RotaryEmbedding, apply_rotary, normalize_rope_scaling

_CHOICES = {"family": ("gpt2", "llama", "mistral", "qwen2"), "norm": ("layernorm", "rmsnorm"),
            "mlp": ("gelu", "swiglu"), "pos": ("learned", "rope"), "attn_backend": ATTN_BACKENDS}


@dataclasses.dataclass
class ModelConfig:
    """Architecture hyper-parameters; None for n_kv_head / head_dim / d_ff means the usual default."""

    family: Literal["gpt2", "llama", "mistral", "qwen2"] = "llama"  # a label; picks the HF architecture on export
    vocab_size: int = 50304
    d_model: int = 768
    n_layer: int = 12
    n_head: int = 12
    n_kv_head: Optional[int] = None  # None: n_head (no grouping)
    head_dim: Optional[int] = None  # None: d_model // n_head
    d_ff: Optional[int] = None  # None: 4 * d_model
    max_seq_len: int = 1024
    norm: Literal["layernorm", "rmsnorm"] = "rmsnorm"
    norm_eps: float = 1e-5
    mlp: Literal["gelu", "swiglu"] = "swiglu"  # gelu is GPT-2's tanh approximation
    pos: Literal["learned", "rope"] = "rope"
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None  # HF-style, see rope.py
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    tie_embeddings: bool = False
    sliding_window: Optional[int] = None  # each query sees itself and the sliding_window - 1 keys before it
    attn_softcap: float = 0.0
    attn_backend: Literal["auto", "flash", "flash-nondeterministic", "reference", "sdpa", "naive"] = "auto"
    init_std: float = 0.02

    def __post_init__(self):
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
        if self.head_dim % 8 or not 16 <= self.head_dim <= 256:
            raise ConfigError(f"head_dim={self.head_dim}: the attention kernels need a multiple of 8 in [16, 256]")
        for name in ("norm_eps", "rope_theta", "init_std"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if not self.attn_softcap >= 0:
            raise ConfigError(f"attn_softcap must be >= 0 (0 disables it), got {self.attn_softcap!r}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ConfigError(f"sliding_window must be None or >= 1, got {self.sliding_window!r}")
        if self.pos == "learned" and self.rope_scaling is not None:
            raise ConfigError("rope_scaling is set but pos='learned' has no rotary embedding")
        try:
            normalize_rope_scaling(self.rope_scaling, self.max_seq_len)
        except ValueError as err:
            raise ConfigError(str(err)) from None


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 (as Llama does) and cast back."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x_float = x.float()
        x_float = x_float * torch.rsqrt(x_float.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x_float.to(x.dtype)


def _make_norm(config: ModelConfig) -> nn.Module:
    if config.norm == "rmsnorm":
        return RMSNorm(config.d_model, config.norm_eps)
    return nn.LayerNorm(config.d_model, eps=config.norm_eps)


class KVCache:
    """K / V of the tokens seen so far, per layer (batch, max_len, n_kv_head, head_dim), for decoding."""

    def __init__(self, config: ModelConfig, batch_size: int, max_len: int, device=None, dtype=None):
        shape = (batch_size, max_len, config.n_kv_head, config.head_dim)
        self.keys = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layer)]
        self.values = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layer)]
        self.max_len = max_len
        self.length = 0  # tokens already cached; advanced by the model after all layers ran

    def attend(self, layer_idx, q, k, v, **attention_kwargs):
        """Append k, v (batch, new, n_kv_head, head_dim) and attend q (batch, new, n_head, head_dim) to the cache.

        The causal mask is aligned bottom-right, so a chunk of new queries sees exactly the cached
        keys plus the new keys up to its own position.
        """
        end = self.length + k.shape[1]
        if end > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} tokens; {end} needed")
        return cached_attention(q, k, v, self.keys[layer_idx], self.values[layer_idx], self.length,
                                **attention_kwargs)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.n_kv_head, config.head_dim
        self.q_proj = nn.Linear(config.d_model, config.n_head * config.head_dim, bias=config.qkv_bias)
        self.k_proj = nn.Linear(config.d_model, config.n_kv_head * config.head_dim, bias=config.qkv_bias)
        self.v_proj = nn.Linear(config.d_model, config.n_kv_head * config.head_dim, bias=config.qkv_bias)
        self.o_proj = nn.Linear(config.n_head * config.head_dim, config.d_model, bias=config.o_bias)
        # HF's sliding_window W counts the query itself: W - 1 keys to its left.
        self.window_size = (config.sliding_window - 1, -1) if config.sliding_window else (-1, -1)
        self.softcap = config.attn_softcap

    def forward(self, x, rope_cos_sin, backend, cu_seqlens=None, max_seqlen=None, kv_cache=None):
        batch, seqlen, _ = x.shape
        q = self.q_proj(x).view(batch, seqlen, self.n_head, self.head_dim)
        k = self.k_proj(x).view(batch, seqlen, self.n_kv_head, self.head_dim)
        v = self.v_proj(x).view(batch, seqlen, self.n_kv_head, self.head_dim)
        if rope_cos_sin is not None:
            q, k = apply_rotary(q, *rope_cos_sin), apply_rotary(k, *rope_cos_sin)
        options = dict(backend=backend, window_size=self.window_size, softcap=self.softcap)
        if kv_cache is not None:
            out = kv_cache.attend(self.layer_idx, q, k, v, **options)
        else:
            out = attention(q, k, v, causal=True, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, **options)
        return self.o_proj(out.reshape(batch, seqlen, self.n_head * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gated = config.mlp == "swiglu"
        if self.gated:
            self.gate_proj = nn.Linear(config.d_model, config.d_ff, bias=config.mlp_bias)
        self.up_proj = nn.Linear(config.d_model, config.d_ff, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.d_ff, config.d_model, bias=config.mlp_bias)

    def forward(self, x):
        if self.gated:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(F.gelu(self.up_proj(x), approximate="tanh"))


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.attn_norm = _make_norm(config)
        self.attn = Attention(config, layer_idx)
        self.mlp_norm = _make_norm(config)
        self.mlp = MLP(config)

    def forward(self, x, rope_cos_sin, backend, cu_seqlens=None, max_seqlen=None, kv_cache=None):
        x = x + self.attn(self.attn_norm(x), rope_cos_sin, backend, cu_seqlens, max_seqlen, kv_cache)
        return x + self.mlp(self.mlp_norm(x))


def _document_positions(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Position of every packed token inside its own document: (total,) int64."""
    tokens = torch.arange(total, device=cu_seqlens.device)
    boundaries = cu_seqlens.long()
    document = torch.searchsorted(boundaries[1:], tokens, right=True)
    return tokens - boundaries[document]


class Transformer(nn.Module):
    """Decoder-only language model.

    Args:
        config: a ModelConfig (validated here).
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        config.validate()
        self.config = config
        self.attn_backend = config.attn_backend
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_embed = nn.Embedding(config.max_seq_len, config.d_model) if config.pos == "learned" else None
        self.rope = (RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling, config.max_seq_len)
                     if config.pos == "rope" else None)
        self.blocks = nn.ModuleList(Block(config, i) for i in range(config.n_layer))
        self.final_norm = _make_norm(config)
        # A tied model reads the output projection from embed.weight: one tensor, one state-dict key.
        self.lm_head = None if config.tie_embeddings else nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.apply(self._init_weights)
        # GPT-2: scale the projections that write into the residual stream by 1/sqrt(2 * n_layer).
        for block in self.blocks:
            for proj in (block.attn.o_proj, block.mlp.down_proj):
                nn.init.normal_(proj.weight, std=config.init_std / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=self.config.init_std)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    @property
    def attn_backend(self) -> str:
        return self._attn_backend

    @attn_backend.setter
    def attn_backend(self, backend: str):
        resolve_backend(backend, torch.device("cpu"))  # validates the name
        self._attn_backend = backend

    @property
    def output_weight(self) -> torch.Tensor:
        """The (vocab_size, d_model) output projection: ``lm_head.weight``, or ``embed.weight`` when tied."""
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    def forward(self, input_ids, position_ids=None, cu_seqlens=None, max_seqlen=None, kv_cache=None, *,
                targets=None, loss_chunk_size=None):
        """Next-token logits, or with ``targets`` the loss (``self.loss``): the form a DDP / FSDP
        wrapper, which only hooks ``forward``, can compute without full logits.

        Args:
            input_ids, position_ids, cu_seqlens, max_seqlen, kv_cache: as in ``hidden_states``.
            targets, loss_chunk_size: as ``targets`` and ``chunk_size`` of ``loss``.
        Returns:
            logits (batch, seqlen, vocab_size) in the model's dtype, or the fp32 scalar loss.
        """
        if targets is not None:
            if kv_cache is not None:
                raise ValueError("targets (a training loss) and kv_cache (decoding) cannot be combined")
            return self.loss(input_ids, targets, position_ids, cu_seqlens, max_seqlen, chunk_size=loss_chunk_size)
        hidden = self.hidden_states(input_ids, position_ids, cu_seqlens, max_seqlen, kv_cache)
        return F.linear(hidden, self.output_weight)

    def hidden_states(self, input_ids, position_ids=None, cu_seqlens=None, max_seqlen=None, kv_cache=None):
        """The final normalized hidden states, the input of the LM head.

        Args:
            input_ids: (batch, seqlen) int64.
            position_ids: (batch, seqlen); default 0.. per row, restarting at every document with
                cu_seqlens, continuing after the cached tokens with kv_cache.
            cu_seqlens: int32 (num_docs + 1,) document boundaries over the batch * seqlen tokens.
            max_seqlen: longest document (for the varlen kernel).
            kv_cache: a KVCache; this call's tokens are appended to it.
        Returns:
            (batch, seqlen, d_model) in the model's dtype.
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (batch, seqlen), got shape {tuple(input_ids.shape)}")
        if cu_seqlens is not None and kv_cache is not None:
            raise ValueError("cu_seqlens and kv_cache cannot be combined")
        batch, seqlen = input_ids.shape
        if position_ids is None:
            position_ids = self._default_positions(batch, seqlen, input_ids.device, cu_seqlens, kv_cache)
        x = self.embed(input_ids)
        if self.pos_embed is not None:
            x = x + self.pos_embed(position_ids)
        rope_cos_sin = self.rope(position_ids) if self.rope is not None else None
        for block in self.blocks:
            x = block(x, rope_cos_sin, self.attn_backend, cu_seqlens, max_seqlen, kv_cache)
        if kv_cache is not None:
            kv_cache.length += seqlen
        return self.final_norm(x)

    def _default_positions(self, batch, seqlen, device, cu_seqlens, kv_cache):
        if cu_seqlens is not None:
            return _document_positions(cu_seqlens.to(device), batch * seqlen).view(batch, seqlen)
        start = kv_cache.length if kv_cache is not None else 0
        if self.pos_embed is not None and start + seqlen > self.config.max_seq_len:
            raise ValueError(f"sequence of {start + seqlen} tokens exceeds max_seq_len={self.config.max_seq_len} "
                             "of the learned position embeddings")
        return torch.arange(start, start + seqlen, device=device).expand(batch, seqlen)

    def loss(self, input_ids, targets, position_ids=None, cu_seqlens=None, max_seqlen=None, ignore_index=-100,
             chunk_size=None):
        """Mean next-token cross-entropy over targets != ignore_index, in fp32.

        At long context the (tokens x vocab) logits outweigh the rest of the step, so the LM head and
        the cross-entropy run through ``losses.lm_head_loss``, chunked over the tokens when asked or
        when the logits would be large.

        Args:
            input_ids, targets: (batch, seqlen) int64; position_ids, cu_seqlens, max_seqlen as in hidden_states.
            chunk_size: tokens per LM-head chunk; setting it forces chunking (e.g.
                ``losses.default_chunk_size(vocab_size)``). None chunks only when tokens x vocab exceeds
                ``losses.MATERIALIZED_LOGITS_MAX_ELEMENTS``.
        """
        hidden = self.hidden_states(input_ids, position_ids, cu_seqlens, max_seqlen)
        return lm_head_loss(hidden, self.output_weight, targets, chunk_size, ignore_index=ignore_index)

    def new_kv_cache(self, batch_size: int, max_len: int) -> KVCache:
        """An empty KVCache on this model's device and dtype."""
        weight = self.embed.weight
        return KVCache(self.config, batch_size, max_len, device=weight.device, dtype=weight.dtype)

    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Parameter count; exclude_embeddings drops pure lookup tables (learned positions, and the
        token embedding unless it doubles as the tied output projection)."""
        total = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            if self.pos_embed is not None:
                total -= self.pos_embed.weight.numel()
            if self.lm_head is not None:
                total -= self.embed.weight.numel()
        return total

    def flops_per_token(self, seqlen: int) -> int:
        """Training FLOPs per token (forward + backward): 6 * matmul params + 12 * n_layer * width * seqlen."""
        width = self.config.n_head * self.config.head_dim
        return 6 * self.num_params(exclude_embeddings=True) + 12 * self.config.n_layer * width * seqlen

    def save_pretrained(self, out_dir, format: str = "flashformer", **kwargs) -> None:
        """Write safetensors + config.json (see weights.save_pretrained for kwargs)."""
        from .weights import save_pretrained

        save_pretrained(self, out_dir, format=format, **kwargs)
