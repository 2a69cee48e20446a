"""PyTorch attention with the kernels' exact semantics.

Two implementations live here:

* ``attention_tiled``: the CPU path. An online-softmax loop over (query tile, key tile) pairs with a
  custom backward that recomputes each tile, so memory stays O(seqlen): a 64k-token sequence on CPU
  never allocates seqlen_q x seqlen_k. Computes in fp32 whatever the input dtype.
* ``attention_materialized``: the textbook formula with the full score matrix, used as the test
  oracle (in fp64 / fp32 or in the input precision) and as the "naive" backend that measures what
  the flash path saves.

Both take (batch, seqlen, heads, head_dim) tensors like flash_attn_func, share ``visible_mask`` for
causal / sliding-window semantics, and return (out, lse) with lse (batch, heads_q, seqlen_q) fp32.
"""

from __future__ import annotations

import math

import torch

from .masking import key_block_range, normalize_window, visible_mask

# Tile sizes of the CPU loop: large enough that each einsum amortises Python overhead,
# small enough that one tile of scores (batch * heads * TILE_Q * TILE_K fp32) stays modest.
TILE_Q = 512
TILE_K = 512


def _scores(q_tile, k_tile, scale, softcap):
    """Raw q.k scores (fp32) -> attention logits; also returns tanh(.) for the softcap gradient."""
    s = torch.einsum("bhgqd,bhkd->bhgqk", q_tile, k_tile)
    if softcap > 0.0:
        t = torch.tanh(s * (scale / softcap))
        return t * softcap, t
    return s * scale, None


class _TiledAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, window_left, window_right, softcap):
        out, lse = _tiled_forward(q, k, v, scale, window_left, window_right, softcap)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.params = (scale, window_left, window_right, softcap)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _tiled_backward(grad_out, grad_lse, q, k, v, out, lse, *ctx.params)
        return dq, dk, dv, None, None, None, None


def _group_layout(q, k, v):
    """(b, s, h, d) -> q: (b, hkv, group, s, d) fp32; k, v: (b, hkv, s, d) fp32. No K/V repeat."""
    batch, seqlen_q, heads_q, head_dim = q.shape
    heads_kv = k.shape[2]
    group = heads_q // heads_kv
    qg = q.float().view(batch, seqlen_q, heads_kv, group, head_dim).permute(0, 2, 3, 1, 4)
    return qg, k.float().transpose(1, 2), v.float().transpose(1, 2)


def _tile_pairs(seqlen_q, seqlen_k, window_left, window_right):
    """Yield (q0, q1, k0, k1, needs_mask) for every tile pair with at least one visible score."""
    for q0 in range(0, seqlen_q, TILE_Q):
        q1 = min(q0 + TILE_Q, seqlen_q)
        lo, full_lo, full_hi, hi = key_block_range(q0, q1, seqlen_q, seqlen_k, window_left, window_right)
        for k0 in range((lo // TILE_K) * TILE_K, hi, TILE_K):
            k1 = min(k0 + TILE_K, seqlen_k)
            yield q0, q1, k0, k1, not (full_lo <= k0 and k1 <= full_hi)


def _tiled_forward(q, k, v, scale, window_left, window_right, softcap):
    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k = k.shape[1]
    qg, kf, vf = _group_layout(q, k, v)
    out = torch.zeros_like(qg)
    row_max = torch.full(qg.shape[:-1], -math.inf, dtype=torch.float32, device=q.device)
    row_sum = torch.zeros_like(row_max)
    for q0, q1, k0, k1, needs_mask in _tile_pairs(seqlen_q, seqlen_k, window_left, window_right):
        s, _ = _scores(qg[..., q0:q1, :], kf[:, :, k0:k1], scale, softcap)
        if needs_mask:
            mask = visible_mask(q0, q1, k0, k1, seqlen_q, seqlen_k, window_left, window_right, q.device)
            s = s.masked_fill(~mask, -math.inf)
        m_old = row_max[..., q0:q1]
        m_new = torch.maximum(m_old, s.amax(-1))
        # Rows that have seen no key yet keep m = -inf; shift them by 0 so exp() stays finite.
        m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        p = torch.exp(s - m_safe[..., None])
        alpha = torch.exp(m_old - m_safe)
        row_sum[..., q0:q1] = row_sum[..., q0:q1] * alpha + p.sum(-1)
        out[..., q0:q1, :] = out[..., q0:q1, :] * alpha[..., None] + p @ vf[:, :, None, k0:k1]
        row_max[..., q0:q1] = m_new
    empty = row_sum == 0
    out = out / torch.where(empty, torch.ones_like(row_sum), row_sum)[..., None]
    lse = torch.where(empty, torch.full_like(row_sum, -math.inf), row_max + torch.log(row_sum))
    out = out.permute(0, 3, 1, 2, 4).reshape(batch, seqlen_q, heads_q, head_dim).to(q.dtype)
    return out, lse.reshape(batch, heads_q, seqlen_q)


def _tiled_backward(grad_out, grad_lse, q, k, v, out, lse, scale, window_left, window_right, softcap):
    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    group = heads_q // heads_kv
    qg, kf, vf = _group_layout(q, k, v)
    dog = grad_out.float().view(batch, seqlen_q, heads_kv, group, head_dim).permute(0, 2, 3, 1, 4)
    og = out.float().view(batch, seqlen_q, heads_kv, group, head_dim).permute(0, 2, 3, 1, 4)
    lse_g = lse.view(batch, heads_kv, group, seqlen_q)
    # d lse / d s = p, so a gradient flowing into lse enters exactly like -delta.
    delta = (dog * og).sum(-1)
    if grad_lse is not None:
        delta = delta - grad_lse.view_as(delta)
    # Empty rows carry lse = -inf; +inf makes every p of theirs 0 instead of NaN.
    lse_g = torch.where(torch.isneginf(lse_g), torch.full_like(lse_g, math.inf), lse_g)
    dq = torch.zeros_like(qg)
    dk = torch.zeros_like(kf)
    dv = torch.zeros_like(vf)
    for q0, q1, k0, k1, needs_mask in _tile_pairs(seqlen_q, seqlen_k, window_left, window_right):
        q_tile, k_tile, v_tile = qg[..., q0:q1, :], kf[:, :, k0:k1], vf[:, :, k0:k1]
        s, t = _scores(q_tile, k_tile, scale, softcap)
        p = torch.exp(s - lse_g[..., q0:q1, None])
        if needs_mask:
            mask = visible_mask(q0, q1, k0, k1, seqlen_q, seqlen_k, window_left, window_right, q.device)
            p = p.masked_fill(~mask, 0.0)
        do_tile = dog[..., q0:q1, :]
        dv[:, :, k0:k1] += torch.einsum("bhgqk,bhgqd->bhkd", p, do_tile)
        dp = torch.einsum("bhgqd,bhkd->bhgqk", do_tile, v_tile)
        ds = p * (dp - delta[..., q0:q1, None])
        if t is not None:
            ds = ds * (1.0 - t * t)
        dq[..., q0:q1, :] += scale * (ds @ k_tile[:, :, None])
        dk[:, :, k0:k1] += scale * torch.einsum("bhgqk,bhgqd->bhkd", ds, q_tile)
    dq = dq.permute(0, 3, 1, 2, 4).reshape(batch, seqlen_q, heads_q, head_dim)
    return dq.to(q.dtype), dk.transpose(1, 2).to(k.dtype), dv.transpose(1, 2).to(v.dtype)


def attention_tiled(q, k, v, softmax_scale, window_left, window_right, softcap):
    """O(seqlen)-memory PyTorch attention; differentiable in q, k, v.

    Args:
        q: (batch, seqlen_q, heads_q, head_dim); k, v: (batch, seqlen_k, heads_kv, head_dim).
        softmax_scale, window_left, window_right (causal folded in), softcap: validated by the interface.
    Returns:
        out like q, lse (batch, heads_q, seqlen_q) fp32 (-inf for rows that see no key).
    """
    return _TiledAttention.apply(q, k, v, softmax_scale, window_left, window_right, softcap)


def attention_materialized(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                           upcast=True):
    """The full-score-matrix formula: the test oracle and the "naive" backend.

    Args:
        q: (batch, seqlen_q, heads_q, head_dim); k, v: (batch, seqlen_k, heads_kv, head_dim).
        upcast: compute in fp32 (or fp64 if the inputs are fp64) instead of the input precision.
    Returns:
        out like q (in the compute dtype when upcast), lse (batch, heads_q, seqlen_q) fp32.
    """
    dtype_in = q.dtype
    if upcast and q.dtype != torch.float64:
        q, k, v = q.float(), k.float(), v.float()
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    group = q.shape[2] // k.shape[2]
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    k = k.repeat_interleave(group, dim=2)
    v = v.repeat_interleave(group, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k)
    if softcap > 0.0:
        s = softcap * torch.tanh(s * (scale / softcap))
    else:
        s = s * scale
    window_left, window_right = normalize_window(causal, window_size)
    mask = visible_mask(0, seqlen_q, 0, seqlen_k, seqlen_q, seqlen_k, window_left, window_right, q.device)
    s = s.masked_fill(~mask, -math.inf)
    lse = torch.logsumexp(s.float(), dim=-1)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # rows with no visible key: all -inf -> NaN -> 0
    out = torch.einsum("bhqk,bkhd->bqhd", p.to(v.dtype), v)
    return (out if upcast else out.to(dtype_in)), lse
