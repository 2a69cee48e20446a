"""Parity with Hugging Face transformers: loading their checkpoints, exporting ours, RoPE scalings."""

import copy
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

import flashformer  # noqa: E402
from flashformer.checkpoint import CheckpointError  # noqa: E402
from flashformer.config import load_config  # noqa: E402
from flashformer.generate import generate  # noqa: E402
from flashformer.hf import config_from_hf, config_to_hf, state_dict_to_hf  # noqa: E402
from flashformer.model import ModelConfig, Transformer  # noqa: E402
from flashformer.rope import rope_frequencies  # noqa: E402
from transformers import (AutoConfig, AutoModelForCausalLM, Gemma2Config, Gemma3TextConfig, GPT2Config,  # noqa: E402
                          LlamaConfig, MistralConfig, Olmo2Config, Phi3Config, Qwen2Config, Qwen3Config)
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

VOCAB, SEQLEN, NEW_TOKENS = 113, 24, 16
COMMON = dict(vocab_size=VOCAB, bos_token_id=None, eos_token_id=None, pad_token_id=None)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}
HF_CONFIGS = {
    "gpt2": lambda: GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=64, **COMMON),
    "llama-gqa-llama3-untied": lambda: LlamaConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, rope_theta=5000.0, rope_scaling=LLAMA3, tie_word_embeddings=False, **COMMON),
    "llama-bias-yarn": lambda: LlamaConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2, head_dim=32,
        max_position_embeddings=64, attention_bias=True, mlp_bias=True, tie_word_embeddings=True,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}, **COMMON),
    "llama-dynamic": lambda: LlamaConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
        max_position_embeddings=16, rope_scaling={"type": "dynamic", "factor": 2.0}, **COMMON),
    "mistral-sliding": lambda: MistralConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
        max_position_embeddings=64, sliding_window=6, **COMMON),
    "qwen2-bias-tied": lambda: Qwen2Config(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, tie_word_embeddings=True, **COMMON),
    # Windows on the layers from max_window_layers up only.
    "qwen2-mixed-window": lambda: Qwen2Config(
        hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, use_sliding_window=True, sliding_window=5, max_window_layers=1, **COMMON),
    "qwen3-qknorm": lambda: Qwen3Config(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, max_position_embeddings=64, tie_word_embeddings=False, **COMMON),
    "qwen3-bias-mixed-window-tied": lambda: Qwen3Config(
        hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1,
        head_dim=16, max_position_embeddings=64, attention_bias=True, use_sliding_window=True, sliding_window=6,
        max_window_layers=2, tie_word_embeddings=True, **COMMON),
    # Small softcaps so that tanh bends the scores; query_pre_attn_scalar != head_dim.
    "gemma2": lambda: Gemma2Config(
        hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, query_pre_attn_scalar=24, max_position_embeddings=64, sliding_window=6,
        attn_logit_softcapping=4.0, final_logit_softcapping=5.0, **COMMON),
    "gemma3-linear-global": lambda: Gemma3TextConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, query_pre_attn_scalar=32, max_position_embeddings=64, sliding_window=6,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 500.0}}, **COMMON),
    "gemma3-default-pattern": lambda: Gemma3TextConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=7, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, query_pre_attn_scalar=16, max_position_embeddings=64, sliding_window=5,
        final_logit_softcapping=8.0, tie_word_embeddings=False, **COMMON),
    "phi3-sliding": lambda: Phi3Config(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, original_max_position_embeddings=64, sliding_window=7, **COMMON),
    # LongRoPE with a 32-token original context: the 24-token prompt takes the short factors; greedy
    # generation passes 32, where the whole sequence is re-encoded with the long ones.
    "phi3-longrope": lambda: Phi3Config(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, original_max_position_embeddings=32,
        rope_scaling={"rope_type": "longrope", "short_factor": [1.0 + 0.05 * i for i in range(8)],
                      "long_factor": [1.0 + 0.5 * i for i in range(8)]}, **COMMON),
    # Phi-4-mini's partial rotary embeddings: the first 24 of each head's 32 dims rotate, 8 pass through.
    "phi3-partial": lambda: Phi3Config(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        max_position_embeddings=64, original_max_position_embeddings=64, partial_rotary_factor=0.75, **COMMON),
    # Phi-4-mini's head: 96 of 128 dims rotate, LongRoPE factor lists of 48; the switch at 32 is crossed.
    "phi3-partial-longrope": lambda: Phi3Config(
        hidden_size=256, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        max_position_embeddings=64, original_max_position_embeddings=32, partial_rotary_factor=0.75,
        rope_scaling={"rope_type": "longrope", "short_factor": [1.0 + 0.02 * i for i in range(48)],
                      "long_factor": [1.0 + 0.2 * i for i in range(48)]}, **COMMON),
    "olmo2": lambda: Olmo2Config(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, **COMMON),
}


def random_hf_model(make_config):
    torch.manual_seed(0)
    config = make_config()
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    with torch.no_grad():  # spread the logits so that greedy decoding has clear winners
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


def hf_greedy(model, input_ids):
    # Past LongRoPE's switch the reference re-encodes every step (no cache): transformers 5.24's cached
    # generation equals that, 5.17's departs from it at the switch (the H200's transformers).
    crosses_switch = getattr(model.config, "original_max_position_embeddings", None) is not None and (
        input_ids.shape[1] + NEW_TOKENS > model.config.original_max_position_embeddings)
    return model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=NEW_TOKENS,
                          min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, use_cache=not crosses_switch)


def assert_same_model(hf_model, ours, input_ids):
    with torch.no_grad():
        hf_logits = hf_model(input_ids).logits
        our_logits = ours(input_ids)
    assert (hf_logits - our_logits).abs().max().item() <= 1e-4
    ours_generated = generate(ours, input_ids, NEW_TOKENS, temperature=0)
    assert torch.equal(ours_generated, hf_greedy(hf_model, input_ids))


@pytest.mark.parametrize("name", list(HF_CONFIGS))
def test_load_hf_checkpoint_and_export_back(name, tmp_path):
    hf_model = random_hf_model(HF_CONFIGS[name])
    hf_model.save_pretrained(tmp_path / "hf")
    input_ids = torch.randint(0, VOCAB, (2, SEQLEN), generator=torch.Generator().manual_seed(1))

    ours = flashformer.from_pretrained(tmp_path / "hf")
    assert_same_model(hf_model, ours, input_ids)

    ours.save_pretrained(tmp_path / "exported", format="hf")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "exported", attn_implementation="eager").eval()
    assert_same_model(reloaded, ours, input_ids)
    assert flashformer.from_pretrained(tmp_path / "exported").config == ours.config


class _RopeConfig:
    """The subset of a transformers config that the rope init functions read."""


@pytest.mark.parametrize("scaling", [
    {"rope_type": "linear", "factor": 3.0},
    {"type": "dynamic", "factor": 2.0},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 16, "beta_slow": 2,
     "mscale": 1.0, "mscale_all_dim": 0.7, "truncate": False},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "attention_factor": 1.3},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 32},
    {"rope_type": "longrope", "original_max_position_embeddings": 64, "short_factor": [1 + i / 32 for i in range(32)],
     "long_factor": [1 + i / 4 for i in range(32)]},
], ids=lambda s: s.get("rope_type", s.get("type")))
@pytest.mark.parametrize("seq_len", [None, 1000])
@pytest.mark.parametrize("partial_rotary_factor", [1.0, 0.5])
def test_rope_scalings_equal_transformers(scaling, seq_len, partial_rotary_factor):
    """Every scaling over head_dim 64, or over the 32 rotated dims of a partial rotary embedding (LongRoPE then
    keeps one factor per rotated pair)."""
    rotary_dim = int(64 * partial_rotary_factor)
    scaling = {key: value[:rotary_dim // 2] if key in ("short_factor", "long_factor") else value
               for key, value in scaling.items()}
    config = LlamaConfig(hidden_size=512, num_attention_heads=8, max_position_embeddings=256, rope_theta=50000.0,
                         rope_scaling={**scaling, "partial_rotary_factor": partial_rotary_factor})
    rope_type = config.rope_parameters["rope_type"]
    hf_inv_freq, hf_factor = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", seq_len=seq_len)
    inv_freq, factor = rope_frequencies(rotary_dim, 50000.0, scaling, max_seq_len=256, seq_len=seq_len)
    torch.testing.assert_close(inv_freq, hf_inv_freq, atol=0, rtol=0)
    assert factor == pytest.approx(hf_factor, rel=1e-12)


@pytest.mark.parametrize("scaling, message", [
    ({"short_factor": [1.0] * 32, "long_factor": [2.0] * 31}, "long_factor has 31 entries; rotary_dim 64 rotates 32"),
    ({"short_factor": [1.0] * 31 + [0.0], "long_factor": [2.0] * 32}, "short_factor must be a list of positive"),
    ({"short_factor": 1.0, "long_factor": [2.0] * 32}, "short_factor must be a list of positive"),
    ({"short_factor": [1.0] * 32}, "missing long_factor"),
])
def test_longrope_factor_lists_are_checked(scaling, message):
    with pytest.raises(ValueError, match=message):
        rope_frequencies(64, 10000.0, {"rope_type": "longrope", **scaling}, max_seq_len=256, seq_len=1000)


def test_unsupported_architecture_names_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "bert", "architectures": ["BertModel"]}')
    with pytest.raises(ValueError, match="unsupported Hugging Face architecture 'bert'.*gpt2.*llama.*mistral.*qwen2"):
        flashformer.from_pretrained(tmp_path)


# Llama 3.1 8B and Llama 3.2 1B / 3B: RoPE base 500k, llama3 scaling from 8k to 128k positions.
LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
LLAMA32_ROPE = {**LLAMA31_ROPE, "factor": 32.0}


@pytest.mark.parametrize("hidden_size, heads, scaling", [(4096, 32, LLAMA31_ROPE), (2048, 32, LLAMA32_ROPE),
                                                          (3072, 24, LLAMA32_ROPE)], ids=["3.1-8B", "3.2-1B", "3.2-3B"])
def test_llama3_rope_of_real_configs_equals_transformers(hidden_size, heads, scaling):
    config = LlamaConfig(hidden_size=hidden_size, num_attention_heads=heads, max_position_embeddings=131072,
                         rope_theta=500000.0, rope_scaling=dict(scaling))
    hf_inv_freq, hf_factor = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    inv_freq, factor = rope_frequencies(hidden_size // heads, 500000.0, scaling, max_seq_len=131072)
    torch.testing.assert_close(inv_freq, hf_inv_freq, atol=0, rtol=0)
    assert factor == hf_factor == 1.0


def test_llama32_shaped_model_equals_transformers_at_long_positions(tmp_path):
    """Head_dim 64 with Llama 3.2's RoPE, evaluated around position 100k, where the scaling matters."""
    hf_model = random_hf_model(lambda: LlamaConfig(
        hidden_size=128, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        head_dim=64, max_position_embeddings=131072, rope_theta=500000.0, rope_scaling=dict(LLAMA32_ROPE),
        tie_word_embeddings=True, **COMMON))
    hf_model.save_pretrained(tmp_path)
    ours = flashformer.from_pretrained(tmp_path)
    assert ours.config.rope_scaling == LLAMA32_ROPE and ours.config.max_seq_len == 131072
    input_ids = torch.randint(0, VOCAB, (2, SEQLEN), generator=torch.Generator().manual_seed(1))
    assert_same_model(hf_model, ours, input_ids)
    positions = (100_000 + torch.arange(SEQLEN)).expand(2, SEQLEN)
    with torch.no_grad():
        hf_logits = hf_model(input_ids, position_ids=positions).logits
        our_logits = ours(input_ids, position_ids=positions)
    assert (hf_logits - our_logits).abs().max().item() <= 1e-4


@pytest.mark.parametrize("make_config, message", [
    (lambda: Gemma3TextConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=1, intermediate_size=96,
                              head_dim=16, use_bidirectional_attention=True), "use_bidirectional_attention"),
    (lambda: Gemma2Config(hidden_size=64, num_attention_heads=4, num_hidden_layers=1, intermediate_size=96,
                          head_dim=16, hidden_activation="gelu"), "hidden_activation='gelu'"),
    # transformers' Llama rotates whole heads (its cos / sin would not even fit a partial rotation).
    (lambda: LlamaConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=1, intermediate_size=96,
                         partial_rotary_factor=0.5), "partial_rotary_factor=0.5 contradicts family='llama'"),
    (lambda: Gemma3TextConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=1, intermediate_size=96,
                              head_dim=16, partial_rotary_factor=0.5),
     "partial_rotary_factor=0.5 contradicts family='gemma3'"),
], ids=["gemma3-bidirectional", "gemma2-exact-gelu", "llama-partial-rotary", "gemma3-partial-rotary"])
def test_unsupported_hf_configs_name_the_key(make_config, message, tmp_path):
    make_config().save_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match=message):
        flashformer.from_pretrained(tmp_path)


# Phi-4-mini-instruct's config.json as transformers 4.x wrote it (partial_rotary_factor and LongRoPE's
# "type" at the top level), its factor lists made up: 96 of the 128 dims of a head rotate, 48 pairs.
PHI4_MINI = dict(
    model_type="phi3", architectures=["Phi3ForCausalLM"], vocab_size=200064, hidden_size=3072, intermediate_size=8192,
    num_hidden_layers=32, num_attention_heads=24, num_key_value_heads=8, max_position_embeddings=131072,
    original_max_position_embeddings=4096, partial_rotary_factor=0.75, rope_theta=10000.0, rms_norm_eps=1e-5,
    sliding_window=262144, tie_word_embeddings=True, hidden_act="silu",
    rope_scaling={"type": "longrope", "short_factor": [1.0 + 0.01 * i for i in range(48)],
                  "long_factor": [1.0 + 1.5 * i for i in range(48)]})


def test_phi4_mini_config_rotates_what_transformers_rotates():
    """Its RoPE (short and long factors, attention factor) equals what transformers makes of the same config.json
    and of our export of it, which also reads back unchanged."""
    cfg = config_from_hf(PHI4_MINI)
    assert cfg.partial_rotary_factor == 0.75 and cfg.rotary_dim == 96 and cfg.head_dim == 128
    assert cfg.rope_scaling["original_max_position_embeddings"] == 4096  # the top-level field, not max_seq_len
    # LongRoPE's first name, which Phi3Config renames too (transformers 5 then misses the top-level original context).
    older = {**PHI4_MINI, "rope_scaling": {**PHI4_MINI["rope_scaling"], "type": "su"}}
    exported = config_to_hf(cfg, torch.bfloat16)
    assert config_from_hf(older) == config_from_hf(exported) == cfg
    for hf_fields in (PHI4_MINI, exported):
        hf_config = Phi3Config(**copy.deepcopy(hf_fields))  # transformers fills in the rope dict it is given
        for seq_len in (None, 8192):
            hf_inv_freq, hf_factor = ROPE_INIT_FUNCTIONS["longrope"](hf_config, "cpu", seq_len=seq_len)
            inv_freq, factor = rope_frequencies(cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_seq_len,
                                                seq_len=seq_len)
            assert inv_freq.shape == (48,)
            torch.testing.assert_close(inv_freq, hf_inv_freq, atol=0, rtol=0)
            assert factor == pytest.approx(hf_factor, rel=1e-12) and factor > 1


@pytest.mark.parametrize("fields, message", [
    (dict(partial_rotary_factor=0), r"partial_rotary_factor must be in \(0, 1\]"),
    (dict(rope_parameters={"rope_type": "default", "partial_rotary_factor": 1.25}),
     r"partial_rotary_factor must be in \(0, 1\] .*, got 1.25"),
    (dict(partial_rotary_factor=0.7), r"int\(head_dim 128 \* 0.7\) = 89 dims"),
    (dict(rope_scaling={**PHI4_MINI["rope_scaling"], "long_factor": [1.0] * 64}),
     "rope_scaling.long_factor has 64 entries; rotary_dim 96 rotates 48 pairs"),
], ids=["zero", "above-one", "odd-rotary-dim", "full-head-factor-list"])
def test_bad_phi3_partial_rotary_names_the_key(fields, message):
    with pytest.raises(ValueError, match=message):
        config_from_hf({**PHI4_MINI, **fields})


def test_custom_family_has_no_hf_export(tmp_path):
    model = Transformer(ModelConfig(family="custom", pos="learned", n_kv_head=2, d_model=64, n_layer=1, n_head=4,
                                    vocab_size=VOCAB))
    with pytest.raises(ValueError, match="family='custom' has no Hugging Face architecture"):
        model.save_pretrained(tmp_path / "x", format="hf")


@pytest.mark.parametrize("path", sorted((Path(__file__).parents[1] / "configs" / "models").glob("*.yaml")),
                         ids=lambda p: p.stem)
def test_shipped_model_configs_export_to_transformers_shapes(path):
    """Real-sized configs (on the meta device): transformers builds the exported config.json into a model
    whose tensors are exactly the exported ones, name for name and shape for shape."""
    cfg = load_config(ModelConfig, path)
    with torch.device("meta"):
        ours = Transformer(cfg)
        hf_model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config_to_hf(cfg, torch.bfloat16)))
    exported = {name: tuple(t.shape) for name, t in state_dict_to_hf(ours.state_dict(), cfg).items()}
    expected = {name: tuple(t.shape) for name, t in hf_model.state_dict().items()}
    if cfg.tie_embeddings:
        expected.pop("lm_head.weight", None)
    assert exported == expected
    assert config_from_hf(hf_model.config.to_dict()) == cfg
