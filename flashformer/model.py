"""One decoder-only Transformer. Its families differ only in ModelConfig fields (presets in families.py).

    GPT-2:   learned positions, LayerNorm (with bias), GELU(tanh) MLP, biases everywhere, tied embeddings
    Llama:   RoPE (+ rope_scaling, e.g. llama3), RMSNorm, SwiGLU, grouped-query attention
    Mistral: Llama + sliding_window
    Qwen2:   Llama + bias on q/k/v (not on the output projection), optionally windowed upper layers
    Qwen3:   Llama + RMSNorm of each query / key head (qk_norm="per_head")
    Gemma 2: (1 + w) RMSNorm before and after each sublayer, GeGLU, embeddings scaled by sqrt(d_model),
             attention and final-logit softcaps, sliding-window and full layers alternating
    Gemma 3: Gemma 2 without softcaps, + per-head qk-norm, 5 local : 1 global layers, local RoPE base
    Phi-3:   Llama (fused q/k/v and gate/up only in its checkpoints); Phi-4-mini's RoPE turns 3/4 of each head
             (partial_rotary_factor)
    OLMo 2:  RMSNorm after each sublayer instead of before, RMSNorm over all query / key heads

The model is single-device and knows nothing of parallelism: ``model.blocks`` is a plain ModuleList
that data / tensor parallelism and activation checkpointing wrap from outside. Attention goes
through ``flashformer.attention``, selected by ``model.attn_backend`` (with ``model.deterministic`` for
the flash backward) at every forward: runtime choices, not part of the config.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import sampling
from .attention import attention, cached_attention, resolve_backend
from .layers import MLP, make_norm
from .losses import lm_head_loss
from .model_config import ModelConfig
from .rope import RotaryEmbedding, apply_rotary

__all__ = ["KVCache", "ModelConfig", "Transformer"]


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

    def forward(self, x, rope_cos_sin, backend, deterministic, cu_seqlens=None, max_seqlen=None, kv_cache=None):
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
            out = attention(q, k, v, causal=True, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                            deterministic=deterministic, **options)
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

    def forward(self, x, rope_cos_sin, backend, deterministic, cu_seqlens=None, max_seqlen=None, kv_cache=None):
        x = x + self.attn_post_norm(self.attn(self.attn_norm(x), rope_cos_sin, backend, deterministic, cu_seqlens,
                                              max_seqlen, kv_cache))
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
        attn_backend: one of attention.ATTN_BACKENDS; an attribute that may change between calls.
        deterministic: whether the flash backward gives bit-identical gradients run after run (the
            faster non-deterministic one adds dQ in arrival order); an attribute too.
    """

    def __init__(self, config: ModelConfig, attn_backend: str = "auto", deterministic: bool = True):
        super().__init__()
        config.validate()
        self.config = config
        self.attn_backend = attn_backend
        self.deterministic = deterministic
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_embed = nn.Embedding(config.max_seq_len, config.d_model) if config.pos == "learned" else None
        self.rope = self.local_rope = None
        if config.pos == "rope":
            self.rope = RotaryEmbedding(config.rotary_dim, config.rope_theta, config.rope_scaling, config.max_seq_len)
            # Gemma 3's sliding-window layers rotate with their own base and without the scaling.
            if config.rope_local_theta is not None:
                self.local_rope = RotaryEmbedding(config.rotary_dim, config.rope_local_theta, None, config.max_seq_len)
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
        resolve_backend(backend)  # validates the name
        self._attn_backend = backend

    @property
    def output_weight(self) -> torch.Tensor:
        """The (vocab_size, d_model) output projection: ``lm_head.weight``, or ``embed.weight`` when tied."""
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    def forward(self, input_ids, position_ids=None, cu_seqlens=None, max_seqlen=None, kv_cache=None, *,
                targets=None, loss_chunk_size=None, loss_reduction="mean"):
        """Next-token logits, or with ``targets`` the loss (``self.loss``): the form a DDP / FSDP
        wrapper, which only hooks ``forward``, can compute without full logits. Plain tensors, not an
        output object: the trainer backpropagates what the wrapped forward returns.

        Args:
            input_ids, position_ids, cu_seqlens, max_seqlen, kv_cache: as in ``hidden_states``.
            targets, loss_chunk_size, loss_reduction: as ``targets``, ``chunk_size`` and ``reduction`` of ``loss``.
        Returns:
            logits (batch, seqlen, vocab_size) in the model's dtype, or the fp32 scalar loss.
        """
        if targets is not None:
            if kv_cache is not None:
                raise ValueError("targets (a training loss) and kv_cache (decoding) cannot be combined")
            return self.loss(input_ids, targets, position_ids, cu_seqlens, max_seqlen, chunk_size=loss_chunk_size,
                             reduction=loss_reduction)
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
            x = block(x, rope[kind], self.attn_backend, self.deterministic, cu_seqlens, max_seqlen, kv_cache)
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
             chunk_size=None, reduction="mean"):
        """Mean next-token cross-entropy over targets != ignore_index, in fp32 (or their sum).

        At long context the (tokens x vocab) logits outweigh the rest of the step, so the LM head and
        the cross-entropy run through ``losses.lm_head_loss``, chunked over the tokens when asked or
        when the logits would be large.

        Args:
            input_ids, targets: (batch, seqlen) int64, already shifted: targets[:, t] is the token after
                input_ids[:, t] (tokens[:, :-1] and tokens[:, 1:]); position_ids, cu_seqlens, max_seqlen as
                in hidden_states.
            chunk_size: tokens per LM-head chunk; setting it forces chunking (e.g.
                ``losses.default_chunk_size(vocab_size)``). None chunks only when tokens x vocab exceeds
                ``losses.MATERIALIZED_LOGITS_MAX_ELEMENTS``.
            reduction: "mean" or "sum" (context parallelism divides a slice's sum by the whole sequence's count).
        """
        hidden = self.hidden_states(input_ids, position_ids, cu_seqlens, max_seqlen)
        return lm_head_loss(hidden, self.output_weight, targets, chunk_size, ignore_index=ignore_index,
                            softcap=self.config.logit_softcap, reduction=reduction)

    def generate(self, input_ids, max_new_tokens, *, temperature=1.0, top_k=None, top_p=None, eos_token_id=None,
                 seed=None, stream=None, cuda_graph=False) -> torch.Tensor:
        """Extend ``input_ids`` by sampled tokens, with a KV cache: ``flashformer.generate.generate`` with
        transformers' name for the end tokens.

        Args:
            input_ids: (batch, prompt_len) or (prompt_len,) int64 prompt, non-empty.
            max_new_tokens: most tokens to add (past max_seq_len: a warning with RoPE, an error with learned
                positions).
            eos_token_id: an id or ids that end a row, e.g. ``tokenizer.eos_ids``; None runs to max_new_tokens.
            temperature, top_k, top_p, seed, stream, cuda_graph: as in ``sampling.generate`` (temperature 0
                is greedy).
        Returns:
            (batch, prompt_len + generated) int64 token ids, the prompt first.
        """
        return sampling.generate(self, input_ids, max_new_tokens, temperature, top_k, top_p,
                                 stop_tokens=sampling.token_ids(eos_token_id, "eos_token_id"), seed=seed,
                                 stream=stream, cuda_graph=cuda_graph)

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
