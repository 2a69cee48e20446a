"""Varlen (packed) attention: equal to running each sequence through the dense math, by the 2x rule."""

import functools
import math
import random

import pytest
import torch
from attention_checks import assert_within_2x, attention_grads
from conftest import KERNEL_PATHS

from flashformer.kernels import (attention_materialized, cu_seqlens_from_document_ids, cu_seqlens_from_lengths,
                                 document_ids_from_cu_seqlens, flash_attn_varlen_backward, flash_attn_varlen_func,
                                 launch, position_ids_from_cu_seqlens)


def _per_sequence(q, k, v, cu_q, cu_k, grad_out, upcast, **opts):
    """(out, lse, dq, dk, dv) of the materialized math run sequence by sequence."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    outs, lses = [], []
    for b in range(cu_q.numel() - 1):
        q0, q1, k0, k1 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        out, lse = attention_materialized(leaves[0][None, q0:q1], leaves[1][None, k0:k1], leaves[2][None, k0:k1],
                                          upcast=upcast, **opts)
        outs.append(out[0])
        lses.append(lse[0])
    out = torch.cat(outs)
    grads = torch.autograd.grad(out, leaves, grad_out.to(out.dtype), allow_unused=True)
    grads = [torch.zeros_like(t) if g is None else g for g, t in zip(grads, leaves)]
    return out, torch.cat(lses, dim=1), *grads


CASES = [  # (q lengths, k lengths or None for the same), heads, head_dim, causal, window, softcap, dtype
    ([5, 0, 130, 1, 67], None, (4, 2), 64, True, (-1, -1), 0.0, torch.bfloat16),
    ([33, 97, 0], [40, 97, 3], (2, 2), 40, False, (-1, -1), 0.0, torch.float16),
    ([1, 200, 64], [17, 150, 64], (4, 1), 128, True, (20, -1), 0.0, torch.float16),
    ([77, 3], None, (4, 2), 80, False, (16, 4), 10.0, torch.bfloat16),
    # more sequences than one vector of 16 holds, among them one without keys and ones without queries; and
    # head_dim 256 (on an H200 both take the Gluon kernels' varlen form)
    ([3, 0, 70, 1, 129, 5, 0, 17, 64, 2, 33, 8, 1, 1, 90, 4, 11, 6], [9, 4, 70, 1, 100, 0, 2, 17, 70, 2, 30, 8, 1, 5,
                                                                     90, 4, 1, 6], (4, 2), 128, True, (-1, -1), 0.0,
     torch.bfloat16),
    ([50, 0, 7], [64, 3, 20], (2, 1), 256, False, (-1, -1), 0.0, torch.float16),
]


@pytest.mark.parametrize("lengths_q,lengths_k,heads,head_dim,causal,window,softcap,dtype", CASES)
@pytest.mark.parametrize("impl,deterministic",
                         [(path, deterministic) for path in KERNEL_PATHS for deterministic in (True, False)]
                         + [("torch", True)])
def test_varlen_matches_per_sequence(lengths_q, lengths_k, heads, head_dim, causal, window, softcap, dtype, impl,
                                     deterministic, device, monkeypatch):
    monkeypatch.setenv("FLASHFORMER_KERNEL", impl)
    monkeypatch.setattr(launch, "POISON_OUTPUTS", True)
    lengths_k = lengths_k or lengths_q
    q = torch.randn(sum(lengths_q), heads[0], head_dim, device=device, dtype=dtype)
    k = torch.randn(sum(lengths_k), heads[1], head_dim, device=device, dtype=dtype)
    v = torch.randn_like(k)
    _assert_varlen_matches(q, k, v, lengths_q, lengths_k, deterministic, causal=causal, window_size=window,
                           softcap=softcap)


def _assert_varlen_matches(q, k, v, lengths_q, lengths_k, deterministic, **opts):
    """out, lse, dq, dk, dv of flash_attn_varlen_func on packed q (total_q, heads_q, head_dim), k, v
    against the per-sequence math, by the 2x rule."""
    cu_q, cu_k = (cu_seqlens_from_lengths(n).to(q.device) for n in (lengths_q, lengths_k))
    grad_out = torch.randn_like(q)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse = flash_attn_varlen_func(*leaves, cu_q, cu_k, max(lengths_q), max(lengths_k), return_lse=True,
                                      deterministic=deterministic, **opts)
    ours = (out, *torch.autograd.grad(out, leaves, grad_out))
    ref = _per_sequence(q.double(), k.double(), v.double(), cu_q, cu_k, grad_out, True, **opts)
    lowp = _per_sequence(q, k, v, cu_q, cu_k, grad_out, False, **opts)
    for name, a, r, l in zip(("out", "dq", "dk", "dv"), ours, ref[:1] + ref[2:], lowp[:1] + lowp[2:]):
        assert_within_2x(name, a, r, l)
    assert lse.shape == (q.shape[1], sum(lengths_q))
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref[1]))
    finite = torch.isfinite(ref[1])
    torch.testing.assert_close(lse[finite], ref[1][finite].float(), atol=1e-2, rtol=0)


# Key tiles past a sequence's end (see test_kernels_flash.test_partial_key_tile_with_negative_scores):
# one key per sequence, where scores of inputs x3 reach lse of -20 and below.
@pytest.mark.parametrize("deterministic", [False, True], ids=["nondeterministic", "deterministic"])
def test_varlen_one_key_per_sequence(deterministic, device, triton_path):
    lengths_q, lengths_k = [76, 34, 146], [1, 1, 1]
    q = 3 * torch.randn(sum(lengths_q), 4, 64, device=device, dtype=torch.float16)
    k = 3 * torch.randn(sum(lengths_k), 2, 64, device=device, dtype=torch.float16)
    v = 3 * torch.randn_like(k)
    _assert_varlen_matches(q, k, v, lengths_q, lengths_k, deterministic)


# Key lengths drawn once (fixed seed) that no power-of-two key tile of 16 or more divides, query lengths of
# at least one whole query tile; q and k point in opposite directions, so every score is about -30.
# Full attention and a left-only window: the masks that leave query tiles unmasked for a key tile.
_SWEEP_RNG = random.Random(20261202)
PARTIAL_KEY_TILE_CASES = [
    pytest.param([_SWEEP_RNG.randint(64, 150) for _ in range(3)],
                 [_SWEEP_RNG.choice([n for n in range(1, 200) if n % 16]) for _ in range(3)], window, id=name)
    for window, name in (((-1, -1), "full"), ((48, -1), "left48"))
]


@pytest.mark.parametrize("deterministic", [False, True], ids=["nondeterministic", "deterministic"])
@pytest.mark.parametrize("lengths_q,lengths_k,window", PARTIAL_KEY_TILE_CASES)
def test_varlen_partial_key_tiles_with_negative_scores(lengths_q, lengths_k, window, deterministic, device,
                                                       triton_path):
    head_dim = 64
    offset = 30**0.5 / head_dim**0.25
    q = (torch.randn(sum(lengths_q), 2, head_dim, device=device) + offset).half()
    k = (torch.randn(sum(lengths_k), 1, head_dim, device=device) - offset).half()
    v = torch.randn_like(k)
    _assert_varlen_matches(q, k, v, lengths_q, lengths_k, deterministic, window_size=window)


def _packed(device):
    cu = cu_seqlens_from_lengths([3, 5]).to(device)
    q, k, v = (torch.randn(8, 2, 32, device=device, dtype=torch.float16) for _ in range(3))
    return q, k, v, cu


@pytest.mark.parametrize("mutate,match", [
    (lambda q, k, v, cu: (q, k, v, cu.long(), cu), "cu_seqlens_q must be a 1-d int32"),
    (lambda q, k, v, cu: (q, k, v, cu, cu.flip(0)), "cu_seqlens_k must start at 0"),
    (lambda q, k, v, cu: (q, k, v, torch.tensor([0, 3, 5, 8], dtype=torch.int32, device=cu.device), cu),
     "describe 3 and 2"),
    (lambda q, k, v, cu: (q, k, v, torch.tensor([0, 5, 3, 8], dtype=torch.int32, device=cu.device),
                          torch.tensor([0, 2, 4, 8], dtype=torch.int32, device=cu.device)), "non-decreasing"),
    (lambda q, k, v, cu: (q[:7], k, v, cu, cu), "token count 7"),
    (lambda q, k, v, cu: (q, k, v, cu[:1], cu[:1]), "at least 2 entries"),
    (lambda q, k, v, cu: (q, k, v, cu, torch.stack([cu, cu], 1)[:, 0]), "cu_seqlens_k must be contiguous"),
])
def test_varlen_bad_offsets_name_the_argument(mutate, match, device):
    with pytest.raises(ValueError, match=match):
        flash_attn_varlen_func(*mutate(*_packed(device)))


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_varlen_max_seqlen_too_small(impl, device, monkeypatch):
    monkeypatch.setenv("FLASHFORMER_KERNEL", impl)
    q, k, v, cu = _packed(device)
    with pytest.raises(ValueError, match="max_seqlen_q=4"):
        flash_attn_varlen_func(q, k, v, cu, cu, 4, 5, check_lengths=True)
    if impl == "torch":  # it reads the offsets anyway, so it checks them unasked
        with pytest.raises(ValueError, match="max_seqlen_k=4"):
            flash_attn_varlen_func(q, k, v, cu, cu, 5, 4)
    else:  # unread offsets: a max_seqlen is still the caller's value, checked on the host
        with pytest.raises(ValueError, match="max_seqlen_k must be an int"):
            flash_attn_varlen_func(q, k, v, cu, cu, 5, 5.0)


@pytest.mark.parametrize("deterministic", [False, True], ids=["nondeterministic", "deterministic"])
def test_varlen_offsets_unread_when_max_seqlen_given(deterministic, device, triton_path):
    """With both max_seqlen given the Triton path reads no offset (no host sync): the values go
    unchecked, and a max_seqlen below the longest (here 4 and 0 for sequences of 5) changes nothing,
    since the kernels take it as a tuning hint and find each sequence's length in the offsets."""
    q, k, v, cu = _packed(device)
    grad_out = torch.randn_like(q)
    call = functools.partial(flash_attn_varlen_func, cu_seqlens_q=cu, cu_seqlens_k=cu, deterministic=deterministic)
    exact = attention_grads(call, q, k, v, grad_out, max_seqlen_q=5, max_seqlen_k=5)
    hinted = attention_grads(call, q, k, v, grad_out, max_seqlen_q=4, max_seqlen_k=0)
    for name, a, b in zip(("out", "dq", "dk", "dv"), hinted, exact):
        torch.testing.assert_close(a, b, atol=2e-3, rtol=0, msg=name)
    with pytest.raises(ValueError, match="max_seqlen_q=4"):
        call(q, k, v, max_seqlen_q=4, max_seqlen_k=5, check_lengths=True)


def test_varlen_check_lengths_option(device, monkeypatch):
    q, k, v, cu = _packed(device)
    with pytest.raises(ValueError, match="check_lengths must be a bool or None"):
        flash_attn_varlen_func(q, k, v, cu, cu, 5, 5, check_lengths="no")
    monkeypatch.setenv("FLASHFORMER_KERNEL", "triton")
    with pytest.raises(ValueError, match="check_lengths=False needs max_seqlen_q and max_seqlen_k"):
        flash_attn_varlen_func(q, k, v, cu, cu, None, 5, check_lengths=False)
    monkeypatch.setenv("FLASHFORMER_KERNEL", "torch")
    with pytest.raises(ValueError, match="and the Triton path"):
        flash_attn_varlen_func(q, k, v, cu, cu, 5, 5, check_lengths=False)


def test_varlen_offsets_changed_in_place_are_checked_again(device):
    """Offsets are value-checked once per tensor version (one device read for a model's layers), so an
    in-place change after a good call is still caught."""
    q, k, v, cu = _packed(device)
    flash_attn_varlen_func(q, k, v, cu, cu)
    cu[1] = 9  # [0, 9, 8]
    with pytest.raises(ValueError, match="cu_seqlens_q must be non-decreasing"):
        flash_attn_varlen_func(q, k, v, cu, cu)


def test_varlen_offsets_made_under_inference_mode(device):
    """Inference tensors have no version counter: they are checked on every call, in place changes too."""
    with torch.inference_mode():
        q, k, v, cu = _packed(device)
        flash_attn_varlen_func(q, k, v, cu, cu)
        cu[1] = 9  # [0, 9, 8]
        with pytest.raises(ValueError, match="cu_seqlens_q must be non-decreasing"):
            flash_attn_varlen_func(q, k, v, cu, cu)


def test_packing_helpers_round_trip():
    doc_ids = torch.tensor([[7, 7, 2, 2, 2], [2, 2, 9, 9, 9]])
    cu, longest = cu_seqlens_from_document_ids(doc_ids)
    assert cu.tolist() == [0, 2, 5, 7, 10] and cu.dtype == torch.int32 and longest == 3
    assert document_ids_from_cu_seqlens(cu).tolist() == [0, 0, 1, 1, 1, 2, 2, 3, 3, 3]
    assert position_ids_from_cu_seqlens(cu).tolist() == [0, 1, 0, 1, 2, 0, 1, 0, 1, 2]
    assert cu_seqlens_from_lengths([3, 0, 2]).tolist() == [0, 3, 3, 5]
    with pytest.raises(ValueError, match="lengths"):
        cu_seqlens_from_lengths([2, -1])



@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_varlen_backward_for_a_given_out_and_lse(impl, device, monkeypatch):
    """flash_attn_varlen_backward on the forward's own (out, lse) is that forward's autograd backward, bit for
    bit (head_dim 12 padded to the kernels' 16, GQA, an empty sequence, a causal window). Ring attention
    feeds it (out, lse) merged over more keys (tests/test_context_parallel.py)."""
    monkeypatch.setenv("FLASHFORMER_KERNEL", impl)
    monkeypatch.setattr(launch, "POISON_OUTPUTS", True)
    lengths_q, lengths_k = [9, 0, 20], [12, 6, 20]
    cu_q, cu_k = (cu_seqlens_from_lengths(n).to(device) for n in (lengths_q, lengths_k))
    q = torch.randn(sum(lengths_q), 4, 12, device=device)
    k, v = (torch.randn(sum(lengths_k), 2, 12, device=device) for _ in range(2))
    grad_out = torch.randn_like(q)
    opts = dict(causal=True, window_size=(7, -1))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = flash_attn_varlen_func(*leaves, cu_q, cu_k, 20, 20, return_lse=True, **opts)
    expected = torch.autograd.grad(out, leaves, grad_out)
    grads = flash_attn_varlen_backward(grad_out, q, k, v, out.detach(), lse.detach(), cu_q, cu_k, 20, 20, **opts)
    for name, ours, ref in zip(("dq", "dk", "dv"), grads, expected):
        torch.testing.assert_close(ours, ref, atol=0, rtol=0, msg=lambda m: f"{name}: {m}")
    with pytest.raises(ValueError, match=r"lse must be fp32 \(heads_q, total_q\) = \(4, 29\)"):
        flash_attn_varlen_backward(grad_out, q, k, v, out, lse.T, cu_q, cu_k, 20, 20, **opts)
    with pytest.raises(ValueError, match=r"grad_out must be \(total_q, heads_q, head_dim_v\)"):
        flash_attn_varlen_backward(grad_out[:-1], q, k, v, out, lse, cu_q, cu_k, 20, 20, **opts)


def test_packed_statistics_start_on_16_byte_boundaries(device, triton_path):
    """The preprocess stores each packed sequence's row statistics from a multiple of 4 rows (the Gluon dK/dV
    kernel's TMA copies need an aligned coordinate), in order and apart, inside row_stats_buffers' run, the
    rows between them left at +inf / 0."""
    from flashformer.kernels import bwd_stats

    lengths, heads, head_dim = [1, 70, 0, 3, 33, 5], 2, 32
    total = sum(lengths)
    cu = cu_seqlens_from_lengths(lengths).to(device)
    out, grad_out = (torch.randn(total, heads, head_dim, device=device) for _ in range(2))
    lse = torch.randn(heads, total, device=device)
    lse_log2, delta, strides_stats = bwd_stats.row_stats_buffers(lse, max(lengths), True, num_seqs=len(lengths))
    bwd_stats.launch_preprocess(out, grad_out, lse, None, delta, lse_log2, cu, len(lengths), max(lengths),
                                (0, lse.stride(0)), strides_stats, head_dim, head_dim, True)
    expected_delta = (out * grad_out).sum(-1).T  # (heads, total)
    written = torch.zeros(lse_log2.shape[-1], dtype=torch.bool)
    end = 0
    for b, n in enumerate(lengths):
        first = int(cu[b])
        start = (first + 3 * b + 3) // 4 * 4
        assert start % 4 == 0 and start >= end
        torch.testing.assert_close(lse_log2[0, :, start:start + n], lse[:, first:first + n] * math.log2(math.e))
        torch.testing.assert_close(delta[0, :, start:start + n], expected_delta[:, first:first + n])
        written[start:start + n] = True
        end = start + n
    assert torch.isinf(lse_log2[0][:, ~written]).all() and lse_log2[0][:, ~written].gt(0).all()
    assert delta[0][:, ~written].eq(0).all()
