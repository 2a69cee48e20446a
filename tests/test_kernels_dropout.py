"""Dropout, ALiBi and return_attn_probs (flash-attn 2's options) on both paths, against fp64 math.

The kernels draw dropout's mask from Philox keyed by a seed taken from torch's generator, and
reference.dropout_keep_mask computes the same mask in PyTorch: after the same torch.manual_seed the
tests rebuild the exact mask a call used, so the fp64 oracle drops the very same probabilities and the
2x rule applies unchanged.
"""


import pytest
import torch
from attention_checks import assert_compiles_full_graph, assert_within_2x, attention_grads

from flashformer.kernels import (attention_materialized, cu_seqlens_from_lengths, flash_attn_func,
                                 flash_attn_varlen_func, flash_attn_with_kvcache, launch)
from flashformer.kernels.checks import draw_dropout_seed
from flashformer.kernels.reference import dropout_keep_mask

# The seed torch's generator is reset to before a call, so that its dropout seed can be rebuilt.
GENERATOR_SEED = 1234


def _keep_mask(device, dropout_p, batch, heads, seqlen_q, seqlen_k, first_batch=0):
    """The mask a call made right after torch.manual_seed(GENERATOR_SEED) uses, (batch, heads, seqlen_q, seqlen_k)."""
    torch.manual_seed(GENERATOR_SEED)
    seed = int(draw_dropout_seed(device).item())
    index = torch.arange
    return dropout_keep_mask(seed, dropout_p, index(first_batch, first_batch + batch, device=device).view(-1, 1, 1, 1),
                             index(heads, device=device).view(-1, 1, 1), index(seqlen_q, device=device).view(-1, 1),
                             index(seqlen_k, device=device))


def _seeded(fn):
    """``fn`` called right after torch.manual_seed(GENERATOR_SEED)."""
    def call(*args, **kwargs):
        torch.manual_seed(GENERATOR_SEED)
        return fn(*args, **kwargs)
    return call


def _assert_dense_matches(q, k, v, dropout_p=0.0, alibi_slopes=None, **opts):
    """out, dq, dk, dv of flash_attn_func against fp64 math with the same dropout mask, by the 2x rule."""
    grad_out = torch.randn_like(q)
    mask = _keep_mask(q.device, dropout_p, q.shape[0], q.shape[2], q.shape[1], k.shape[1]) if dropout_p else None
    ours = attention_grads(_seeded(flash_attn_func), q, k, v, grad_out, dropout_p=dropout_p, alibi_slopes=alibi_slopes,
                           **opts)
    opts.pop("deterministic", None)
    reference = dict(opts, dropout_p=dropout_p, dropout_mask=mask, alibi_slopes=alibi_slopes)
    ref = attention_grads(attention_materialized, q.double(), k.double(), v.double(), grad_out, **reference)
    lowp = attention_grads(attention_materialized, q, k, v, grad_out, upcast=False, **reference)
    for name, a, r, l in zip(("out", "dq", "dk", "dv"), ours, ref, lowp):
        assert_within_2x(name, a, r, l)


DROPOUT_CASES = [  # (seqlen_q, seqlen_k), (heads_q, heads_kv), head_dim, causal, window, dtype, deterministic
    pytest.param((37, 45), (4, 2), 32, True, (-1, -1), torch.float16, True, id="causal-gqa-d32"),
    pytest.param((70, 33), (2, 2), 64, False, (-1, -1), torch.bfloat16, True, id="full-sq>sk-d64"),
    pytest.param((50, 81), (4, 1), 80, True, (20, -1), torch.float16, True, id="causal-window-mqa-d80"),
    pytest.param((45, 37), (4, 2), 64, False, (9, 5), torch.bfloat16, False, id="window-nondeterministic"),
]


@pytest.mark.parametrize("seqlens,heads,head_dim,causal,window,dtype,deterministic", DROPOUT_CASES)
def test_dropout_matches_reference(seqlens, heads, head_dim, causal, window, dtype, deterministic, device,
                                   triton_path):
    q = torch.randn(2, seqlens[0], heads[0], head_dim, device=device, dtype=dtype)
    k = torch.randn(2, seqlens[1], heads[1], head_dim, device=device, dtype=dtype)
    v = torch.randn_like(k)
    _assert_dense_matches(q, k, v, dropout_p=0.17, causal=causal, window_size=window, deterministic=deterministic)


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_dropout_with_alibi_matches_reference(impl, device, monkeypatch):
    monkeypatch.setenv("FLASHFORMER_KERNEL", impl)
    monkeypatch.setattr(launch, "POISON_OUTPUTS", True)
    q = torch.randn(2, 41, 4, 32, device=device, dtype=torch.float16)
    k = torch.randn(2, 67, 2, 32, device=device, dtype=torch.float16)
    v = torch.randn_like(k)
    slopes = torch.rand(2, 4, device=device)
    _assert_dense_matches(q, k, v, dropout_p=0.3, alibi_slopes=slopes, causal=True)


def test_kernel_mask_is_the_reference_mask_and_drops_p(device, triton_path):
    """With q = 0 every probability is 1 / seqlen_k, and with v the identity (seqlen_k = head_dim) the
    output row is the row's mask scaled: the kernel's mask, read back whole (64k elements)."""
    dropout_p, heads, seqlen_q, seqlen_k = 0.23, 4, 256, 64
    q = torch.zeros(1, seqlen_q, heads, seqlen_k, device=device)
    k = torch.randn(1, seqlen_k, heads, seqlen_k, device=device)
    v = torch.eye(seqlen_k, device=device)[None, :, None, :].expand(1, seqlen_k, heads, seqlen_k).contiguous()
    out = _seeded(flash_attn_func)(q, k, v, dropout_p=dropout_p)
    kernel_keep = (out > 0).permute(0, 2, 1, 3)  # (batch, heads, seqlen_q, seqlen_k)
    assert torch.equal(kernel_keep, _keep_mask(device, dropout_p, 1, heads, seqlen_q, seqlen_k))
    torch.testing.assert_close(out[out > 0], torch.full_like(out[out > 0], 1 / seqlen_k / (1 - dropout_p)))
    assert abs((1 - kernel_keep.float().mean().item()) - dropout_p) <= 0.01  # flash-attn's test bound


def test_dropout_same_seed_same_bits_other_seed_differs(device, triton_path):
    q, k, v = (torch.randn(1, 40, 2, 32, device=device, dtype=torch.bfloat16) for _ in range(3))
    grad_out = torch.randn_like(q)
    runs = []
    for seed in (7, 7, 8):
        torch.manual_seed(seed)
        runs.append(attention_grads(flash_attn_func, q, k, v, grad_out, dropout_p=0.2, causal=True))
    for name, a, b, c in zip(("out", "dq", "dk", "dv"), *runs):
        assert torch.equal(a, b), f"{name}: same seed, different bits"
        assert not torch.equal(a, c), f"{name}: different seeds, same result"


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_return_attn_probs_encodes_the_mask(impl, device, monkeypatch):
    monkeypatch.setenv("FLASHFORMER_KERNEL", impl)
    dropout_p = 0.4
    q = torch.randn(2, 19, 4, 32, device=device, dtype=torch.float16)
    k = torch.randn(2, 23, 2, 32, device=device, dtype=torch.float16)
    v = torch.randn_like(k)
    slopes = torch.rand(4, device=device)
    out, lse, s_dmask = _seeded(flash_attn_func)(q, k, v, causal=True, dropout_p=dropout_p, alibi_slopes=slopes,
                                                 return_attn_probs=True)
    assert s_dmask.shape == (2, 4, 19, 23) and s_dmask.dtype == torch.float32
    assert torch.equal(torch.signbit(s_dmask), ~_keep_mask(device, dropout_p, 2, 4, 19, 23))
    probs, ref_lse = attention_materialized(q.double(), k.double(), v.double(), causal=True, alibi_slopes=slopes)
    torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=0)
    # |S_dmask| are the softmax probabilities: dropped or kept, each row's sum is 1 (0 if it sees no key).
    torch.testing.assert_close(s_dmask.abs().sum(-1), torch.ones_like(lse), atol=1e-4, rtol=0)
    assert flash_attn_func(q, k, v, return_attn_probs=True)[2].min() >= 0  # no dropout: plain probabilities


ALIBI_CASES = [  # (seqlen_q, seqlen_k), (heads_q, heads_kv), head_dim, causal, window, softcap, slopes per batch
    pytest.param((37, 45), (4, 2), 32, False, (-1, -1), 0.0, False, id="full-heads"),
    pytest.param((70, 33), (4, 4), 64, True, (-1, -1), 0.0, True, id="causal-batch-heads"),
    pytest.param((45, 77), (4, 1), 80, True, (-1, -1), 0.0, False, id="causal-mqa-d80"),
    pytest.param((33, 50), (2, 2), 64, False, (12, 3), 8.0, True, id="window-softcap"),
]


@pytest.mark.parametrize("seqlens,heads,head_dim,causal,window,softcap,per_batch", ALIBI_CASES)
def test_alibi_matches_reference(seqlens, heads, head_dim, causal, window, softcap, per_batch, device, triton_path):
    q = torch.randn(2, seqlens[0], heads[0], head_dim, device=device, dtype=torch.float16)
    k = torch.randn(2, seqlens[1], heads[1], head_dim, device=device, dtype=torch.float16)
    v = torch.randn_like(k)
    slopes = torch.rand(*((2,) if per_batch else ()), heads[0], device=device)
    _assert_dense_matches(q, k, v, alibi_slopes=slopes, causal=causal, window_size=window, softcap=softcap)


def test_alibi_torch_path_matches_reference(device):
    q = torch.randn(2, 29, 4, 32, device=device, dtype=torch.bfloat16)
    k = torch.randn(2, 40, 2, 32, device=device, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    _assert_dense_matches(q, k, v, alibi_slopes=torch.rand(2, 4, device=device), causal=True)


@pytest.mark.parametrize("impl,deterministic", [("triton", True), ("triton", False), ("torch", True)])
@pytest.mark.parametrize("per_batch", [False, True], ids=["slopes-heads", "slopes-batch-heads"])
def test_varlen_alibi_and_dropout_match_per_sequence(impl, deterministic, per_batch, device, monkeypatch):
    monkeypatch.setenv("FLASHFORMER_KERNEL", impl)
    monkeypatch.setattr(launch, "POISON_OUTPUTS", True)
    dropout_p, heads, head_dim = 0.2, (4, 2), 32
    lengths_q, lengths_k = [21, 0, 70, 1], [30, 5, 70, 9]
    q = torch.randn(sum(lengths_q), heads[0], head_dim, device=device, dtype=torch.float16)
    k = torch.randn(sum(lengths_k), heads[1], head_dim, device=device, dtype=torch.float16)
    v = torch.randn_like(k)
    slopes = torch.rand(*((len(lengths_q),) if per_batch else ()), heads[0], device=device)
    cu_q, cu_k = (cu_seqlens_from_lengths(n).to(device) for n in (lengths_q, lengths_k))
    grad_out = torch.randn_like(q)
    varlen = _seeded(flash_attn_varlen_func)
    ours = attention_grads(varlen, q, k, v, grad_out, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True,
                           dropout_p=dropout_p, alibi_slopes=slopes, deterministic=deterministic)

    def per_sequence(q, k, v, upcast):
        outs = []
        for b, (q0, q1, k0, k1) in enumerate(zip(cu_q.tolist(), cu_q[1:].tolist(), cu_k.tolist(), cu_k[1:].tolist())):
            mask = _keep_mask(device, dropout_p, 1, heads[0], q1 - q0, k1 - k0, first_batch=b)
            out, _ = attention_materialized(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], causal=True, upcast=upcast,
                                            alibi_slopes=slopes[b:b + 1] if per_batch else slopes,
                                            dropout_p=dropout_p, dropout_mask=mask)
            outs.append(out[0])
        return torch.cat(outs)

    ref = attention_grads(lambda q, k, v: per_sequence(q, k, v, True), q.double(), k.double(), v.double(), grad_out)
    lowp = attention_grads(lambda q, k, v: per_sequence(q, k, v, False), q, k, v, grad_out)
    for name, a, r, l in zip(("out", "dq", "dk", "dv"), ours, ref, lowp):
        assert_within_2x(name, a, r, l)


@pytest.mark.parametrize("kwargs,match", [
    (dict(dropout_p=1.0), "dropout_p must be a float in \\[0, 1\\)"),
    (dict(dropout_p=-0.1), "dropout_p must be a float in \\[0, 1\\)"),
    (dict(dropout_p=True), "dropout_p must be a float"),
    (dict(dropout_p=0.1, softcap=5.0), "dropout_p > 0 with softcap > 0"),
    (dict(alibi_slopes="slopes"), "alibi_slopes must be an fp32 tensor"),
    (dict(alibi_slopes=torch.ones(4, dtype=torch.float16)), "alibi_slopes must be an fp32 tensor"),
    (dict(alibi_slopes=torch.ones(3)), "alibi_slopes must have shape \\(heads_q,\\) = \\(4,\\)"),
    (dict(alibi_slopes=torch.ones(3, 4)), "alibi_slopes must have shape"),
    (dict(return_attn_probs=1), "return_attn_probs must be a bool"),
])
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_bad_dropout_alibi_arguments_are_named(kwargs, match, varlen, device):
    q, k, v = (torch.randn(2, 8, 4, 32, device=device, dtype=torch.float16) for _ in range(3))
    kwargs = {name: value.to(device) if isinstance(value, torch.Tensor) else value for name, value in kwargs.items()}
    with pytest.raises(ValueError, match=match):
        if varlen:
            cu = cu_seqlens_from_lengths([8, 8]).to(device)
            flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu, cu, **kwargs)
        else:
            flash_attn_func(q, k, v, **kwargs)


def test_torch_compile_full_graph_with_dropout_and_alibi(device, triton_path):
    """The seed is drawn in the traced graph from the same generator: compiled and eager runs after the
    same torch.manual_seed drop the same elements, and both passes stay opaque torch.library nodes."""
    assert_compiles_full_graph(device, "dict(dropout_p=0.25, alibi_slopes=torch.rand(2, device=device))")


@pytest.mark.parametrize("shape,dtype,match", [((3,), torch.float32, "must have shape"),
                                               ((4,), torch.float16, "must be an fp32 tensor"),
                                               ((2, 4), torch.float32, "must have shape")])
def test_kvcache_checks_alibi_slopes_by_name(shape, dtype, match, device):
    q = torch.randn(1, 1, 4, 32, device=device, dtype=torch.float16)
    cache = torch.randn(1, 16, 2, 32, device=device, dtype=torch.float16)
    with pytest.raises(ValueError, match="alibi_slopes " + match):
        flash_attn_with_kvcache(q, cache, cache, alibi_slopes=torch.rand(shape, device=device).to(dtype))
