"""The fixed-point dQ of the fused Gluon backward (flash_bwd_hopper's DQ_FIXED_POINT): each key block's share of dQ,
scaled by its query head's power of two (dq_reduce_hopper.fixed_point_scales) and rounded to int32, summed in any
order. The kernel runs on the H200 only (bench_gluon_backward.py --check compares it there); here the scales' bound
is checked against fp64 shares, and the arithmetic the kernel does, in torch, against fp64 dQ."""

import math

import pytest
import torch

from flashformer.kernels.dq_reduce_hopper import FIXED_POINT_RANGE, fixed_point_scales

KEY_BLOCK = 64  # a consumer's keys: one share per (query row, consumer of a key block)


def dq_shares(q, k, v, grad_out, causal):
    """fp64 shares dS K of every key block, (blocks, batch, seqlen_q, heads_q, head_dim), dQ / softmax_scale summed."""
    group = q.shape[2] // k.shape[2]
    q, k, v, grad_out = (t.double().transpose(1, 2) for t in (q, k, v, grad_out))
    k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))
    scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    if causal:  # bottom-right aligned
        rows, cols = scores.shape[-2:]
        scores = scores.masked_fill(torch.ones(rows, cols, dtype=torch.bool).tril(cols - rows).logical_not(), -math.inf)
    p = scores.softmax(dim=-1).nan_to_num(0.0)
    dp = grad_out @ v.transpose(-1, -2)
    ds = p * (dp - (p * dp).sum(dim=-1, keepdim=True))
    blocks = [ds[..., j:j + KEY_BLOCK] @ k[..., j:j + KEY_BLOCK, :] for j in range(0, k.shape[-2], KEY_BLOCK)]
    return torch.stack(blocks).transpose(2, 3)


def inputs(batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, dtype=torch.bfloat16):
    q = torch.randn(batch, seqlen_q, heads_q, head_dim, dtype=dtype)
    k, v = (torch.randn(batch, seqlen_k, heads_kv, head_dim, dtype=dtype) for _ in range(2))
    return q, k, v, torch.randn_like(q)


@pytest.mark.parametrize("case", ["random", "peaked", "one-large-row", "gqa-causal"])
def test_scales_bound_every_partial_sum_of_the_shares_and_are_tight_powers_of_two(case):
    q, k, v, grad_out = inputs(2, 97, 203, 4, 4 if case != "gqa-causal" else 2, 64)
    if case == "peaked":  # attention concentrated on one key per row: the shares' largest case
        q, k = q * 8, k * 8
    if case == "one-large-row":
        grad_out[1, 5] *= 1000
    shares = dq_shares(q, k, v, grad_out, causal=case == "gqa-causal")
    scales = fixed_point_scales(grad_out, k, v).double()
    # every prefix of the blocks in two orders (any order's running sums are sums of some blocks)
    for order in (torch.arange(shares.shape[0]), torch.randperm(shares.shape[0])):
        running = shares[order].cumsum(dim=0).abs().amax(dim=(0, 2, 4))
        assert (running * scales <= FIXED_POINT_RANGE).all(), (running * scales).max()
    assert torch.equal(scales, torch.exp2(torch.log2(scales).round()))
    # tight: the bound's worth doubled would pass the range
    do_norm = grad_out.double().norm(dim=-1).amax(dim=1)
    bound = 2 * do_norm * (v.double().norm(dim=-1).amax(dim=1) * k.double().abs().amax(dim=(1, 3))).repeat_interleave(
        q.shape[2] // k.shape[2], dim=1)
    assert (bound * scales <= FIXED_POINT_RANGE).all() and (2 * bound * scales > FIXED_POINT_RANGE).all()


def test_scales_hold_a_share_at_half_the_bound():
    """Two keys, equally likely, with opposite values and opposite keys: dS = +-1/2 and the share is m, half the
    bound 2 |dO| |V| max|K| = 2m, so a bound any smaller than half would overflow the range here."""
    m = 64.0
    q = torch.tensor([3.0, 0, 0, 0]).view(1, 1, 1, 4)
    k = torch.tensor([[1.0, m, 0, 0], [1.0, -m, 0, 0]]).view(1, 2, 1, 4)
    v = torch.tensor([[1.0, 0, 0, 0], [-1.0, 0, 0, 0]]).view(1, 2, 1, 4)
    grad_out = torch.tensor([1.0, 0, 0, 0]).view(1, 1, 1, 4)
    share = dq_shares(q, k, v, grad_out, causal=False).sum(dim=0)
    assert share[0, 0, 0, 1].item() == pytest.approx(m)
    scale = fixed_point_scales(grad_out, k, v).item()
    assert m * scale <= FIXED_POINT_RANGE < 4 * m * scale


def test_scales_are_nan_for_a_non_finite_bound_and_finite_for_a_zero_one():
    q, k, v, grad_out = inputs(1, 33, 40, 4, 2, 32)
    grad_out[0, 7, 2, 1] = float("inf")
    scales = fixed_point_scales(grad_out, k, v)
    assert scales[0, 2].isnan() and scales[0, [0, 1, 3]].isfinite().all()
    zero = fixed_point_scales(torch.zeros_like(grad_out), k, v)
    assert zero.isfinite().all() and (zero > 0).all()


def test_fixed_point_sums_are_the_same_in_any_order_and_far_below_the_outputs_rounding():
    """The kernel's arithmetic: round(share * scale) to int32, add in arrival order, times 1 / scale. Three orders
    give the same bits. The error against fp64 is a per-head absolute one (the scale's resolution), so it is held
    to what flash-attn's rule compares, the largest error over the tensor: under an eighth of fp16's rounding at
    dQ's largest element (fp16 is the finer of the kernel's two output dtypes), at 8k keys (128 shares a row)."""
    q, k, v, grad_out = inputs(1, 128, 8192, 2, 2, 64)
    shares = dq_shares(q, k, v, grad_out, causal=True)
    exact = shares.sum(dim=0)
    scales = fixed_point_scales(grad_out, k, v).double()[:, None, :, None]
    results = []
    for order in (torch.arange(shares.shape[0]), torch.randperm(shares.shape[0]), torch.randperm(shares.shape[0])):
        fixed = torch.zeros(exact.shape, dtype=torch.int32)
        for block in order:  # each share as the kernel forms it, in fp32
            fixed += torch.round(shares[block].float().double() * scales).to(torch.int32)
        results.append(fixed)
    assert all(torch.equal(results[0], other) for other in results[1:])
    error = (results[0].double() / scales - exact).abs().max().item()
    fp16_rounding = exact.abs().max().item() * 2.0 ** -11
    assert error < fp16_rounding / 8, (error, fp16_rounding)
