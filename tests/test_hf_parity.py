"""Parity with Hugging Face transformers: loading their checkpoints, exporting ours, RoPE scalings."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

import flashformer  # noqa: E402
from flashformer.generate import generate  # noqa: E402
from flashformer.rope import rope_frequencies  # noqa: E402
from transformers import (AutoModelForCausalLM, GPT2Config, LlamaConfig, MistralConfig,  # noqa: E402
                          Qwen2Config)
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

VOCAB, SEQLEN, NEW_TOKENS = 113, 24, 8
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
    out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=NEW_TOKENS,
                         min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    return out


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

    ours = flashformer.from_pretrained(tmp_path / "hf", attn_backend="reference")
    assert_same_model(hf_model, ours, input_ids)

    ours.save_pretrained(tmp_path / "exported", format="hf")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "exported", attn_implementation="eager").eval()
    assert_same_model(reloaded, ours, input_ids)
    assert flashformer.from_pretrained(tmp_path / "exported", attn_backend="reference").config == ours.config


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
], ids=lambda s: s.get("rope_type", s.get("type")))
@pytest.mark.parametrize("seq_len", [None, 1000])
def test_rope_scalings_equal_transformers(scaling, seq_len):
    config = LlamaConfig(hidden_size=512, num_attention_heads=8, max_position_embeddings=256, rope_theta=50000.0,
                         rope_scaling=dict(scaling))
    rope_type = config.rope_parameters["rope_type"]
    hf_inv_freq, hf_factor = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", seq_len=seq_len)
    inv_freq, factor = rope_frequencies(64, 50000.0, scaling, max_seq_len=256, seq_len=seq_len)
    torch.testing.assert_close(inv_freq, hf_inv_freq, atol=0, rtol=0)
    assert factor == pytest.approx(hf_factor, rel=1e-12)


def test_unsupported_architecture_names_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "bert", "architectures": ["BertModel"]}')
    with pytest.raises(ValueError, match="unsupported Hugging Face architecture 'bert'.*gpt2.*llama.*mistral.*qwen2"):
        flashformer.from_pretrained(tmp_path)
