"""Hugging Face <-> flashformer: config.json fields and weight names, both ways, per architecture.

Supported (family: HF class): gpt2 (GPT2LMHeadModel), llama (LlamaForCausalLM), mistral
(MistralForCausalLM), qwen2 (Qwen2ForCausalLM), qwen3 (Qwen3ForCausalLM), gemma2 (Gemma2ForCausalLM),
gemma3 (Gemma3ForCausalLM, model_type gemma3_text), phi3 (Phi3ForCausalLM), olmo2 (Olmo2ForCausalLM).
The key maps below are explicit tables, one row per tensor.

* GPT-2 stores its projections as Conv1D, weight (in, out): transposed against nn.Linear, and
  q / k / v fused into c_attn. Phi-3 fuses q / k / v into qkv_proj and gate / up into gate_up_proj.
  Fused tensors are split on load and concatenated again on export.
* The norms around each sublayer have per-architecture names: Llama's post_attention_layernorm is
  the norm before the MLP, Gemma's and OLMo 2's the norm after attention.
* Rotary embeddings: our model uses HF Llama's "rotate_half" layout (see rope.py), so the q / k
  projection rows map over unchanged; no permutation as for Meta's original interleaved weights.
* A tied model has no lm_head tensor; HF files of tied models may still carry one, which is dropped.
"""

from __future__ import annotations

import re

import torch

from .families import default_layer_types
from .model_config import ModelConfig
from .rope import normalize_rope_scaling

SUPPORTED_ARCHITECTURES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM",
                           "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                           "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
                           "phi3": "Phi3ForCausalLM", "olmo2": "Olmo2ForCausalLM"}
# HF model_type -> our family, where they differ.
_FAMILY_OF = {"gemma3_text": "gemma3"}
_MODEL_TYPE_OF = {family: model_type for model_type, family in _FAMILY_OF.items()}
_HF_LAYER_TYPE = {"full": "full_attention", "sliding": "sliding_attention"}

# ours -> HF, "{i}" is the layer index, for every family but GPT-2 (absent tensors are skipped).
_DECODER_KEYS = {
    "embed.weight": "model.embed_tokens.weight",
    "final_norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
    **{f"blocks.{{i}}.attn.{p}_proj.{t}": f"model.layers.{{i}}.self_attn.{p}_proj.{t}"
       for p in "qkvo" for t in ("weight", "bias")},
    **{f"blocks.{{i}}.attn.{p}_norm.weight": f"model.layers.{{i}}.self_attn.{p}_norm.weight" for p in "qk"},
    **{f"blocks.{{i}}.mlp.{p}_proj.{t}": f"model.layers.{{i}}.mlp.{p}_proj.{t}"
       for p in ("gate", "up", "down") for t in ("weight", "bias")},
}
# Our four sublayer norms under each norm_placement's HF names.
_NORM_KEYS = {
    "pre": {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"},
    "post": {"attn_post_norm": "post_attention_layernorm", "mlp_post_norm": "post_feedforward_layernorm"},
    "both": {"attn_norm": "input_layernorm", "attn_post_norm": "post_attention_layernorm",
             "mlp_norm": "pre_feedforward_layernorm", "mlp_post_norm": "post_feedforward_layernorm"},
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
        cfg = _config_from_hf(hf, _hf_type(hf))
        cfg.validate()
        return cfg
    except KeyError as err:
        raise ValueError(f"Hugging Face config lacks the required field {err.args[0]!r}") from None


def _config_from_hf(hf: dict, model_type: str) -> ModelConfig:
    family = _FAMILY_OF.get(model_type, model_type)
    if family == "gpt2":
        activation = hf.get("activation_function", "gelu_new")
        if activation not in ("gelu_new", "gelu_pytorch_tanh"):
            raise ValueError(f"gpt2 activation_function={activation!r}: only the tanh GELU is supported")
        if hf.get("scale_attn_by_inverse_layer_idx") or hf.get("scale_attn_weights") is False:
            raise ValueError("gpt2 with scale_attn_by_inverse_layer_idx or without scale_attn_weights is not supported")
        d_model = hf.get("n_embd", 768)
        return ModelConfig(family="gpt2", vocab_size=hf["vocab_size"], d_model=d_model, n_layer=hf["n_layer"],
                           n_head=hf["n_head"], d_ff=hf.get("n_inner") or 4 * d_model,
                           max_seq_len=hf.get("n_positions", 1024), norm_eps=hf.get("layer_norm_epsilon", 1e-5),
                           tie_embeddings=hf.get("tie_word_embeddings", True))
    gemma = family in ("gemma2", "gemma3")
    activation = hf.get("hidden_activation") or hf.get("hidden_act") or ("gelu_pytorch_tanh" if gemma else "silu")
    expected = ("gelu_pytorch_tanh", "gelu_new") if gemma else ("silu",)
    if activation not in expected:
        key = "hidden_activation" if gemma else "hidden_act"
        raise ValueError(f"{model_type} {key}={activation!r}: only {expected[0]} is supported")
    if hf.get("use_bidirectional_attention"):
        raise ValueError(f"{model_type} use_bidirectional_attention=True is not supported (causal models only)")
    max_seq_len = hf.get("max_position_embeddings", 2048)
    n_head = hf["num_attention_heads"]
    attention_bias = hf.get("attention_bias", False)
    fields = dict(family=family, vocab_size=hf["vocab_size"], d_model=hf["hidden_size"],
                  n_layer=hf["num_hidden_layers"], n_head=n_head,
                  n_kv_head=hf.get("num_key_value_heads") or n_head,
                  head_dim=hf.get("head_dim") or hf["hidden_size"] // n_head, d_ff=hf["intermediate_size"],
                  max_seq_len=max_seq_len, norm_eps=hf.get("rms_norm_eps", 1e-6),
                  qkv_bias=attention_bias, o_bias=attention_bias, tie_embeddings=hf.get("tie_word_embeddings"),
                  **_rope_from_hf(hf, family, max_seq_len))
    if family == "llama":
        fields["mlp_bias"] = hf.get("mlp_bias", False)
    elif family in ("mistral", "phi3"):
        fields["sliding_window"] = hf.get("sliding_window")
    elif family in ("qwen2", "qwen3"):
        if family == "qwen2":
            fields.update(qkv_bias=True, o_bias=False)
        window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
        types = _layer_types_from_hf(hf, family, window, [
            "sliding_attention" if window is not None and i >= hf.get("max_window_layers", 28) else "full_attention"
            for i in range(hf["num_hidden_layers"])])
        if types is not None and "sliding" not in types:  # max_window_layers >= num_hidden_layers: no window
            window, types = None, None
        fields.update(sliding_window=window, layer_types=types)
    elif gemma:
        # null disables a softcap; a missing key means the family's default (Gemma 2: 50 / 30, Gemma 3: none)
        softcaps = {name: float(hf[key] or 0.0) for name, key in (("attn_softcap", "attn_logit_softcapping"),
                                                                   ("logit_softcap", "final_logit_softcapping"))
                    if key in hf}
        window = hf.get("sliding_window")
        fields.update(sliding_window=window, query_pre_attn_scalar=int(hf.get("query_pre_attn_scalar", 256)),
                      layer_types=_layer_types_from_hf(hf, family, window), **softcaps)
    return ModelConfig(**fields)


def _rope_from_hf(hf: dict, family: str, max_seq_len: int) -> dict:
    """rope_theta, rope_scaling, partial_rotary_factor (and Gemma 3's rope_local_theta) from transformers 5's
    rope_parameters or 4.x's rope_theta / rope_scaling / partial_rotary_factor (/ rope_local_base_freq)."""
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    local_theta = None
    if "full_attention" in rope:  # per layer type (Gemma 3): scaling on the full layers only
        local = dict(rope.get("sliding_attention") or {})
        local_theta = local.pop("rope_theta", None)
        if normalize_rope_scaling(local, max_seq_len) is not None:
            raise ValueError(f"{family} rope_parameters.sliding_attention: only the default rope_type is supported")
        rope = dict(rope["full_attention"] or {})
    elif family == "gemma3":
        local_theta = hf.get("rope_local_base_freq")
    rope_theta = rope.pop("rope_theta", None) or hf.get("rope_theta") or (1e6 if family == "gemma3" else 10000.0)
    # transformers reads the value inside the rope dict first, then the top-level field (4.x's only place).
    partial = rope.pop("partial_rotary_factor", None)
    if partial is None:
        partial = hf.get("partial_rotary_factor")
    if partial is None:
        partial = 1.0
    rope_type = rope.get("rope_type", rope.get("type"))
    if rope_type in (None, "default"):
        rope.pop("original_max_position_embeddings", None)  # Phi-3 repeats it; without scaling it means nothing
    elif family == "phi3":
        # As Phi3Config: older checkpoints' "su" and "yarn" are LongRoPE, and its own field (4096 unless given)
        # overrides the rope dict's original context (transformers 4.x configs, Phi-4-mini's, hold only that one).
        rope.pop("type", None)
        rope["rope_type"] = "longrope" if rope_type in ("su", "yarn") else rope_type
        rope["original_max_position_embeddings"] = hf.get("original_max_position_embeddings", 4096)
    fields = dict(rope_theta=float(rope_theta), rope_scaling=normalize_rope_scaling(rope, max_seq_len),
                  partial_rotary_factor=partial)
    if family == "gemma3":
        fields["rope_local_theta"] = float(local_theta or 10000.0)
    return fields


def _layer_types_from_hf(hf: dict, family: str, window, fallback=None):
    """Our layer_types from HF's (sliding_attention / full_attention): None when the family's default
    pattern gives the same, so that configs stay short and survive a round trip."""
    hf_types = hf.get("layer_types") or fallback
    if hf_types is None:
        return None
    ours = {value: key for key, value in _HF_LAYER_TYPE.items()}
    unknown = sorted(set(hf_types) - set(ours))
    if unknown:
        raise ValueError(f"{family} layer_types: unsupported {unknown}; supported: {sorted(ours)}")
    if len(hf_types) != hf["num_hidden_layers"]:
        raise ValueError(f"{family} layer_types has {len(hf_types)} entries for {hf['num_hidden_layers']} layers")
    types = tuple(ours[t] for t in hf_types)
    if window is None:
        if "sliding" in types:
            raise ValueError(f"{family} layer_types has sliding_attention layers but no sliding_window")
        return None
    return None if types == default_layer_types(family, len(types), window) else types


def config_to_hf(cfg: ModelConfig, dtype: torch.dtype) -> dict:
    """A Hugging Face config.json dict for ``cfg`` (readable by transformers 4.x and 5.x)."""
    cfg.validate()  # the family check guarantees the HF architecture can express cfg
    if cfg.family == "custom":
        raise ValueError("family='custom' has no Hugging Face architecture; export needs one of "
                         f"{', '.join(_FAMILY_OF.get(t, t) for t in SUPPORTED_ARCHITECTURES)}")
    model_type = _MODEL_TYPE_OF.get(cfg.family, cfg.family)
    common = {"architectures": [SUPPORTED_ARCHITECTURES[model_type]], "model_type": model_type,
              "vocab_size": cfg.vocab_size, "tie_word_embeddings": cfg.tie_embeddings,
              "dtype": str(dtype).removeprefix("torch."),
              # Token ids belong to the tokenizer, which the model config does not know (GPT-2's default 50256
              # would be wrong for other vocabularies).
              "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
    if cfg.family == "gpt2":
        return {**common, "n_embd": cfg.d_model, "n_layer": cfg.n_layer, "n_head": cfg.n_head, "n_inner": cfg.d_ff,
                "n_positions": cfg.max_seq_len, "layer_norm_epsilon": cfg.norm_eps,
                "activation_function": "gelu_new"}
    scaling = normalize_rope_scaling(cfg.rope_scaling, cfg.max_seq_len)
    rope_parameters = {"rope_type": "default", "rope_theta": cfg.rope_theta, **(scaling or {})}
    hf = {**common, "hidden_size": cfg.d_model, "num_hidden_layers": cfg.n_layer, "num_attention_heads": cfg.n_head,
          "num_key_value_heads": cfg.n_kv_head, "head_dim": cfg.head_dim, "intermediate_size": cfg.d_ff,
          "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps, "hidden_act": "silu",
          # transformers 5 reads rope_parameters; 4.x reads rope_theta + rope_scaling.
          "rope_parameters": rope_parameters, "rope_theta": cfg.rope_theta, "rope_scaling": scaling,
          "attention_bias": cfg.qkv_bias}
    hf_layer_types = [_HF_LAYER_TYPE[kind] for kind in cfg.layer_kinds()]
    if cfg.family == "llama":
        hf["mlp_bias"] = cfg.mlp_bias
    elif cfg.family in ("mistral", "phi3"):
        hf["sliding_window"] = cfg.sliding_window
    elif cfg.family in ("qwen2", "qwen3"):
        sliding = cfg.sliding_window is not None and "sliding_attention" in hf_layer_types
        leading_full = next((i for i, t in enumerate(hf_layer_types) if t == "sliding_attention"), cfg.n_layer)
        hf.update(use_sliding_window=sliding, sliding_window=cfg.sliding_window if sliding else None,
                  max_window_layers=leading_full, layer_types=hf_layer_types)
    elif cfg.family in ("gemma2", "gemma3"):
        del hf["hidden_act"]
        hf.update(hidden_activation="gelu_pytorch_tanh", sliding_window=cfg.sliding_window,
                  layer_types=hf_layer_types, query_pre_attn_scalar=cfg.query_pre_attn_scalar or cfg.head_dim,
                  attn_logit_softcapping=cfg.attn_softcap or None, final_logit_softcapping=cfg.logit_softcap or None)
        if cfg.family == "gemma3":
            local = {"rope_type": "default", "rope_theta": cfg.rope_local_theta}
            hf.update(rope_parameters={"full_attention": rope_parameters, "sliding_attention": local},
                      rope_local_base_freq=cfg.rope_local_theta)
    if cfg.family == "phi3":
        # transformers 5 reads the rope dict, where rope_scaling (no partial_rotary_factor key) wins, then this field.
        rope_parameters["partial_rotary_factor"] = hf["partial_rotary_factor"] = cfg.partial_rotary_factor
    if cfg.family == "phi3" and scaling and "original_max_position_embeddings" in scaling:
        # Phi3Config's own field overrides the one inside rope_parameters (LongRoPE's switch point).
        hf["original_max_position_embeddings"] = scaling["original_max_position_embeddings"]
    if cfg.family in ("qwen2", "phi3"):
        del hf["head_dim"]  # both derive it from hidden_size / num_attention_heads
    if cfg.family in ("qwen2", "phi3", "mistral"):
        del hf["attention_bias"]  # fixed by the architecture
    return hf


# --- weights ---

def _qkv_sizes(cfg: ModelConfig):
    return [cfg.n_head * cfg.head_dim, cfg.n_kv_head * cfg.head_dim, cfg.n_kv_head * cfg.head_dim]


def _key_map(cfg: ModelConfig) -> dict:
    """Every (unfused) tensor of ours -> its HF name, layers expanded."""
    if cfg.family == "gpt2":
        return _expand(_GPT2_KEYS, cfg.n_layer)
    keys = dict(_DECODER_KEYS)
    for ours, theirs in _NORM_KEYS[cfg.norm_placement].items():
        keys[f"blocks.{{i}}.{ours}.weight"] = f"model.layers.{{i}}.{theirs}.weight"
    return _expand(keys, cfg.n_layer)


def _fused(cfg: ModelConfig) -> dict:
    """HF tensors that concatenate several of ours along dim 0: {hf_key: [(our_key, rows), ...]}."""
    fused = {}
    for i in range(cfg.n_layer):
        if cfg.family == "gpt2":
            for kind in ("weight", "bias"):
                fused[f"transformer.h.{i}.attn.c_attn.{kind}"] = [
                    (f"blocks.{i}.attn.{p}_proj.{kind}", rows) for p, rows in zip("qkv", _qkv_sizes(cfg))]
        elif cfg.family == "phi3":
            fused[f"model.layers.{i}.self_attn.qkv_proj.weight"] = [
                (f"blocks.{i}.attn.{p}_proj.weight", rows) for p, rows in zip("qkv", _qkv_sizes(cfg))]
            fused[f"model.layers.{i}.mlp.gate_up_proj.weight"] = [
                (f"blocks.{i}.mlp.{p}_proj.weight", cfg.d_ff) for p in ("gate", "up")]
    return fused


def state_dict_from_hf(tensors: dict, cfg: ModelConfig) -> dict:
    """Rename (and for GPT-2 transpose, for GPT-2 and Phi-3 split) HF tensors to our names.

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
        renamed[key] = tensor.t() if key.endswith(_CONV1D_SUFFIXES) else tensor
    if cfg.tie_embeddings:
        renamed.pop("lm_head.weight", None)
    ours = {}
    for hf_key, parts in _fused(cfg).items():
        tensor = renamed.get(hf_key)
        if tensor is None or tensor.shape[0] != sum(rows for _, rows in parts):
            continue  # absent or misshapen: reported by the loader under its HF name
        del renamed[hf_key]
        ours.update((key, part) for (key, _), part in zip(parts, torch.split(tensor, [r for _, r in parts])))
    for our_key, hf_key in _key_map(cfg).items():
        if hf_key in renamed:
            ours[our_key] = renamed.pop(hf_key)
    return {**ours, **renamed}


def state_dict_to_hf(tensors: dict, cfg: ModelConfig) -> dict:
    """Our tensors under HF names (GPT-2 and Phi-3 fused, GPT-2 transposed to Conv1D), contiguous for safetensors."""
    config_to_hf(cfg, torch.float32)  # refuses what HF cannot express
    tensors = dict(tensors)
    hf = {}
    for hf_key, parts in _fused(cfg).items():
        hf[hf_key] = torch.cat([tensors.pop(key) for key, _ in parts], dim=0)
    key_map = _key_map(cfg)
    for our_key, tensor in tensors.items():
        if our_key not in key_map:
            raise ValueError(f"no Hugging Face name for tensor {our_key!r} of family {cfg.family!r}")
        hf[key_map[our_key]] = tensor
    return {key: (tensor.t() if key.endswith(_CONV1D_SUFFIXES) else tensor).contiguous() for key, tensor in hf.items()}
