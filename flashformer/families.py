"""Family presets: what GPT-2, Llama, Qwen, Gemma, Phi-3 and OLMo 2 fix and what they default.

A ModelConfig names its ``family``; every architecture field the config leaves unset (None) takes
the family's value, so ``family: gemma2`` plus sizes builds a Gemma 2, not a Llama with a Gemma
label. A family also pins the fields its Hugging Face architecture cannot express differently:
an explicit contradicting value (``family: gpt2`` with ``norm: rmsnorm``) is refused, naming the
field, rather than built into a model that no longer is that family. Sizes (vocab_size, d_model,
n_layer, heads, d_ff, max_seq_len) are never part of a family. ``family: custom`` fixes nothing:
any combination of fields, on the plain Llama defaults, with no Hugging Face export.
"""

from __future__ import annotations

FAMILY_NAMES = ("gpt2", "llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "olmo2", "custom")

# The architecture of a plain pre-norm Llama; every family starts from it.
_BASE = dict(norm="rmsnorm", norm_eps=1e-5, norm_placement="pre", mlp="swiglu", pos="rope", rope_theta=10000.0,
             rope_local_theta=None, partial_rotary_factor=1.0, qkv_bias=False, o_bias=False, mlp_bias=False,
             qk_norm="none", scale_embeddings=False, tie_embeddings=False, sliding_window=None, layer_types=None,
             attn_softcap=0.0, logit_softcap=0.0, query_pre_attn_scalar=None)
ARCH_FIELDS = tuple(_BASE)

# Fields every family leaves to the checkpoint: numbers its HF config.json carries.
_ALWAYS_FREE = {"norm_eps", "rope_theta", "tie_embeddings"}

# family -> (its values where they differ from _BASE, the further fields a config may set freely).
_FAMILIES = {
    "gpt2": (dict(norm="layernorm", mlp="gelu", pos="learned", qkv_bias=True, o_bias=True, mlp_bias=True,
                  tie_embeddings=True), set()),
    # HF Llama's attention_bias covers q, k, v and o alike; _family_rules ties o_bias to qkv_bias.
    "llama": ({}, {"qkv_bias", "o_bias", "mlp_bias"}),
    "mistral": ({}, {"sliding_window"}),
    "qwen2": (dict(norm_eps=1e-6, qkv_bias=True), {"sliding_window", "layer_types"}),
    "qwen3": (dict(norm_eps=1e-6, qk_norm="per_head"), {"qkv_bias", "o_bias", "sliding_window", "layer_types"}),
    "gemma2": (dict(norm="offset_rmsnorm", norm_eps=1e-6, norm_placement="both", mlp="geglu", scale_embeddings=True,
                    tie_embeddings=True, sliding_window=4096, attn_softcap=50.0, logit_softcap=30.0),
               {"qkv_bias", "o_bias", "sliding_window", "layer_types", "attn_softcap", "logit_softcap",
                "query_pre_attn_scalar"}),
    "gemma3": (dict(norm="offset_rmsnorm", norm_eps=1e-6, norm_placement="both", mlp="geglu", scale_embeddings=True,
                    tie_embeddings=True, sliding_window=4096, qk_norm="per_head", rope_theta=1_000_000.0,
                    rope_local_theta=10000.0),
               {"qkv_bias", "o_bias", "sliding_window", "layer_types", "attn_softcap", "logit_softcap",
                "query_pre_attn_scalar", "rope_local_theta"}),
    # Of our families only transformers' Phi-3 honours partial_rotary_factor (Phi-4-mini: 0.75).
    "phi3": ({}, {"sliding_window", "partial_rotary_factor"}),
    "olmo2": (dict(norm_eps=1e-6, norm_placement="post", qk_norm="across_heads"), {"qkv_bias", "o_bias"}),
    "custom": ({}, set(_BASE)),
}

# Families whose default layer pattern mixes sliding and full layers: every n-th layer is full.
GLOBAL_LAYER_EVERY = {"gemma2": 2, "gemma3": 6}


def family_defaults(family: str) -> dict:
    """Every architecture field's value for ``family`` (unknown families get the plain Llama ones)."""
    values, _ = _FAMILIES.get(family, ({}, set()))
    return {**_BASE, **values}


def free_fields(family: str) -> set:
    """Architecture fields a config of ``family`` may set to any valid value."""
    return _ALWAYS_FREE | _FAMILIES.get(family, ({}, set()))[1]


def default_layer_types(family: str, n_layer: int, sliding_window) -> tuple:
    """("full" | "sliding",) * n_layer when a config gives no layer_types."""
    every = GLOBAL_LAYER_EVERY.get(family)
    if sliding_window is None:
        return ("full",) * n_layer
    if every is None:
        return ("sliding",) * n_layer
    return tuple("full" if (i + 1) % every == 0 else "sliding" for i in range(n_layer))


def family_rules(cfg) -> dict:
    """Fields whose required value depends on other fields of ``cfg``: {field: (value, why)}."""
    rules = {}
    if cfg.family == "gpt2":
        rules["n_kv_head"] = (cfg.n_head, "GPT-2 has one K/V head per query head")
        rules["head_dim"] = (cfg.d_model // cfg.n_head, "GPT-2's heads split d_model")
    if cfg.family in ("llama", "qwen3", "gemma2", "gemma3", "olmo2"):
        rules["o_bias"] = (cfg.qkv_bias, "its attention_bias covers q, k, v and o alike")
    if cfg.family in ("qwen2", "phi3"):
        rules["head_dim"] = (cfg.d_model // cfg.n_head, "its head_dim is d_model // n_head")
    return rules


def check_family(cfg) -> None:
    """Raise ValueError naming the first field of ``cfg`` (resolved by ModelConfig) that contradicts
    its family. An unset field holds the family's value, so only explicit contradictions fail."""
    if cfg.family not in _FAMILIES:
        return  # validate() names the unknown family
    fixed, free = family_defaults(cfg.family), free_fields(cfg.family)
    for name in ARCH_FIELDS:
        value = getattr(cfg, name)
        if name not in free and value != fixed[name]:
            raise ValueError(f"{name}={value!r} contradicts family={cfg.family!r}, whose architecture has "
                             f"{name}={fixed[name]!r}; leave {name} unset or choose another family")
    for name, (value, why) in family_rules(cfg).items():
        if getattr(cfg, name) != value:
            raise ValueError(f"{name}={getattr(cfg, name)!r} contradicts family={cfg.family!r}: {why} "
                             f"({name}={value!r})")
