"""Hugging Face <-> flashformer: config.json fields and weight names, both ways, per architecture.

Supported: gpt2 (GPT2LMHeadModel), llama (LlamaForCausalLM), mistral (MistralForCausalLM),
qwen2 (Qwen2ForCausalLM). The key maps below are explicit tables, one row per tensor.

* GPT-2 stores its projections as Conv1D, weight (in, out): transposed against nn.Linear, and
  q / k / v fused into c_attn.
* Rotary embeddings: our model uses HF Llama's "rotate_half" layout (see rope.py), so the q / k
  projection rows map over unchanged; no permutation as for Meta's original interleaved weights.
* A tied model has no lm_head tensor; HF files of tied models may still carry one, which is dropped.
"""

from __future__ import annotations

import re

import torch

from .model import ModelConfig
from .rope import normalize_rope_scaling

SUPPORTED_ARCHITECTURES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM",
                           "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}

# ours -> HF, "{i}" is the layer index. Llama, Mistral and Qwen2 share it (absent biases are skipped).
_LLAMA_KEYS = {
    "embed.weight": "model.embed_tokens.weight",
    "final_norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
    "blocks.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blocks.{i}.mlp_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    **{f"blocks.{{i}}.attn.{p}_proj.{t}": f"model.layers.{{i}}.self_attn.{p}_proj.{t}"
       for p in "qkvo" for t in ("weight", "bias")},
    **{f"blocks.{{i}}.mlp.{p}_proj.{t}": f"model.layers.{{i}}.mlp.{p}_proj.{t}"
       for p in ("gate", "up", "down") for t in ("weight", "bias")},
}
# GPT-2 without the q / k / v split, which _gpt2_to_ours / _gpt2_from_ours handle.
_GPT2_KEYS = {
    "embed.weight": "transformer.wte.weight",
    "pos_embed.weight": "transformer.wpe.weight",
    "final_norm.weight": "transformer.ln_f.weight",
    "final_norm.bias": "transformer.ln_f.bias",
    "lm_head.weight": "lm_head.weight",
    "blocks.{i}.attn_norm.weight": "transformer.h.{i}.ln_1.weight",
    "blocks.{i}.attn_norm.bias": "transformer.h.{i}.ln_1.bias",
    "blocks.{i}.mlp_norm.weight": "transformer.h.{i}.ln_2.weight",
    "blocks.{i}.mlp_norm.bias": "transformer.h.{i}.ln_2.bias",
    "blocks.{i}.attn.o_proj.weight": "transformer.h.{i}.attn.c_proj.weight",
    "blocks.{i}.attn.o_proj.bias": "transformer.h.{i}.attn.c_proj.bias",
    "blocks.{i}.mlp.up_proj.weight": "transformer.h.{i}.mlp.c_fc.weight",
    "blocks.{i}.mlp.up_proj.bias": "transformer.h.{i}.mlp.c_fc.bias",
    "blocks.{i}.mlp.down_proj.weight": "transformer.h.{i}.mlp.c_proj.weight",
    "blocks.{i}.mlp.down_proj.bias": "transformer.h.{i}.mlp.c_proj.bias",
}
_CONV1D_SUFFIXES = (".c_attn.weight", ".c_proj.weight", ".c_fc.weight")
# Buffers some HF checkpoints carry that are recomputed rather than learned.
_KNOWN_BUFFER = re.compile(r"(\.attn\.bias|\.attn\.masked_bias|\.rotary_emb\.inv_freq)$")


def _expand(key_map: dict, n_layer: int) -> dict:
    expanded = {}
    for ours, theirs in key_map.items():
        layers = range(n_layer) if "{i}" in ours else [None]
        for i in layers:
            expanded[ours.format(i=i)] = theirs.format(i=i)
    return expanded


def _hf_type(hf: dict) -> str:
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_ARCHITECTURES:
        architectures = hf.get("architectures") or []
        raise ValueError(f"unsupported Hugging Face architecture {model_type!r} ({', '.join(architectures) or '?'}); "
                         f"supported: {', '.join(f'{t} ({a})' for t, a in SUPPORTED_ARCHITECTURES.items())}")
    return model_type


# --- config.json ---

def config_from_hf(hf: dict) -> ModelConfig:
    """Our ModelConfig from a Hugging Face config.json dict (transformers 4.x or 5.x field names)."""
    try:
        return _config_from_hf(hf, _hf_type(hf))
    except KeyError as err:
        raise ValueError(f"Hugging Face config lacks the required field {err.args[0]!r}") from None


def _config_from_hf(hf: dict, model_type: str) -> ModelConfig:
    if model_type == "gpt2":
        activation = hf.get("activation_function", "gelu_new")
        if activation not in ("gelu_new", "gelu_pytorch_tanh"):
            raise ValueError(f"gpt2 activation_function={activation!r}: only the tanh GELU is supported")
        if hf.get("scale_attn_by_inverse_layer_idx") or hf.get("scale_attn_weights") is False:
            raise ValueError("gpt2 with scale_attn_by_inverse_layer_idx or without scale_attn_weights is not supported")
        d_model = hf.get("n_embd", 768)
        return ModelConfig(family="gpt2", vocab_size=hf["vocab_size"], d_model=d_model, n_layer=hf["n_layer"],
                           n_head=hf["n_head"], d_ff=hf.get("n_inner") or 4 * d_model,
                           max_seq_len=hf.get("n_positions", 1024), norm="layernorm",
                           norm_eps=hf.get("layer_norm_epsilon", 1e-5), mlp="gelu", pos="learned",
                           qkv_bias=True, o_bias=True, mlp_bias=True,
                           tie_embeddings=hf.get("tie_word_embeddings", True))
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{model_type} hidden_act={hf['hidden_act']!r}: only silu (SwiGLU) is supported")
    max_seq_len = hf.get("max_position_embeddings", 2048)
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    rope_theta = rope.pop("rope_theta", None) or hf.get("rope_theta", 10000.0)
    n_head = hf["num_attention_heads"]
    attention_bias = hf.get("attention_bias", False)
    fields = dict(family=model_type, vocab_size=hf["vocab_size"], d_model=hf["hidden_size"],
                  n_layer=hf["num_hidden_layers"], n_head=n_head,
                  n_kv_head=hf.get("num_key_value_heads") or n_head,
                  head_dim=hf.get("head_dim") or hf["hidden_size"] // n_head, d_ff=hf["intermediate_size"],
                  max_seq_len=max_seq_len, norm="rmsnorm", norm_eps=hf.get("rms_norm_eps", 1e-6), mlp="swiglu",
                  pos="rope", rope_theta=float(rope_theta), rope_scaling=normalize_rope_scaling(rope, max_seq_len),
                  qkv_bias=attention_bias, o_bias=attention_bias, mlp_bias=hf.get("mlp_bias", False),
                  tie_embeddings=hf.get("tie_word_embeddings", False))
    if model_type == "mistral":
        fields["sliding_window"] = hf.get("sliding_window")
    elif model_type == "qwen2":
        fields.update(qkv_bias=True, o_bias=False, sliding_window=_qwen2_sliding_window(hf))
    return ModelConfig(**fields)


def _qwen2_sliding_window(hf: dict):
    window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
    n_layer = hf["num_hidden_layers"]
    layer_types = hf.get("layer_types") or [
        "sliding_attention" if window is not None and i >= hf.get("max_window_layers", 28) else "full_attention"
        for i in range(n_layer)]
    if all(t == "full_attention" for t in layer_types):
        return None
    if all(t == "sliding_attention" for t in layer_types):
        return window
    raise ValueError("qwen2 with sliding windows on only some layers (max_window_layers / layer_types) "
                     "is not supported")


def _check_exportable(cfg: ModelConfig) -> None:
    family = cfg.family
    needs = {"norm": "rmsnorm", "mlp": "swiglu", "pos": "rope", "attn_softcap": 0.0}
    if family == "gpt2":
        needs = {"norm": "layernorm", "mlp": "gelu", "pos": "learned", "attn_softcap": 0.0, "qkv_bias": True,
                 "o_bias": True, "mlp_bias": True, "n_kv_head": cfg.n_head, "head_dim": cfg.d_model // cfg.n_head,
                 "sliding_window": None}
    elif family == "llama":
        needs.update(o_bias=cfg.qkv_bias, sliding_window=None)
    elif family == "mistral":
        needs.update(qkv_bias=False, o_bias=False, mlp_bias=False)
    elif family == "qwen2":
        needs.update(qkv_bias=True, o_bias=False, mlp_bias=False, head_dim=cfg.d_model // cfg.n_head)
    wrong = [f"{key}={getattr(cfg, key)!r} (needs {value!r})"
             for key, value in needs.items() if getattr(cfg, key) != value]
    if wrong:
        raise ValueError(f"cannot export family={family!r} to Hugging Face: {'; '.join(wrong)}")


def config_to_hf(cfg: ModelConfig, dtype: torch.dtype) -> dict:
    """A Hugging Face config.json dict for ``cfg`` (readable by transformers 4.x and 5.x)."""
    _check_exportable(cfg)
    common = {"architectures": [SUPPORTED_ARCHITECTURES[cfg.family]], "model_type": cfg.family,
              "vocab_size": cfg.vocab_size, "tie_word_embeddings": cfg.tie_embeddings,
              "dtype": str(dtype).removeprefix("torch."),
              # Token ids belong to the tokenizer, which the model config does not know (GPT-2's default 50256
              # would be wrong for other vocabularies).
              "bos_token_id": None, "eos_token_id": None}
    if cfg.family == "gpt2":
        return {**common, "n_embd": cfg.d_model, "n_layer": cfg.n_layer, "n_head": cfg.n_head, "n_inner": cfg.d_ff,
                "n_positions": cfg.max_seq_len, "layer_norm_epsilon": cfg.norm_eps,
                "activation_function": "gelu_new"}
    scaling = normalize_rope_scaling(cfg.rope_scaling, cfg.max_seq_len)
    hf = {**common, "hidden_size": cfg.d_model, "num_hidden_layers": cfg.n_layer, "num_attention_heads": cfg.n_head,
          "num_key_value_heads": cfg.n_kv_head, "head_dim": cfg.head_dim, "intermediate_size": cfg.d_ff,
          "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps, "hidden_act": "silu",
          # transformers 5 reads rope_parameters; 4.x reads rope_theta + rope_scaling.
          "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta, **(scaling or {})},
          "rope_theta": cfg.rope_theta, "rope_scaling": scaling}
    if cfg.family == "llama":
        hf.update(attention_bias=cfg.qkv_bias, mlp_bias=cfg.mlp_bias)
    elif cfg.family == "mistral":
        hf.update(sliding_window=cfg.sliding_window)
    elif cfg.family == "qwen2":
        sliding = cfg.sliding_window is not None
        hf.update(use_sliding_window=sliding, sliding_window=cfg.sliding_window, max_window_layers=0,
                  layer_types=[("sliding_attention" if sliding else "full_attention")] * cfg.n_layer)
        del hf["head_dim"]  # Qwen2 derives it from hidden_size / num_attention_heads
    return hf


# --- weights ---

def _qkv_sizes(cfg: ModelConfig):
    return [cfg.n_head * cfg.head_dim, cfg.n_kv_head * cfg.head_dim, cfg.n_kv_head * cfg.head_dim]


def state_dict_from_hf(tensors: dict, cfg: ModelConfig) -> dict:
    """Rename (and for GPT-2 transpose / split) HF tensors to our names.

    Tensors that no rule covers keep their HF names, so that the loader reports them as unexpected;
    recomputed buffers (GPT-2 attn.bias, rotary inv_freq) and a tied model's lm_head are dropped.
    """
    prefix = "transformer." if cfg.family == "gpt2" else "model."
    renamed = {}
    for key, tensor in tensors.items():
        if _KNOWN_BUFFER.search(key):
            continue
        if key != "lm_head.weight" and not key.startswith(prefix):
            key = prefix + key  # checkpoints of the bare base model (GPT2Model, LlamaModel)
        renamed[key] = tensor
    if cfg.tie_embeddings:
        renamed.pop("lm_head.weight", None)
    key_map = _expand(_GPT2_KEYS if cfg.family == "gpt2" else _LLAMA_KEYS, cfg.n_layer)
    ours = {}
    for our_key, hf_key in key_map.items():
        if hf_key in renamed:
            tensor = renamed.pop(hf_key)
            ours[our_key] = tensor.t() if hf_key.endswith(_CONV1D_SUFFIXES) else tensor
    if cfg.family == "gpt2":
        for i in range(cfg.n_layer):
            for kind in ("weight", "bias"):
                fused = renamed.pop(f"transformer.h.{i}.attn.c_attn.{kind}", None)
                if fused is None:
                    continue
                fused = fused.t() if kind == "weight" else fused
                if fused.shape[0] != sum(_qkv_sizes(cfg)):
                    ours[f"blocks.{i}.attn.c_attn.{kind}"] = fused  # reported as unexpected
                    continue
                for name, part in zip("qkv", torch.split(fused, _qkv_sizes(cfg), dim=0)):
                    ours[f"blocks.{i}.attn.{name}_proj.{kind}"] = part
    return {**ours, **renamed}


def state_dict_to_hf(tensors: dict, cfg: ModelConfig) -> dict:
    """Our tensors under HF names (GPT-2: fused and transposed to Conv1D), contiguous for safetensors."""
    _check_exportable(cfg)
    tensors = dict(tensors)
    hf = {}
    if cfg.family == "gpt2":
        for i in range(cfg.n_layer):
            for kind in ("weight", "bias"):
                fused = torch.cat([tensors.pop(f"blocks.{i}.attn.{p}_proj.{kind}") for p in "qkv"], dim=0)
                hf[f"transformer.h.{i}.attn.c_attn.{kind}"] = fused.t() if kind == "weight" else fused
    key_map = _expand(_GPT2_KEYS if cfg.family == "gpt2" else _LLAMA_KEYS, cfg.n_layer)
    for our_key, tensor in tensors.items():
        if our_key not in key_map:
            raise ValueError(f"no Hugging Face name for tensor {our_key!r} of family {cfg.family!r}")
        hf_key = key_map[our_key]
        hf[hf_key] = tensor.t() if hf_key.endswith(_CONV1D_SUFFIXES) else tensor
    return {key: tensor.contiguous() for key, tensor in hf.items()}
