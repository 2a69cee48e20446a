"""flash-attn's API beyond the plain calls: the packed qkv / kv functions and head sizes the kernels do
not take natively (any head_dim in [1, 256], a v head_dim of its own), through the Triton path with
poisoned outputs and the PyTorch path."""

import pytest
import torch
from attention_checks import assert_matches_reference, assert_within_2x, attention_grads

from flashformer.kernels import (attention_materialized, cu_seqlens_from_lengths, flash_attn_func,
                                 flash_attn_kvpacked_func, flash_attn_qkvpacked_func, flash_attn_varlen_func,
                                 flash_attn_varlen_kvpacked_func, flash_attn_varlen_qkvpacked_func, interface, launch)


def _grads(fn, tensors, grad_out, **kwargs):
    """(out, grads of every tensor) of ``fn`` on leaf copies of ``tensors``."""
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    out = fn(*leaves, **kwargs)
    return (out, *torch.autograd.grad(out, leaves, grad_out))


def _assert_same(packed, unpacked):
    for name, a, b in zip(("out", "d_first", "d_second"), packed, unpacked):
        assert not a.isnan().any(), f"{name}: NaN"
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"{name} differs from the unpacked call")


@pytest.fixture
def records_kernel_inputs(monkeypatch):
    """The q, k, v the Triton path's forward receives, call by call."""
    seen = []
    forward = interface._forward_impl

    def recording(q, k, v, *args):
        seen.append((q, k, v))
        return forward(q, k, v, *args)

    monkeypatch.setattr(interface, "_forward_impl", recording)
    return seen


@pytest.mark.parametrize("packing", ["qkv", "kv"])
def test_packed_equals_unpacked_and_reads_views(packing, triton_path, records_kernel_inputs):
    """The packed call is the unpacked call on views of the packed tensor: same result bit for bit,
    gradient in the packed tensor (stacked dq / dk / dv), no copy before the kernels."""
    opts = dict(causal=True, window_size=(7, -1), softcap=5.0)
    if packing == "qkv":
        packed = torch.randn(2, 20, 3, 4, 32, dtype=torch.bfloat16)
        grad_out = torch.randn(2, 20, 4, 32, dtype=torch.bfloat16)
        out, d_packed = _grads(flash_attn_qkvpacked_func, [packed], grad_out, **opts)
        ref = _grads(flash_attn_func, packed.unbind(2), grad_out, **opts)
        _assert_same((out, *d_packed.unbind(2)), ref)
    else:
        q = torch.randn(2, 12, 4, 32, dtype=torch.bfloat16)
        packed = torch.randn(2, 28, 2, 2, 32, dtype=torch.bfloat16)
        grad_out = torch.randn_like(q)
        out, dq, d_packed = _grads(flash_attn_kvpacked_func, [q, packed], grad_out, **opts)
        ref = _grads(flash_attn_func, [q, *packed.unbind(2)], grad_out, **opts)
        _assert_same((out, dq, *d_packed.unbind(2)), ref)
    q_seen, k_seen, v_seen = records_kernel_inputs[0]
    assert k_seen.untyped_storage().data_ptr() == v_seen.untyped_storage().data_ptr(), "k, v copied before the kernel"
    assert k_seen.stride() != k_seen.contiguous().stride(), "k reached the kernel as a copy, not a view"


@pytest.mark.parametrize("packing", ["qkv", "kv"])
def test_varlen_packed_equals_unpacked(packing, triton_path):
    lengths = [5, 0, 19, 1]
    cu = cu_seqlens_from_lengths(lengths)
    total = sum(lengths)
    opts = dict(causal=True, return_lse=False)
    if packing == "qkv":
        packed = torch.randn(total, 3, 2, 32, dtype=torch.float16)
        grad_out = torch.randn(total, 2, 32, dtype=torch.float16)
        out, d_packed = _grads(flash_attn_varlen_qkvpacked_func, [packed], grad_out, cu_seqlens=cu,
                               max_seqlen=max(lengths), **opts)
        ref = _grads(flash_attn_varlen_func, packed.unbind(1), grad_out, cu_seqlens_q=cu, cu_seqlens_k=cu,
                     max_seqlen_q=max(lengths), max_seqlen_k=max(lengths), **opts)
        _assert_same((out, *d_packed.unbind(1)), ref)
    else:
        lengths_k = [9, 3, 19, 0]
        cu_k = cu_seqlens_from_lengths(lengths_k)
        q = torch.randn(total, 4, 32, dtype=torch.float16)
        packed = torch.randn(sum(lengths_k), 2, 2, 32, dtype=torch.float16)
        grad_out = torch.randn_like(q)
        out, dq, d_packed = _grads(flash_attn_varlen_kvpacked_func, [q, packed], grad_out, cu_seqlens_q=cu,
                                   cu_seqlens_k=cu_k, **opts)
        ref = _grads(flash_attn_varlen_func, [q, *packed.unbind(1)], grad_out, cu_seqlens_q=cu, cu_seqlens_k=cu_k,
                     **opts)
        _assert_same((out, dq, *d_packed.unbind(1)), ref)


@pytest.mark.parametrize("call,match", [
    (lambda: flash_attn_qkvpacked_func(torch.randn(1, 4, 2, 2, 16)), "qkv must be a 5-D tensor"),
    (lambda: flash_attn_qkvpacked_func(torch.randn(4, 3, 2, 16)), "qkv must be a 5-D tensor"),
    (lambda: flash_attn_kvpacked_func(torch.randn(1, 4, 2, 16), torch.randn(1, 4, 3, 2, 16)), "kv must be a 5-D"),
    (lambda: flash_attn_varlen_qkvpacked_func(torch.randn(1, 4, 2, 2, 16), torch.tensor([0, 4], dtype=torch.int32)),
     "qkv must be a 4-D tensor"),
    (lambda: flash_attn_varlen_kvpacked_func(torch.randn(4, 2, 16), torch.randn(4, 2, 16),
                                             *[torch.tensor([0, 4], dtype=torch.int32)] * 2), "kv must be a 4-D"),
    (lambda: flash_attn_varlen_func(*torch.randn(3, 4, 2, 16), *[torch.tensor([0, 4], dtype=torch.int32)] * 2,
                                    block_table=torch.zeros(1, 1, dtype=torch.int32)), "block_table"),
])
def test_packed_errors_name_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_packed_options_are_keyword_only():
    """flash-attn's packed functions take dropout_p second: a positional call written for them must fail,
    not bind dropout_p to softmax_scale."""
    with pytest.raises(TypeError):
        flash_attn_qkvpacked_func(torch.randn(1, 4, 3, 2, 16), 0.0, None, True)


# (head_dim of q and k, head_dim of v): below, between and at the kernels' multiples of 8, the largest,
# and v narrower and wider than q / k (DeepSeek's MLA has 192 / 128; 48 / 32 is its shape at CPU size).
HEAD_DIMS = [(1, 1), (3, 3), (59, 59), (111, 111), (250, 250), (48, 32), (32, 48), (20, 59)]


@pytest.mark.parametrize("head_dim,head_dim_v", HEAD_DIMS)
def test_any_head_dim_matches_reference(head_dim, head_dim_v, triton_path):
    """Forward and backward against the fp64 math on the unpadded tensors (which also fixes the default
    softmax_scale at the original head_dim ** -0.5)."""
    q = torch.randn(2, 17, 4, head_dim, dtype=torch.bfloat16)
    k = torch.randn(2, 23, 2, head_dim, dtype=torch.bfloat16)
    v = torch.randn(2, 23, 2, head_dim_v, dtype=torch.bfloat16)
    grad_out = torch.randn(2, 17, 4, head_dim_v, dtype=torch.bfloat16)
    assert_matches_reference(flash_attn_func, q, k, v, grad_out, causal=True)


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_any_head_dim_varlen_matches_reference(impl, monkeypatch):
    monkeypatch.setenv("FLASHFORMER_KERNEL", impl)
    monkeypatch.setattr(launch, "POISON_OUTPUTS", True)
    lengths = [7, 0, 13]
    cu = cu_seqlens_from_lengths(lengths)
    q = torch.randn(sum(lengths), 4, 59, dtype=torch.float16)
    k = torch.randn(sum(lengths), 2, 59, dtype=torch.float16)
    v = torch.randn(sum(lengths), 2, 24, dtype=torch.float16)
    grad_out = torch.randn(sum(lengths), 4, 24, dtype=torch.float16)
    ours = attention_grads(flash_attn_varlen_func, q, k, v, grad_out, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True)
    assert ours[0].shape == grad_out.shape
    for b in range(len(lengths)):
        if not lengths[b]:
            continue
        rows = slice(int(cu[b]), int(cu[b + 1]))
        per_sequence = [t[None, rows] for t in (q, k, v)]
        ref = attention_grads(attention_materialized, *[t.double() for t in per_sequence], grad_out[None, rows],
                              causal=True)
        lowp = attention_grads(attention_materialized, *per_sequence, grad_out[None, rows], causal=True, upcast=False)
        for name, a, r, l in zip(("out", "dq", "dk", "dv"), ours, ref, lowp):
            assert_within_2x(f"{name} of sequence {b}", a[rows][None], r, l)


def test_mla_head_dims_on_the_torch_path(monkeypatch):
    """DeepSeek's MLA shape at full size (q / k 192, v 128) on the PyTorch path."""
    monkeypatch.setenv("FLASHFORMER_KERNEL", "torch")
    q, k = torch.randn(1, 9, 2, 192, dtype=torch.bfloat16), torch.randn(1, 9, 2, 192, dtype=torch.bfloat16)
    v = torch.randn(1, 9, 2, 128, dtype=torch.bfloat16)
    assert_matches_reference(flash_attn_func, q, k, v, torch.randn(1, 9, 2, 128, dtype=torch.bfloat16), causal=True)
