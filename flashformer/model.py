"""One decoder-only Transformer. Its families differ only in ModelConfig fields (presets in families.py).

    GPT-2:   learned positions, LayerNorm (with bias), GELU(tanh) MLP, biases everywhere, tied embeddings
    Llama:   RoPE (+ rope_scaling, e.g. llama3), RMSNorm, SwiGLU, grouped-query attention
    Mistral: Llama + sliding_window
    Qwen2:   Llama + bias on q/k/v (not on the output projection), optionally windowed upper layers
    Qwen3:   Llama + RMSNorm of each query / key head (qk_norm="per_head")
    Gemma 2: (1 + w) RMSNorm before and after each sublayer, GeGLU, embeddings scaled by sqrt(d_model),
             attention and final-logit softcaps, sliding-window and full layers alternating
    Gemma 3: Gemma 2 without softcaps, + per-head qk-norm, 5 local : 1 global layers, local RoPE base
    Phi-3:   Llama (fused q/k/v and gate/up only in its checkpoints)
    OLMo 2:  RMSNorm after each sublayer instead of before, RMSNorm over all query / key heads

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
from .families import FAMILY_NAMES, check_family, default_layer_types, family_defaults
from .layers import MLP, make_norm
from .losses import lm_head_loss
from .rope import RotaryEmbedding, apply_rotary, normalize_rope_scaling

_CHOICES = {"family": FAMILY_NAMES, "norm": ("layernorm", "rmsnorm", "offset_rmsnorm"),
            "norm_placement": ("pre", "post", "both"), "mlp": ("gelu", "swiglu", "geglu"), "pos": ("learned", "rope"),
            "qk_norm": ("none", "per_head", "across_heads"), "attn_backend": ATTN_BACKENDS}


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
    attn_backend: Literal["auto", "flash", "flash-nondeterministic", "reference", "sdpa", "naive"] = "auto"
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
        if self.head_dim % 8 or not 16 <= self.head_dim <= 256:
            raise ConfigError(f"head_dim={self.head_dim}: the attention kernels need a multiple of 8 in [16, 256]")
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
        try:
            normalize_rope_scaling(self.rope_scaling, self.max_seq_len)
            check_family(self)
        except ValueError as err:
            raise ConfigError(str(err)) from None


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
        self.qk_norm = config.qk_norm
        if self.qk_norm != "none":
            per_head = self.qk_norm == "per_head"
            self.q_norm = make_norm(config, config.head_dim if per_head else config.n_head * config.head_dim)
            self.k_norm = make_norm(config, config.head_dim if per_head else config.n_kv_head * config.head_dim)
        # HF's sliding_window W counts the query itself: W - 1 keys to its left.
        sliding = config.layer_kinds()[layer_idx] == "sliding"
        self.window_size = (config.sliding_window - 1, -1) if sliding else (-1, -1)
        self.softcap = config.attn_softcap
        # Passed on only when it differs from the kernels' default head_dim ** -0.5.
        scalar = config.query_pre_attn_scalar
        self.softmax_scale = None if scalar in (None, config.head_dim) else scalar ** -0.5

    def forward(self, x, rope_cos_sin, backend, cu_seqlens=None, max_seqlen=None, kv_cache=None):
        batch, seqlen, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.qk_norm == "across_heads":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(batch, seqlen, self.n_head, self.head_dim)
        k = k.view(batch, seqlen, self.n_kv_head, self.head_dim)
        v = v.view(batch, seqlen, self.n_kv_head, self.head_dim)
        if self.qk_norm == "per_head":
            q, k = self.q_norm(q), self.k_norm(k)
        if rope_cos_sin is not None:
            q, k = apply_rotary(q, *rope_cos_sin), apply_rotary(k, *rope_cos_sin)
        options = dict(backend=backend, window_size=self.window_size, softcap=self.softcap)
        if self.softmax_scale is not None:
            options["softmax_scale"] = self.softmax_scale
        if kv_cache is not None:
            out = kv_cache.attend(self.layer_idx, q, k, v, **options)
        else:
            out = attention(q, k, v, causal=True, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, **options)
        return self.o_proj(out.reshape(batch, seqlen, self.n_head * self.head_dim))


class Block(nn.Module):
    """Residual block: x + post(attn(pre(x))), then the same around the MLP.

    pre / post are the norms that config.norm_placement asks for, identities otherwise.
    """

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        pre, post = config.norm_placement in ("pre", "both"), config.norm_placement in ("post", "both")
        self.attn_norm = make_norm(config) if pre else nn.Identity()
        self.attn = Attention(config, layer_idx)
        self.attn_post_norm = make_norm(config) if post else nn.Identity()
        self.mlp_norm = make_norm(config) if pre else nn.Identity()
        self.mlp = MLP(config)
        self.mlp_post_norm = make_norm(config) if post else nn.Identity()

    def forward(self, x, rope_cos_sin, backend, cu_seqlens=None, max_seqlen=None, kv_cache=None):
        x = x + self.attn_post_norm(self.attn(self.attn_norm(x), rope_cos_sin, backend, cu_seqlens, max_seqlen,
                                              kv_cache))
        return x + self.mlp_post_norm(self.mlp(self.mlp_norm(x)))


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
        self.rope = self.local_rope = None
        if config.pos == "rope":
            self.rope = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling, config.max_seq_len)
            # Gemma 3's sliding-window layers rotate with their own base and without the scaling.
            if config.rope_local_theta is not None:
                self.local_rope = RotaryEmbedding(config.head_dim, config.rope_local_theta, None, config.max_seq_len)
        self.layer_kinds = config.layer_kinds()
        self.blocks = nn.ModuleList(Block(config, i) for i in range(config.n_layer))
        self.final_norm = make_norm(config)
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
        logits = F.linear(hidden, self.output_weight)
        if self.config.logit_softcap:
            cap = self.config.logit_softcap
            logits = (cap * torch.tanh(logits.float() / cap)).to(logits.dtype)
        return logits

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
        if self.config.scale_embeddings:  # by sqrt(d_model) rounded to the model's dtype, as Gemma does
            x = x * torch.tensor(self.config.d_model ** 0.5, dtype=x.dtype, device=x.device)
        if self.pos_embed is not None:
            x = x + self.pos_embed(position_ids)
        rope = {"full": None, "sliding": None}
        if self.rope is not None:
            rope["full"] = rope["sliding"] = self.rope(position_ids)
            if self.local_rope is not None:
                rope["sliding"] = self.local_rope(position_ids)
        for block, kind in zip(self.blocks, self.layer_kinds):
            x = block(x, rope[kind], self.attn_backend, cu_seqlens, max_seqlen, kv_cache)
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
        return lm_head_loss(hidden, self.output_weight, targets, chunk_size, ignore_index=ignore_index,
                            softcap=self.config.logit_softcap)

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
