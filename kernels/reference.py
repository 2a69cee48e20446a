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

``dropout_keep_mask`` is the kernels' dropout mask (tile_ops.dropout_keep) bit for bit: Philox4x32-10
in int64 arithmetic, so the PyTorch path drops what the Triton path drops for the same seed, and the
tests check the kernels against this module's math with the very mask they used.
"""

from __future__ import annotations

import math

import torch

from .masking import key_block_range, normalize_window, visible_mask
from .sizes import next_power_of_2

# Tile sizes of the CPU loop: large enough that each einsum amortises Python overhead, small enough that one tile of
# scores (batch * heads * MAX_TILE^2 fp32) stays modest. Under a causal or window mask a row of tiles holds about four,
# so that most of the scores past the mask are skipped with their tiles rather than computed and discarded.
MAX_TILE = 512
MIN_TILE = 128

_LOW_32_BITS = 0xFFFFFFFF
# Philox4x32's Weyl key increments and round multipliers (Salmon et al., SC'11), as in triton.language.random.
_PHILOX_KEY_A, _PHILOX_KEY_B = 0x9E3779B9, 0xBB67AE85
_PHILOX_ROUND_A, _PHILOX_ROUND_B = 0xD2511F53, 0xCD9E8D57
PHILOX_ROUNDS = 10


def _mul_wide(multiplier, x):
    """(high, low) 32-bit halves of ``multiplier * x`` for uint32 values held in int64 tensors: the
    product is formed from 16-bit halves of x so that no partial result passes 2**63."""
    lo_product = multiplier * (x & 0xFFFF)
    hi_product = multiplier * (x >> 16)
    high = (hi_product + (lo_product >> 16)) >> 16
    low = (lo_product + ((hi_product & 0xFFFF) << 16)) & _LOW_32_BITS
    return high, low


def philox_4x32(seed, c0, c1, c2, c3, rounds=PHILOX_ROUNDS):
    """First output word of Philox4x32 for key ``seed`` (a 64-bit int) and counters c0..c3 (int64
    tensors of uint32 values, broadcastable), equal to triton.language.philox's; int64 in [0, 2**32)."""
    k0, k1 = seed & _LOW_32_BITS, (seed >> 32) & _LOW_32_BITS
    c0, c1, c2, c3 = torch.broadcast_tensors(c0, c1, c2, c3)
    for _ in range(rounds):
        high_b, low_b = _mul_wide(_PHILOX_ROUND_B, c2)
        high_a, low_a = _mul_wide(_PHILOX_ROUND_A, c0)
        c0, c1, c2, c3 = high_b ^ c1 ^ k0, low_b, high_a ^ c3 ^ k1, low_a
        k0, k1 = (k0 + _PHILOX_KEY_A) & _LOW_32_BITS, (k1 + _PHILOX_KEY_B) & _LOW_32_BITS
    return c0


def dropout_threshold(dropout_p):
    """What a draw's top 31 bits must reach for its element to be kept: dropout_p * 2**31, rounded."""
    return min(round(dropout_p * 2**31), 2**31 - 1)


def dropout_keep_mask(seed, dropout_p, batch, head, rows, cols):
    """Bool mask of the elements dropout keeps, as tile_ops.dropout_keep draws it.

    Args:
        seed: the call's 64-bit Philox key (checks.draw_dropout_seed).
        batch, head, rows, cols: broadcastable int64 index tensors: sequence, query head, query row and
            key column (both within the sequence).
    """
    draw = philox_4x32(seed, cols, rows, head, batch)
    return (draw >> 1) >= dropout_threshold(dropout_p)


def alibi_bias(slopes, rows, cols, seqlen_q, seqlen_k):
    """ALiBi's -slope * |i + seqlen_k - seqlen_q - j| for ``slopes`` broadcast against the (rows, cols)
    grid of ``rows[:, None]``, ``cols[None, :]``."""
    distance = (rows[:, None] + (seqlen_k - seqlen_q) - cols[None, :]).abs()
    return -slopes[..., None, None] * distance.to(slopes.dtype)


def _scores(q_tile, k_tile, scale, softcap):
    """Raw q.k scores (fp32) -> attention logits; also returns tanh(.) for the softcap gradient."""
    s = torch.einsum("bhgqd,bhkd->bhgqk", q_tile, k_tile)
    if softcap > 0.0:
        t = torch.tanh(s * (scale / softcap))
        return t * softcap, t
    return s * scale, None


class _TiledAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, window_left, window_right, softcap, alibi_slopes, dropout):
        out, lse = _tiled_forward(q, k, v, scale, window_left, window_right, softcap, alibi_slopes, dropout)
        ctx.save_for_backward(q, k, v, out, lse, alibi_slopes)
        ctx.params = (scale, window_left, window_right, softcap)
        ctx.dropout = dropout
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse, alibi_slopes = ctx.saved_tensors
        dq, dk, dv = tiled_backward(grad_out, grad_lse, q, k, v, out, lse, *ctx.params, alibi_slopes, ctx.dropout)
        return dq, dk, dv, None, None, None, None, None, None


def _group_layout(q, k, v):
    """(b, s, h, d) -> q: (b, hkv, group, s, d) fp32; k, v: (b, hkv, s, d) fp32. No K/V repeat."""
    batch, seqlen_q, heads_q, head_dim = q.shape
    heads_kv = k.shape[2]
    group = heads_q // heads_kv
    qg = q.float().view(batch, seqlen_q, heads_kv, group, head_dim).permute(0, 2, 3, 1, 4)
    return qg, k.float().transpose(1, 2), v.float().transpose(1, 2)


def _tile_logits(qg, kf, q0, q1, k0, k1, seqlen_q, seqlen_k, scale, softcap, alibi_g):
    """Logits of one tile pair (with ALiBi's bias when ``alibi_g``, slopes (batch, heads_kv, group),
    is given) and tanh(.) for the softcap gradient."""
    s, t = _scores(qg[..., q0:q1, :], kf[:, :, k0:k1], scale, softcap)
    if alibi_g is not None:
        s = s + alibi_bias(alibi_g, torch.arange(q0, q1, device=qg.device), torch.arange(k0, k1, device=qg.device),
                           seqlen_q, seqlen_k)
    return s, t


def _tile_keep(dropout, q0, q1, k0, k1, batch, heads_kv, group, device):
    """Dropout's keep mask of one tile pair, (batch, heads_kv, group, rows, cols), or None."""
    if dropout is None:
        return None
    dropout_p, seed, batch_start = dropout
    index = torch.arange
    return dropout_keep_mask(seed, dropout_p, (index(batch, device=device) + batch_start).view(-1, 1, 1, 1, 1),
                             index(heads_kv * group, device=device).view(1, heads_kv, group, 1, 1),
                             index(q0, q1, device=device)[:, None], index(k0, k1, device=device)[None, :])


def _grouped_slopes(alibi_slopes, batch, heads_kv, group):
    return None if alibi_slopes is None else alibi_slopes.view(batch, heads_kv, group)


def tile_size(seqlen_q, seqlen_k, window_left, window_right):
    """Rows and keys per tile of the CPU loop: MAX_TILE unmasked, about a quarter of the longer side under a mask."""
    if window_left < 0 and window_right < 0:
        return MAX_TILE
    return min(MAX_TILE, max(MIN_TILE, next_power_of_2(max(seqlen_q, seqlen_k)) // 4))


def _tile_pairs(seqlen_q, seqlen_k, window_left, window_right):
    """Yield (q0, q1, k0, k1, needs_mask) for every tile pair with at least one visible score."""
    tile = tile_size(seqlen_q, seqlen_k, window_left, window_right)
    for q0 in range(0, seqlen_q, tile):
        q1 = min(q0 + tile, seqlen_q)
        lo, full_lo, full_hi, hi = key_block_range(q0, q1, seqlen_q, seqlen_k, window_left, window_right)
        for k0 in range((lo // tile) * tile, hi, tile):
            k1 = min(k0 + tile, seqlen_k)
            yield q0, q1, k0, k1, not (full_lo <= k0 and k1 <= full_hi)


def _tiled_forward(q, k, v, scale, window_left, window_right, softcap, alibi_slopes, dropout):
    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    qg, kf, vf = _group_layout(q, k, v)
    alibi_g = _grouped_slopes(alibi_slopes, batch, heads_kv, heads_q // heads_kv)
    out = torch.zeros_like(qg)
    row_max = torch.full(qg.shape[:-1], -math.inf, dtype=torch.float32, device=q.device)
    row_sum = torch.zeros_like(row_max)
    for q0, q1, k0, k1, needs_mask in _tile_pairs(seqlen_q, seqlen_k, window_left, window_right):
        s, _ = _tile_logits(qg, kf, q0, q1, k0, k1, seqlen_q, seqlen_k, scale, softcap, alibi_g)
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
        keep = _tile_keep(dropout, q0, q1, k0, k1, batch, heads_kv, heads_q // heads_kv, q.device)
        if keep is not None:  # the sum normalises by every probability, the output sees the kept ones
            p = p * keep
        out[..., q0:q1, :] = out[..., q0:q1, :] * alpha[..., None] + p @ vf[:, :, None, k0:k1]
        row_max[..., q0:q1] = m_new
    empty = row_sum == 0
    out = out / torch.where(empty, torch.ones_like(row_sum), row_sum)[..., None]
    if dropout is not None:
        out = out / (1.0 - dropout[0])
    lse = torch.where(empty, torch.full_like(row_sum, -math.inf), row_max + torch.log(row_sum))
    out = out.permute(0, 3, 1, 2, 4).reshape(batch, seqlen_q, heads_q, head_dim).to(q.dtype)
    return out, lse.reshape(batch, heads_q, seqlen_q)


def tiled_backward(grad_out, grad_lse, q, k, v, out, lse, scale, window_left, window_right, softcap, alibi_slopes=None,
                   dropout=None):
    """(dq, dk, dv) of attention_tiled for its (out, lse), tile by tile; lse may normalize over more keys than k.

    Args:
        grad_out: like out; grad_lse: like lse, or None. q, k, v, scale, window_left, window_right,
            softcap, alibi_slopes: as attention_tiled. dropout: (dropout_p, seed, batch_start), or None.
    """
    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    group = heads_q // heads_kv
    qg, kf, vf = _group_layout(q, k, v)
    alibi_g = _grouped_slopes(alibi_slopes, batch, heads_kv, group)
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
        s, t = _tile_logits(qg, kf, q0, q1, k0, k1, seqlen_q, seqlen_k, scale, softcap, alibi_g)
        p = torch.exp(s - lse_g[..., q0:q1, None])
        if needs_mask:
            mask = visible_mask(q0, q1, k0, k1, seqlen_q, seqlen_k, window_left, window_right, q.device)
            p = p.masked_fill(~mask, 0.0)
        do_tile = dog[..., q0:q1, :]
        dp = torch.einsum("bhgqd,bhkd->bhgqk", do_tile, v_tile)
        keep = _tile_keep(dropout, q0, q1, k0, k1, batch, heads_kv, group, q.device)
        if keep is not None:
            rescaled_keep = keep / (1.0 - dropout[0])
            dv[:, :, k0:k1] += torch.einsum("bhgqk,bhgqd->bhkd", p * rescaled_keep, do_tile)
            dp = dp * rescaled_keep
        else:
            dv[:, :, k0:k1] += torch.einsum("bhgqk,bhgqd->bhkd", p, do_tile)
        ds = p * (dp - delta[..., q0:q1, None])
        if t is not None:
            ds = ds * (1.0 - t * t)
        dq[..., q0:q1, :] += scale * (ds @ k_tile[:, :, None])
        dk[:, :, k0:k1] += scale * torch.einsum("bhgqk,bhgqd->bhkd", ds, q_tile)
    dq = dq.permute(0, 3, 1, 2, 4).reshape(batch, seqlen_q, heads_q, head_dim)
    return dq.to(q.dtype), dk.transpose(1, 2).to(k.dtype), dv.transpose(1, 2).to(v.dtype)


def attention_tiled(q, k, v, softmax_scale, window_left, window_right, softcap, alibi_slopes=None, dropout_p=0.0,
                    dropout_seed=0, batch_start=0):
    """O(seqlen)-memory PyTorch attention; differentiable in q, k, v.

    Args:
        q: (batch, seqlen_q, heads_q, head_dim); k, v: (batch, seqlen_k, heads_kv, head_dim).
        softmax_scale, window_left, window_right (causal folded in), softcap: validated by the interface.
        alibi_slopes: None, or fp32 (batch, heads_q).
        dropout_p, dropout_seed: dropout's probability and 64-bit Philox key (dropout_keep_mask).
        batch_start: the sequence index of batch row 0 in the mask's counter (varlen calls run one
            sequence at a time).
    Returns:
        out like q, lse (batch, heads_q, seqlen_q) fp32 (-inf for rows that see no key).
    """
    dropout = (dropout_p, dropout_seed, batch_start) if dropout_p > 0.0 else None
    return _TiledAttention.apply(q, k, v, softmax_scale, window_left, window_right, softcap, alibi_slopes, dropout)


def attention_probabilities(q, k, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            alibi_slopes=None):
    """Softmax probabilities (batch, heads_q, seqlen_q, seqlen_k) in q's dtype and lse (batch, heads_q,
    seqlen_q) fp32, from the full score matrix; rows that see no key are all 0 (lse -inf).

    Args:
        q, k, softmax_scale, causal, window_size, softcap: as attention_materialized.
        alibi_slopes: None, or (heads_q,) / (batch, heads_q): ALiBi's bias, added after softcap.
    """
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    k = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k)
    if softcap > 0.0:
        s = softcap * torch.tanh(s * (scale / softcap))
    else:
        s = s * scale
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(s.dtype).expand(q.shape[0], q.shape[2])
        s = s + alibi_bias(slopes, torch.arange(seqlen_q, device=q.device), torch.arange(seqlen_k, device=q.device),
                           seqlen_q, seqlen_k)
    window_left, window_right = normalize_window(causal, window_size)
    mask = visible_mask(0, seqlen_q, 0, seqlen_k, seqlen_q, seqlen_k, window_left, window_right, q.device)
    s = s.masked_fill(~mask, -math.inf)
    lse = torch.logsumexp(s.float(), dim=-1)
    return torch.softmax(s, dim=-1).nan_to_num(0.0), lse  # rows with no visible key: all -inf -> NaN -> 0


def attention_materialized(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                           upcast=True, alibi_slopes=None, dropout_p=0.0, dropout_mask=None):
    """The full-score-matrix formula: the test oracle and the "naive" backend.

    Args:
        q: (batch, seqlen_q, heads_q, head_dim); k, v: (batch, seqlen_k, heads_kv, head_dim).
        upcast: compute in fp32 (or fp64 if the inputs are fp64) instead of the input precision.
        alibi_slopes: None, or (heads_q,) / (batch, heads_q) (see attention_probabilities).
        dropout_p, dropout_mask: with dropout_p > 0, the bool mask (batch, heads_q, seqlen_q, seqlen_k)
            of the probabilities kept (dropout_keep_mask); the kept ones are scaled by 1 / (1 - dropout_p).
    Returns:
        out like q (in the compute dtype when upcast), lse (batch, heads_q, seqlen_q) fp32.
    """
    dtype_in = q.dtype
    if upcast and q.dtype != torch.float64:
        q, k, v = q.float(), k.float(), v.float()
    p, lse = attention_probabilities(q, k, softmax_scale, causal, window_size, softcap, alibi_slopes)
    if dropout_p > 0.0:
        if dropout_mask is None:
            raise ValueError("dropout_p > 0 needs dropout_mask, the mask of the kept probabilities")
        p = p * dropout_mask / (1.0 - dropout_p)
    out = torch.einsum("bhqk,bkhd->bqhd", p.to(v.dtype), v.repeat_interleave(q.shape[2] // v.shape[2], dim=2))
    return (out if upcast else out.to(dtype_in)), lse
