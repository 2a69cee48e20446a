"""The Transformer: attention backends agree, KV cache and packed documents are exact, API details."""

import math

import pytest
import torch
import torch.nn.functional as F

from flashformer.attention import attention
from flashformer.config import ConfigError
from flashformer.kernels import force_kernel_impl
from flashformer.model import ModelConfig, Transformer
from flashformer.rope import RotaryEmbedding, apply_rotary

GPT2_LIKE = dict(family="gpt2", norm="layernorm", mlp="gelu", pos="learned", qkv_bias=True, o_bias=True,
                 mlp_bias=True, tie_embeddings=True)
LLAMA_LIKE = dict(family="mistral", n_kv_head=2, sliding_window=7, d_ff=96,
                  rope_scaling={"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32})
# Gemma 3 with a final softcap: per-head qk-norm, a windowed layer with its own RoPE base, a scaled full one.
GEMMA_LIKE = dict(family="gemma3", n_kv_head=2, sliding_window=7, d_ff=96, layer_types=("sliding", "full"),
                  rope_local_theta=500.0, rope_scaling={"rope_type": "linear", "factor": 2.0}, logit_softcap=5.0)
FAMILIES = [GPT2_LIKE, LLAMA_LIKE, GEMMA_LIKE, dict(family="olmo2", n_kv_head=1, d_ff=96)]
FAMILY_IDS = ["gpt2", "mistral", "gemma3", "olmo2"]


def tiny_model(seed=0, **overrides):
    fields = {**dict(vocab_size=101, d_model=64, n_layer=2, n_head=4, max_seq_len=64), **overrides}
    torch.manual_seed(seed)
    model = Transformer(ModelConfig(**fields))
    with torch.no_grad():  # larger weights than the 0.02 init, so that differences show in the logits
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def logits_and_grads(model, input_ids, backend, **forward_kwargs):
    model.zero_grad()
    model.attn_backend = backend
    logits = model(input_ids, **forward_kwargs)
    logits.float().pow(2).mean().backward()
    return logits.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def reference_logits_and_grads(model, input_ids):
    """flash on the kernels' PyTorch path, whatever the device: the reference every backend meets."""
    with force_kernel_impl("torch"):
        return logits_and_grads(model, input_ids, "flash")


def assert_close_all(reference, other, atol):
    ref_logits, ref_grads = reference
    logits, grads = other
    torch.testing.assert_close(logits, ref_logits, atol=atol, rtol=0)
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], atol=atol, rtol=1e-3, msg=name)


@pytest.mark.parametrize("family", FAMILIES, ids=FAMILY_IDS)
def test_backends_agree(family):
    model = tiny_model(**family)
    input_ids = torch.randint(0, 101, (2, 40))
    reference = reference_logits_and_grads(model, input_ids)
    for backend in ("sdpa", "naive", "auto"):
        assert_close_all(reference, logits_and_grads(model, input_ids, backend), atol=2e-5)


def test_softcap_backends_agree():
    """Gemma 2's attention softcap over its alternating sliding-window / full layers."""
    model = tiny_model(family="gemma2", n_kv_head=2, sliding_window=7, d_ff=96, attn_softcap=5.0)
    input_ids = torch.randint(0, 101, (1, 24))
    assert_close_all(reference_logits_and_grads(model, input_ids), logits_and_grads(model, input_ids, "naive"),
                     atol=2e-5)
    model.attn_backend = "sdpa"
    with pytest.raises(ValueError, match="softcap"):
        model(input_ids)


@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "nondeterministic"])
def test_flash_backend_matches_reference(deterministic, device, triton_path):
    model = tiny_model(n_layer=1, **LLAMA_LIKE).to(device)
    input_ids = torch.randint(0, 101, (1, 20), device=device)
    reference = reference_logits_and_grads(model, input_ids)
    model.deterministic = deterministic
    assert_close_all(reference, logits_and_grads(model, input_ids, "flash"), atol=1e-4)


def model_on_backend(family, backend, device, monkeypatch):
    """(tiny model, its device): "flash" on the Triton kernels on the test device (the interpreter on
    CPU); "reference" (flash on the kernels' PyTorch path) and the PyTorch backends on CPU."""
    if backend == "flash":
        monkeypatch.setenv("FLASHFORMER_KERNEL", "triton")
    else:
        device = "cpu"
    if backend == "reference":
        monkeypatch.setenv("FLASHFORMER_KERNEL", "torch")
        backend = "flash"
    model = tiny_model(**family).to(device)
    model.attn_backend = backend
    return model, device


@pytest.mark.parametrize("family", FAMILIES, ids=FAMILY_IDS)
@pytest.mark.parametrize("backend", ["reference", "sdpa", "flash"])
def test_kv_cache_equals_full_recompute(family, backend, device, monkeypatch):
    """Prefill in chunks, then one token at a time; "flash" runs the Triton decode kernel."""
    model, device = model_on_backend(family, backend, device, monkeypatch)
    input_ids = torch.randint(0, 101, (2, 24), device=device)
    with torch.no_grad():
        full = model(input_ids)
        cache = model.new_kv_cache(batch_size=2, max_len=24)
        chunks = [model(input_ids[:, :12], kv_cache=cache), model(input_ids[:, 12:20], kv_cache=cache)]
        chunks += [model(input_ids[:, i:i + 1], kv_cache=cache) for i in range(20, 24)]
    assert cache.length == 24
    torch.testing.assert_close(torch.cat(chunks, dim=1), full, atol=2e-5, rtol=0)
    with pytest.raises(ValueError, match="KV cache holds 24 tokens"):
        model(input_ids[:, :1], kv_cache=cache)


@pytest.mark.parametrize("family", FAMILIES, ids=FAMILY_IDS)
@pytest.mark.parametrize("backend", ["reference", "sdpa", "flash"])
def test_packed_documents_equal_separate_runs(family, backend, device, monkeypatch):
    model, device = model_on_backend(family, backend, device, monkeypatch)
    lengths = [9, 1, 14, 6]
    docs = [torch.randint(0, 101, (1, n), device=device) for n in lengths]
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    packed = torch.cat(docs, dim=1).view(2, 15)  # batch * seqlen tokens, documents cross the row boundary
    with torch.no_grad():
        logits = model(packed, cu_seqlens=cu_seqlens, max_seqlen=max(lengths)).view(1, 30, -1)
        separate = torch.cat([model(doc) for doc in docs], dim=1)
    torch.testing.assert_close(logits, separate, atol=2e-5, rtol=0)


def test_partial_rotary_turns_the_leading_dims_and_passes_the_rest():
    """rotary_dim 24 of head_dim 32: pairs (i, i + 12) of the first 24 dims turn by position * theta ** (-2i / 24)
    (fp64 math), the last 8 dims are copied bit for bit."""
    x = torch.randn(2, 5, 3, 32)
    out = apply_rotary(x, *RotaryEmbedding(24, 10000.0, None, 64)(torch.arange(5).expand(2, 5)))
    angles = torch.arange(5.0, dtype=torch.float64)[:, None] * 10000.0 ** (
        -torch.arange(0, 24, 2, dtype=torch.float64) / 24)
    cos, sin = angles.cos()[None, :, None], angles.sin()[None, :, None]
    first, second = x[..., :12].double(), x[..., 12:24].double()
    expected = torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)
    torch.testing.assert_close(out[..., :24].double(), expected, atol=1e-5, rtol=0)
    assert torch.equal(out[..., 24:], x[..., 24:])


def test_partial_rotary_kv_cache_equals_full_recompute(monkeypatch):
    """Half of each head rotating under YaRN: prefill then single tokens through the cache equal one full pass."""
    model, _ = model_on_backend(dict(family="custom", n_kv_head=2, partial_rotary_factor=0.5, rope_scaling={
        "rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 16}), "reference", "cpu", monkeypatch)
    assert model.rope.inv_freq.shape == (4,)
    input_ids = torch.randint(0, 101, (2, 20))
    with torch.no_grad():
        full = model(input_ids)
        cache = model.new_kv_cache(batch_size=2, max_len=20)
        steps = [model(input_ids[:, :16], kv_cache=cache)] + [model(input_ids[:, i:i + 1], kv_cache=cache)
                                                               for i in range(16, 20)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=2e-5, rtol=0)


@pytest.mark.parametrize("fields, message", [
    (dict(partial_rotary_factor=0.0), r"partial_rotary_factor must be in \(0, 1\]"),
    (dict(partial_rotary_factor=1.5), r"partial_rotary_factor must be in \(0, 1\] .*, got 1.5"),
    (dict(partial_rotary_factor=0.5625), r"rotates int\(head_dim 16 \* 0.5625\) = 9 dims; .* even"),
    (dict(partial_rotary_factor=0.05), r"= 0 dims; .* at least 2"),
    (dict(family="llama", partial_rotary_factor=0.5), "partial_rotary_factor=0.5 contradicts family='llama'"),
    (dict(family="custom", pos="learned", partial_rotary_factor=0.5), "partial_rotary_factor is set but pos='learned'"),
    (dict(partial_rotary_factor=0.75, rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 8,
                                                    "long_factor": [2.0] * 6}),
     "rope_scaling.short_factor has 8 entries; rotary_dim 12 rotates 6 pairs"),
    (dict(rope_scaling={"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}),
     "rope_scaling.partial_rotary_factor: set the model config's partial_rotary_factor"),
])
def test_partial_rotary_factor_is_checked(fields, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig(**{"family": "phi3", "d_model": 64, "n_head": 4, **fields}).validate()


def test_attention_rejects_bad_cu_seqlens():
    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(ValueError, match="int32"):
        attention(q, q, q, backend="flash", cu_seqlens=torch.tensor([0, 8]))
    with pytest.raises(ValueError, match="token count 8"):
        attention(q, q, q, backend="flash", cu_seqlens=torch.tensor([0, 5], dtype=torch.int32))
    with pytest.raises(ValueError, match="attn_backend='cuda'"):
        attention(q, q, q, backend="cuda")
    with pytest.raises(ValueError, match="'reference' is no longer a backend: use attn_backend='flash' with "
                                         "FLASHFORMER_KERNEL=torch"):
        attention(q, q, q, backend="reference")


def test_loss_is_fp32_cross_entropy_with_ignore_index():
    model = tiny_model(**LLAMA_LIKE).to(torch.bfloat16)
    input_ids = torch.randint(0, 101, (2, 16))
    targets = torch.randint(0, 101, (2, 16))
    targets[0, :5] = -100
    loss = model.loss(input_ids, targets)
    expected = F.cross_entropy(model(input_ids).float().flatten(0, 1), targets.flatten(), ignore_index=-100)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, expected)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("tied, family", [(True, LLAMA_LIKE), (False, LLAMA_LIKE), (True, GEMMA_LIKE)],
                         ids=["tied", "untied", "logit-softcap"])
def test_chunked_loss_equals_full_logits_cross_entropy(tied, family):
    """Forced chunking (chunks of 7 tokens, so 2 x 24 tokens end in a partial chunk) against full logits
    (softcapped by forward() where the family caps them)."""
    model = tiny_model(tie_embeddings=tied, **family)
    input_ids = torch.randint(0, 101, (2, 24))
    targets = torch.randint(0, 101, (2, 24))
    targets[1, :12] = -100  # tokens 28..34 (a whole chunk) are ignored: that chunk is skipped

    def loss_and_grads(compute_loss):
        model.zero_grad()
        loss = compute_loss()
        loss.backward()
        return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}

    full_loss, full_grads = loss_and_grads(
        lambda: F.cross_entropy(model(input_ids).float().flatten(0, 1), targets.flatten(), ignore_index=-100))
    chunked_loss, chunked_grads = loss_and_grads(lambda: model.loss(input_ids, targets, chunk_size=7))
    assert (model.lm_head is None) == tied and full_grads.keys() == chunked_grads.keys()
    torch.testing.assert_close(chunked_loss, full_loss, atol=1e-6, rtol=1e-6)
    for name, grad in full_grads.items():
        torch.testing.assert_close(chunked_grads[name], grad, atol=1e-6, rtol=1e-5, msg=name)


def test_parameter_count_flops_and_init():
    model = tiny_model(seed=0, **GPT2_LIKE)
    cfg = model.config
    assert model.lm_head is None and "lm_head.weight" not in model.state_dict()
    per_block = sum(p.numel() for p in model.blocks[0].parameters())
    embeddings = cfg.vocab_size * cfg.d_model + cfg.max_seq_len * cfg.d_model
    assert model.num_params() == embeddings + cfg.n_layer * per_block + 2 * cfg.d_model
    assert model.num_params(exclude_embeddings=True) == model.num_params() - cfg.max_seq_len * cfg.d_model
    assert model.flops_per_token(64) == 6 * model.num_params(True) + 12 * cfg.n_layer * cfg.d_model * 64

    fresh = Transformer(ModelConfig(n_layer=8, d_model=256, n_head=4))
    assert abs(fresh.blocks[0].attn.q_proj.weight.std().item() - 0.02) < 2e-3
    assert abs(fresh.blocks[0].attn.o_proj.weight.std().item() - 0.02 / math.sqrt(16)) < 5e-4
    assert isinstance(fresh.blocks, torch.nn.ModuleList) and len(fresh.blocks) == 8


def test_bf16_forward_keeps_rope_in_fp32():
    model = tiny_model(**LLAMA_LIKE)
    input_ids = torch.randint(0, 101, (1, 40))
    with torch.no_grad():
        full = model(input_ids)
        half = model.to(torch.bfloat16)(input_ids)
    assert half.dtype == torch.bfloat16
    assert (half.float() - full).abs().max() < 0.1


def test_invalid_inputs():
    model = tiny_model(**GPT2_LIKE)
    with pytest.raises(ValueError, match="attn_backend"):
        model.attn_backend = "fast"
    with pytest.raises(ValueError, match="max_seq_len=64"):
        model(torch.zeros(1, 65, dtype=torch.long))
    with pytest.raises(ValueError, match="input_ids must be"):
        model(torch.zeros(65, dtype=torch.long))
    with pytest.raises(ConfigError, match="n_head"):
        Transformer(ModelConfig(n_head=0))


def test_family_sets_its_architecture():
    """A family with only sizes builds that architecture, not a Llama with a label."""
    gpt2 = ModelConfig(family="gpt2", vocab_size=101, d_model=64, n_layer=2, n_head=4)
    assert (gpt2.norm, gpt2.mlp, gpt2.pos, gpt2.qkv_bias, gpt2.o_bias, gpt2.mlp_bias, gpt2.tie_embeddings) == (
        "layernorm", "gelu", "learned", True, True, True, True)
    model = Transformer(gpt2)
    assert model.pos_embed is not None and isinstance(model.blocks[0].attn_norm, torch.nn.LayerNorm)
    gemma2 = ModelConfig(family="gemma2", n_layer=4)
    assert (gemma2.norm, gemma2.norm_placement, gemma2.mlp, gemma2.attn_softcap, gemma2.logit_softcap,
            gemma2.scale_embeddings, gemma2.sliding_window) == (
        "offset_rmsnorm", "both", "geglu", 50.0, 30.0, True, 4096)
    assert gemma2.layer_kinds() == ("sliding", "full", "sliding", "full")
    assert ModelConfig(family="gemma3", n_layer=7).layer_kinds() == ("sliding",) * 5 + ("full", "sliding")
    assert ModelConfig(family="qwen3").qk_norm == "per_head" and ModelConfig(family="olmo2").norm_placement == "post"
    # Free fields keep the value given; the family's own defaults stay overridable where its HF config has them.
    assert ModelConfig(family="gpt2", tie_embeddings=False).tie_embeddings is False
    assert ModelConfig(family="qwen2", norm_eps=1e-5).norm_eps == 1e-5


@pytest.mark.parametrize("fields, message", [
    (dict(family="gpt2", norm="rmsnorm"), "norm='rmsnorm' contradicts family='gpt2'"),
    (dict(family="gpt2", n_kv_head=2), "n_kv_head=2 contradicts family='gpt2'"),
    (dict(family="llama", attn_softcap=5.0), "attn_softcap=5.0 contradicts family='llama'"),
    (dict(family="llama", qkv_bias=True, o_bias=False), "o_bias=False contradicts family='llama'"),
    (dict(family="qwen2", qkv_bias=False), "qkv_bias=False contradicts family='qwen2'"),
    (dict(family="mistral", sliding_window=8, layer_types=("full", "sliding")),
     "layer_types=.* contradicts family='mistral'"),
    (dict(family="olmo2", norm_placement="pre"), "norm_placement='pre' contradicts family='olmo2'"),
    (dict(family="gemma2", mlp="swiglu"), "mlp='swiglu' contradicts family='gemma2'"),
])
def test_explicit_field_contradicting_family_is_refused(fields, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig(n_layer=2, **fields).validate()


def test_configs_written_before_family_presets_still_load():
    """A flashformer config.json of the earlier field set (every field explicit) loads unchanged."""
    from flashformer.config import load_config

    old = dict(family="qwen2", vocab_size=101, d_model=64, n_layer=2, n_head=4, n_kv_head=2, head_dim=16, d_ff=96,
               max_seq_len=64, norm="rmsnorm", norm_eps=1e-5, mlp="swiglu", pos="rope", rope_theta=10000.0,
               rope_scaling=None, qkv_bias=True, o_bias=False, mlp_bias=False, tie_embeddings=True,
               sliding_window=None, attn_softcap=0.0, init_std=0.02)
    cfg = load_config(ModelConfig, old)
    assert cfg.norm_eps == 1e-5 and cfg.qk_norm == "none" and cfg.norm_placement == "pre"
    assert [(name, p.shape) for name, p in Transformer(cfg).named_parameters()] == [
        (name, p.shape) for name, p in Transformer(ModelConfig(**old)).named_parameters()]
