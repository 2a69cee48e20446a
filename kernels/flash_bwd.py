"""FlashAttention backward in Triton. Deterministic by default: no atomics, every gradient written by
one program.

Every query row needs two statistics, delta and lse in log2 units (bwd_stats.py, which also lays them out).

Two launches:
1. ``_bwd_dq_kernel``: one program per query tile and query head; it computes its rows' statistics
   (and stores them), then walks the key tiles in one loop and accumulates dQ.
2. ``_bwd_dkdv_kernel``: one program per key tile and kv head; it walks the query tiles that see the
   keys, for every query head of its GQA group, recomputing P^T from the stored lse, and accumulates
   dK and dV in registers (one loop, or three at head_dim <= 64: ONE_LOOP_DKDV_HEAD_DIM). Looping over
   the group inside the program (instead of atomics across programs) keeps GQA deterministic.

On the Gluon path (sm_90), where it covers the inputs (dense, 16-bit), the backward is bwd_stats' ``_bwd_preprocess``,
then flash_bwd_hopper.py's dQ and dK/dV kernels; with deterministic=False, where tuning measured it faster,
the dK/dV kernel alone, forming dQ too (flash_bwd_hopper.launch_fused: TMA reductions of each dQ share in
arrival order, its columns split between the consumers). Both beat the tl form below on the H200.

Elsewhere, with deterministic=False (where tuning.tl_reduced_dq_pays) there is no dQ kernel: ``_bwd_preprocess``
computes the statistics, and the dK/dV program also adds each query tile's dQ share dS K to an fp32 buffer
(TMA reductions on the GPU, pointer atomics in the interpreter): 5 tile matmuls instead of the dQ kernel's
7, at the price of a summation order that varies between runs.

With s = qk * scale (or softcap * tanh(qk * scale / softcap)), plus ALiBi's bias (no gradient):
dS = P * (dP - delta), and d qk = dS * scale (times 1 - tanh^2 with softcap). Dropout (the forward's
mask Z, regenerated from its seed, and r = 1 / (1 - dropout_p)) makes dV = (r Z * P)^T dO and
dP = r Z * (dO V^T); delta keeps its form, since rowsum(dO * O) = sum_j P_ij dP_ij still.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .flash_fwd import log2_scales
from .bwd_stats import STATS_ROWS, launch_preprocess, row_stats, row_stats_buffers, stats_start
from .launch import (INTERPRETED, as_descriptor_compatible, dot_precision, ensure_allocator, launcher, new_output,
                     seq_strides, seqs_pad, tile_grid, upcast_dot)
from .reference import dropout_threshold
from .sizes import next_power_of_2, pad_head_dim
from .tile_ops import (alibi_bias, dropout_keep, key_range, load_alibi_slope_log2, load_dropout_key, mma, narrow,
                       program_tile, query_range, rows_descriptor, sequence_bounds, tanh, visible)
from .tuning import checked_gluon_form, gluon_backward_form, pick_kernel, table_mask, tl_reduced_dq_pays, tuned

# The dK/dV kernel walks its query tiles in one loop (edge tiles masked under a branch) from this padded
# head_dim up, and in three loops (masked edge, unmasked middle, masked edge) below it: on the H200 one
# loop gained 2-11% at head_dim 128 and 256 and lost 4-13% at head_dim 64 (docs/perf-notes.md, "Backward").
ONE_LOOP_DKDV_HEAD_DIM = 128


@triton.jit
def _dkdv_tiles(dk, dv, k, v, q_desc, do_desc, dq_desc, DQ_ACC, stride_dq_acc, LSE_LOG2, DELTA, cols, start, end,
                un_lo, un_hi, qk_scale, softcap_log2, seqlen_q, seqlen_k, window_left, window_right,
                alibi_slope_log2, dropout_seed, head, batch, drop_threshold, dropout_rescale,
                BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                HAS_SOFTCAP: tl.constexpr, MASKED: tl.constexpr,
                LEFT_BOUNDED: tl.constexpr, RIGHT_BOUNDED: tl.constexpr, ACCUMULATE_DQ: tl.constexpr,
                DQ_TMA_REDUCE: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
                HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr, IS_VARLEN: tl.constexpr):
    for m0 in tl.range(start, end, BLOCK_M):
        q = q_desc.load([m0, 0])
        do = do_desc.load([m0, 0])
        rows = m0 + tl.arange(0, BLOCK_M)
        # Rows past the end get lse = +inf, so p = 0 and they add nothing: dense, from the statistics'
        # padding; packed (no padding between sequences), through the mask.
        if IS_VARLEN:
            lse_log2 = tl.load(LSE_LOG2 + rows, mask=rows < seqlen_q, other=float("inf"))
            delta = tl.load(DELTA + rows, mask=rows < seqlen_q, other=0.0)
        else:
            lse_log2 = tl.load(LSE_LOG2 + rows)
            delta = tl.load(DELTA + rows)
        s_t = mma(k, tl.trans(q), DOT_PRECISION, UPCAST_DOT) * qk_scale  # (BLOCK_N, BLOCK_M)
        if HAS_SOFTCAP:
            tanh_t = tanh(s_t)
            s_t = tanh_t * softcap_log2
        if HAS_ALIBI:
            s_t += alibi_bias(rows[None, :], cols[:, None], alibi_slope_log2, seqlen_q, seqlen_k)
        p_t = tl.exp2(s_t - lse_log2[None, :])
        if MASKED == 1:  # every tile of this loop
            keep = visible(rows[None, :], cols[:, None], seqlen_q, seqlen_k, window_left, window_right,
                           LEFT_BOUNDED, RIGHT_BOUNDED)
            p_t = tl.where(keep, p_t, 0.0)
        elif MASKED == 2:  # the tiles outside [un_lo, un_hi)
            if (m0 < un_lo) | (m0 >= un_hi):
                keep = visible(rows[None, :], cols[:, None], seqlen_q, seqlen_k, window_left, window_right,
                               LEFT_BOUNDED, RIGHT_BOUNDED)
                p_t = tl.where(keep, p_t, 0.0)
        if HAS_DROPOUT:  # the output saw the kept probabilities times dropout_rescale
            keep_t = dropout_keep(rows[None, :], cols[:, None], dropout_seed, head, batch, drop_threshold)
            dv += mma(narrow(tl.where(keep_t, p_t * dropout_rescale, 0.0), do.dtype), do, DOT_PRECISION, UPCAST_DOT)
        else:
            dv += mma(narrow(p_t, do.dtype), do, DOT_PRECISION, UPCAST_DOT)
        dp_t = mma(v, tl.trans(do), DOT_PRECISION, UPCAST_DOT)
        if HAS_DROPOUT:
            dp_t = tl.where(keep_t, dp_t * dropout_rescale, 0.0)
        ds_t = p_t * (dp_t - delta[None, :])
        if HAS_SOFTCAP:
            ds_t = ds_t * (1.0 - tanh_t * tanh_t)
        ds_t = narrow(ds_t, q.dtype)
        dk += mma(ds_t, q, DOT_PRECISION, UPCAST_DOT)
        if ACCUMULATE_DQ:  # this key tile's share of dQ, added to the fp32 accumulator in arrival order
            dq = mma(tl.trans(ds_t), k, DOT_PRECISION, UPCAST_DOT)
            if DQ_TMA_REDUCE:
                dq_desc.atomic_add([m0, 0], dq)
            else:  # Triton's interpreter has no TMA reduction
                dims = tl.arange(0, HEAD_DIM_PAD)
                tl.atomic_add(DQ_ACC + rows[:, None] * stride_dq_acc + dims[None, :], dq,
                              mask=(rows[:, None] < seqlen_q) & (dims[None, :] < HEAD_DIM))
    return dk, dv


@triton.jit
def _bwd_dkdv_kernel(
    Q, K, V, DO, DK, DV, DQ_ACC, LSE_LOG2, DELTA, CU_SEQLENS_Q, CU_SEQLENS_K, ALIBI_SLOPES, DROPOUT_SEED,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_dob, stride_dos, stride_doh, stride_dkb, stride_dks, stride_dkh, stride_dvb, stride_dvs, stride_dvh,
    stride_dqab, stride_dqas, stride_dqah,
    stride_stats_b, stride_stats_h, stride_alibi_b,
    seqlen_q, seqlen_k, num_seqs,
    softmax_scale, qk_scale, softcap_log2, window_left, window_right, drop_threshold, dropout_rescale,
    seqlen_q_bucket, seqlen_k_bucket,  # autotune keys only
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    LEFT_BOUNDED: tl.constexpr, RIGHT_BOUNDED: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    IS_VARLEN: tl.constexpr, SEQS_PAD: tl.constexpr, ACCUMULATE_DQ: tl.constexpr, DQ_TMA_REDUCE: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr, ONE_LOOP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr,
):
    # Key tiles first to last: under a causal mask the first keys are seen by the most queries.
    batch, pid_n, kv_head = program_tile(num_seqs, CU_SEQLENS_K, BLOCK_N, SEQS_PAD, False, IS_VARLEN)
    if batch >= num_seqs:
        return
    q_start, k_start, seqlen_q, seqlen_k = sequence_bounds(batch, seqlen_q, seqlen_k, CU_SEQLENS_Q, CU_SEQLENS_K,
                                                           IS_VARLEN)
    n0 = pid_n * BLOCK_N
    if n0 >= seqlen_k:
        return
    k_desc = rows_descriptor(K + batch * stride_kb + k_start * stride_ks + kv_head * stride_kh, seqlen_k, stride_ks,
                             BLOCK_N, HEAD_DIM, HEAD_DIM_PAD)
    v_desc = rows_descriptor(V + batch * stride_vb + k_start * stride_vs + kv_head * stride_vh, seqlen_k, stride_vs,
                             BLOCK_N, HEAD_DIM, HEAD_DIM_PAD)
    k = k_desc.load([n0, 0])
    v = v_desc.load([n0, 0])
    cols = n0 + tl.arange(0, BLOCK_N)
    dk = tl.zeros([BLOCK_N, HEAD_DIM_PAD], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM_PAD], dtype=tl.float32)
    start, un_lo, un_hi, end = query_range(n0, seqlen_q, seqlen_k, window_left, window_right,
                                           BLOCK_M, BLOCK_N, LEFT_BOUNDED, RIGHT_BOUNDED)
    tl.static_assert(STATS_ROWS % BLOCK_M == 0)  # dense, the query tiles end inside the statistics' padding
    stats_base = batch * stride_stats_b + stats_start(batch, q_start, IS_VARLEN)
    dropout_seed = load_dropout_key(DROPOUT_SEED, HAS_DROPOUT)
    # Never software-pipelined: the loop creates descriptors, which the pipeliner cannot predicate. It
    # would try when a query length of 1 (specialised as a constant) folds the inner loops away.
    for g in tl.range(GROUP, num_stages=1):
        head = kv_head * GROUP + g
        q_desc = rows_descriptor(Q + batch * stride_qb + q_start * stride_qs + head * stride_qh, seqlen_q, stride_qs,
                                 BLOCK_M, HEAD_DIM, HEAD_DIM_PAD)
        do_desc = rows_descriptor(DO + batch * stride_dob + q_start * stride_dos + head * stride_doh, seqlen_q,
                                  stride_dos, BLOCK_M, HEAD_DIM, HEAD_DIM_PAD)
        lse_ptr = LSE_LOG2 + stats_base + head * stride_stats_h
        delta_ptr = DELTA + stats_base + head * stride_stats_h
        alibi_slope_log2 = load_alibi_slope_log2(ALIBI_SLOPES, batch, head, stride_alibi_b, HAS_ALIBI)
        dq_acc = DQ_ACC
        dq_desc = q_desc  # a placeholder unless the TMA reduction is used
        if ACCUMULATE_DQ:
            dq_acc = DQ_ACC + batch * stride_dqab + q_start * stride_dqas + head * stride_dqah
            if DQ_TMA_REDUCE:
                dq_desc = rows_descriptor(dq_acc, seqlen_q, stride_dqas, BLOCK_M, HEAD_DIM, HEAD_DIM_PAD)
        if ONE_LOOP:  # one software pipeline per program: the edge tiles mask inside it
            dk, dv = _dkdv_tiles(dk, dv, k, v, q_desc, do_desc, dq_desc, dq_acc, stride_dqas, lse_ptr, delta_ptr,
                                 cols, start, end, un_lo, un_hi, qk_scale, softcap_log2, seqlen_q, seqlen_k,
                                 window_left, window_right, alibi_slope_log2, dropout_seed, head, batch, drop_threshold,
                                 dropout_rescale, BLOCK_M, HEAD_DIM, HEAD_DIM_PAD, HAS_SOFTCAP, 2,
                                 LEFT_BOUNDED, RIGHT_BOUNDED, ACCUMULATE_DQ, DQ_TMA_REDUCE, DOT_PRECISION, UPCAST_DOT,
                                 HAS_ALIBI, HAS_DROPOUT, IS_VARLEN)
        else:
            dk, dv = _dkdv_tiles(dk, dv, k, v, q_desc, do_desc, dq_desc, dq_acc, stride_dqas, lse_ptr, delta_ptr,
                                 cols, start, un_lo, un_lo, un_hi, qk_scale, softcap_log2, seqlen_q, seqlen_k,
                                 window_left, window_right, alibi_slope_log2, dropout_seed, head, batch, drop_threshold,
                                 dropout_rescale, BLOCK_M, HEAD_DIM, HEAD_DIM_PAD, HAS_SOFTCAP, 1,
                                 LEFT_BOUNDED, RIGHT_BOUNDED, ACCUMULATE_DQ, DQ_TMA_REDUCE, DOT_PRECISION, UPCAST_DOT,
                                 HAS_ALIBI, HAS_DROPOUT, IS_VARLEN)
            dk, dv = _dkdv_tiles(dk, dv, k, v, q_desc, do_desc, dq_desc, dq_acc, stride_dqas, lse_ptr, delta_ptr,
                                 cols, un_lo, un_hi, un_lo, un_hi, qk_scale, softcap_log2, seqlen_q, seqlen_k,
                                 window_left, window_right, alibi_slope_log2, dropout_seed, head, batch, drop_threshold,
                                 dropout_rescale, BLOCK_M, HEAD_DIM, HEAD_DIM_PAD, HAS_SOFTCAP, 0,
                                 LEFT_BOUNDED, RIGHT_BOUNDED, ACCUMULATE_DQ, DQ_TMA_REDUCE, DOT_PRECISION, UPCAST_DOT,
                                 HAS_ALIBI, HAS_DROPOUT, IS_VARLEN)
            dk, dv = _dkdv_tiles(dk, dv, k, v, q_desc, do_desc, dq_desc, dq_acc, stride_dqas, lse_ptr, delta_ptr,
                                 cols, un_hi, end, un_lo, un_hi, qk_scale, softcap_log2, seqlen_q, seqlen_k,
                                 window_left, window_right, alibi_slope_log2, dropout_seed, head, batch, drop_threshold,
                                 dropout_rescale, BLOCK_M, HEAD_DIM, HEAD_DIM_PAD, HAS_SOFTCAP, 1,
                                 LEFT_BOUNDED, RIGHT_BOUNDED, ACCUMULATE_DQ, DQ_TMA_REDUCE, DOT_PRECISION, UPCAST_DOT,
                                 HAS_ALIBI, HAS_DROPOUT, IS_VARLEN)
    dk_desc = rows_descriptor(DK + batch * stride_dkb + k_start * stride_dks + kv_head * stride_dkh, seqlen_k,
                              stride_dks, BLOCK_N, HEAD_DIM, HEAD_DIM_PAD)
    dv_desc = rows_descriptor(DV + batch * stride_dvb + k_start * stride_dvs + kv_head * stride_dvh, seqlen_k,
                              stride_dvs, BLOCK_N, HEAD_DIM, HEAD_DIM_PAD)
    dk_desc.store([n0, 0], narrow(dk * softmax_scale, DK.dtype.element_ty))
    dv_desc.store([n0, 0], narrow(dv, DV.dtype.element_ty))


@triton.jit
def _dq_tiles(dq, q, do, lse_log2, delta, k_desc, v_desc, rows, start, end, un_lo, un_hi,
              qk_scale, softcap_log2, seqlen_q, seqlen_k, window_left, window_right,
              alibi_slope_log2, dropout_seed, head, batch, drop_threshold, dropout_rescale,
              BLOCK_N: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
              LEFT_BOUNDED: tl.constexpr, RIGHT_BOUNDED: tl.constexpr,
              DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
              HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr):
    """All key tiles in one software pipeline; tiles outside [un_lo, un_hi) are masked. The mask is a
    select on every tile (its condition also admits the unmasked middle): one pipeline fill per program
    instead of three loops' three, and, measured on the H200, faster than masking under a branch."""
    for n0 in tl.range(start, end, BLOCK_N):
        k = k_desc.load([n0, 0])
        v = v_desc.load([n0, 0])
        s = mma(q, tl.trans(k), DOT_PRECISION, UPCAST_DOT) * qk_scale
        if HAS_SOFTCAP:
            tanh_s = tanh(s)
            s = tanh_s * softcap_log2
        if HAS_ALIBI:
            s += alibi_bias(rows[:, None], (n0 + tl.arange(0, BLOCK_N))[None, :], alibi_slope_log2, seqlen_q, seqlen_k)
        p = tl.exp2(s - lse_log2[:, None])
        cols = n0 + tl.arange(0, BLOCK_N)
        keep = visible(rows[:, None], cols[None, :], seqlen_q, seqlen_k, window_left, window_right,
                       LEFT_BOUNDED, RIGHT_BOUNDED) | ((n0 >= un_lo) & (n0 < un_hi))
        p = tl.where(keep, p, 0.0)
        dp = mma(do, tl.trans(v), DOT_PRECISION, UPCAST_DOT)
        if HAS_DROPOUT:
            keep = dropout_keep(rows[:, None], cols[None, :], dropout_seed, head, batch, drop_threshold)
            dp = tl.where(keep, dp * dropout_rescale, 0.0)
        ds = p * (dp - delta[:, None])
        if HAS_SOFTCAP:
            ds = ds * (1.0 - tanh_s * tanh_s)
        dq += mma(narrow(ds, k.dtype), k, DOT_PRECISION, UPCAST_DOT)
    return dq


@triton.jit
def _bwd_dq_kernel(
    Q, K, V, DO, DQ, LSE_LOG2, DELTA, CU_SEQLENS_Q, CU_SEQLENS_K, O, LSE, DLSE, ALIBI_SLOPES, DROPOUT_SEED,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_dob, stride_dos, stride_doh, stride_dqb, stride_dqs, stride_dqh, stride_ob, stride_os, stride_oh,
    stride_lse_b, stride_lse_h, stride_stats_b, stride_stats_h, stride_alibi_b,
    seqlen_q, seqlen_k, num_seqs,
    softmax_scale, qk_scale, softcap_log2, window_left, window_right, drop_threshold, dropout_rescale,
    seqlen_q_bucket, seqlen_k_bucket,  # autotune keys only
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    LEFT_BOUNDED: tl.constexpr, RIGHT_BOUNDED: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    IS_VARLEN: tl.constexpr, SEQS_PAD: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
    HAS_DLSE: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr,
):
    batch, pid_m, head = program_tile(num_seqs, CU_SEQLENS_Q, BLOCK_M, SEQS_PAD, True, IS_VARLEN)
    if batch >= num_seqs:
        return
    kv_head = head // GROUP
    q_start, k_start, seqlen_q, seqlen_k = sequence_bounds(batch, seqlen_q, seqlen_k, CU_SEQLENS_Q, CU_SEQLENS_K,
                                                           IS_VARLEN)
    m0 = pid_m * BLOCK_M
    if m0 >= seqlen_q:
        return
    q_desc = rows_descriptor(Q + batch * stride_qb + q_start * stride_qs + head * stride_qh, seqlen_q, stride_qs,
                             BLOCK_M, HEAD_DIM, HEAD_DIM_PAD)
    do_desc = rows_descriptor(DO + batch * stride_dob + q_start * stride_dos + head * stride_doh, seqlen_q,
                              stride_dos, BLOCK_M, HEAD_DIM, HEAD_DIM_PAD)
    k_desc = rows_descriptor(K + batch * stride_kb + k_start * stride_ks + kv_head * stride_kh, seqlen_k, stride_ks,
                             BLOCK_N, HEAD_DIM, HEAD_DIM_PAD)
    v_desc = rows_descriptor(V + batch * stride_vb + k_start * stride_vs + kv_head * stride_vh, seqlen_k, stride_vs,
                             BLOCK_N, HEAD_DIM, HEAD_DIM_PAD)
    o_desc = rows_descriptor(O + batch * stride_ob + q_start * stride_os + head * stride_oh, seqlen_q, stride_os,
                             BLOCK_M, HEAD_DIM, HEAD_DIM_PAD)
    rows = m0 + tl.arange(0, BLOCK_M)
    q = q_desc.load([m0, 0])
    do = do_desc.load([m0, 0])
    # This program's rows are exactly one query tile, so it computes their statistics itself (and
    # stores them for the dK/dV kernel, launched after it) instead of a separate pass over O and dO.
    delta, lse_log2 = row_stats(o_desc.load([m0, 0]), do, LSE, DLSE, DELTA, LSE_LOG2,
                                 batch * stride_lse_b + q_start + head * stride_lse_h + rows,
                                 batch * stride_stats_b + stats_start(batch, q_start, IS_VARLEN)
                                 + head * stride_stats_h + rows, rows < seqlen_q, HAS_DLSE)
    dq = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    alibi_slope_log2 = load_alibi_slope_log2(ALIBI_SLOPES, batch, head, stride_alibi_b, HAS_ALIBI)
    dropout_seed = load_dropout_key(DROPOUT_SEED, HAS_DROPOUT)
    start, un_lo, un_hi, end = key_range(m0, seqlen_q, seqlen_k, window_left, window_right,
                                         BLOCK_M, BLOCK_N, LEFT_BOUNDED, RIGHT_BOUNDED)
    dq = _dq_tiles(dq, q, do, lse_log2, delta, k_desc, v_desc, rows, start, end, un_lo, un_hi,
                   qk_scale, softcap_log2, seqlen_q, seqlen_k, window_left, window_right,
                   alibi_slope_log2, dropout_seed, head, batch, drop_threshold, dropout_rescale,
                   BLOCK_N, HAS_SOFTCAP, LEFT_BOUNDED, RIGHT_BOUNDED, DOT_PRECISION, UPCAST_DOT, HAS_ALIBI, HAS_DROPOUT)
    dq_desc = rows_descriptor(DQ + batch * stride_dqb + q_start * stride_dqs + head * stride_dqh, seqlen_q,
                              stride_dqs, BLOCK_M, HEAD_DIM, HEAD_DIM_PAD)
    dq_desc.store([m0, 0], narrow(dq * softmax_scale, DQ.dtype.element_ty))


# One kernel, two autotuned launchers: the dQ-accumulating variant has its own config space, and its
# dQ buffer must start from zero for every timed run (each adds its shares into it).
_bwd_dkdv_tuned = tuned(_bwd_dkdv_kernel, "bwd_dkdv", extra_key=("ACCUMULATE_DQ", "HAS_ALIBI", "HAS_DROPOUT"))
_bwd_fused_tuned = tuned(_bwd_dkdv_kernel, "bwd_fused", extra_key=("ACCUMULATE_DQ", "HAS_ALIBI", "HAS_DROPOUT"),
                         reset_to_zero=("DQ_ACC",))
_bwd_dq_tuned = tuned(_bwd_dq_kernel, "bwd_dq", extra_key=("HAS_ALIBI", "HAS_DROPOUT"))


def attention_backward(grad_out, grad_lse, q, k, v, out, lse, softmax_scale, window_left, window_right,
                       softcap, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                       deterministic=True, alibi_slopes=None, dropout_p=0.0, dropout_seed=None, gluon=False,
                       gluon_form=None):
    """Launch the backward kernels; returns (dq, dk, dv) shaped like (q, k, v).

    Args:
        grad_out: like out; grad_lse: like lse, or None when lse took no gradient.
        q, k, v, out, lse: as given to / returned by flash_fwd.attention_forward (dense or varlen).
        deterministic: True: the dQ kernel recomputes the tiles (7 tile matmuls, bit-identical results).
            False: the dK/dV kernel also adds each tile's dQ share into an fp32 buffer (5 matmuls; TMA
            reductions on the GPU, in varying order), where tuning.tl_reduced_dq_pays; else as True.
        alibi_slopes, dropout_p, dropout_seed: as given to attention_forward (the seed regenerates its mask).
        gluon: run the Hopper Gluon kernels (flash_bwd_hopper.py) where they cover the inputs, after the
            preprocess forms the row statistics; deterministic=False may then still take the two kernels.
        gluon_form: with gluon, "two-kernel" (dQ, then dK/dV), "fused" (the dK/dV kernel alone also forms
            dQ, flash_bwd_hopper.launch_fused: 5 tile matmuls, its dQ shares reduced in a fixed order when
            deterministic, else in arrival order) or "fused-split" (the same with dQ's columns split between
            the consumers); the fused forms where they cover the head_dim and softcap. None: tuning's choice.
    """
    is_varlen = cu_seqlens_q is not None
    q, k, v, out, grad_out = (as_descriptor_compatible(t) for t in (q, k, v, out, grad_out))
    if grad_lse is not None:
        grad_lse = grad_lse.contiguous()  # read with lse's (contiguous) offsets; autograd may hand us an expand
    dq, dk, dv = new_output(q), new_output(k), new_output(v)
    head_dim = q.shape[-1]
    heads_q, heads_kv = q.shape[-2], k.shape[-2]
    if is_varlen:
        batch = cu_seqlens_q.numel() - 1
        seqlen_q, seqlen_k = max_seqlen_q, max_seqlen_k
        strides_lse = (0, lse.stride(0))
    else:
        batch, seqlen_q, seqlen_k = q.shape[0], q.shape[1], k.shape[1]
        strides_lse = lse.stride()[:2]
    if q.numel() == 0 or k.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    lse_log2, delta, strides_stats = row_stats_buffers(lse, seqlen_q, is_varlen, batch)
    head_dim_pad = pad_head_dim(head_dim)
    qk_scale, softcap_log2 = log2_scales(softmax_scale, softcap)
    ensure_allocator(q.device)
    common = dict(
        GROUP=heads_q // heads_kv, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        LEFT_BOUNDED=window_left >= 0, RIGHT_BOUNDED=window_right >= 0, HAS_SOFTCAP=softcap > 0.0,
        IS_VARLEN=is_varlen, SEQS_PAD=seqs_pad(batch, is_varlen), DOT_PRECISION=dot_precision(q.dtype),
        UPCAST_DOT=upcast_dot(q.dtype), HAS_ALIBI=alibi_slopes is not None, HAS_DROPOUT=dropout_p > 0.0,
    )
    buckets = (next_power_of_2(max(seqlen_q, 1)), next_power_of_2(max(seqlen_k, 1)))
    scalars = (softmax_scale, qk_scale, softcap_log2, window_left, window_right, dropout_threshold(dropout_p),
               1.0 / (1.0 - dropout_p), *buckets)
    extras = (alibi_slopes, dropout_seed if dropout_p > 0.0 else None)
    stride_alibi = alibi_slopes.stride(0) if alibi_slopes is not None and alibi_slopes.dim() == 2 else 0
    strides_qkv = (*seq_strides(q, is_varlen), *seq_strides(k, is_varlen), *seq_strides(v, is_varlen),
                   *seq_strides(grad_out, is_varlen))

    if gluon:
        from . import flash_bwd_dq_hopper, flash_bwd_hopper

        if flash_bwd_hopper.supports(q, seqlen_q, head_dim_pad, alibi_slopes is not None, dropout_p > 0.0):
            form = checked_gluon_form(gluon_form) or gluon_backward_form(head_dim_pad, seqlen_k, window_left,
                                                                          window_right, deterministic)
            launch_preprocess(out, grad_out, lse, grad_lse, delta, lse_log2, cu_seqlens_q, batch, seqlen_q,
                              strides_lse, strides_stats, head_dim, head_dim_pad, is_varlen)
            launch_args = (lse_log2, delta, softmax_scale, qk_scale, softcap_log2, window_left, window_right,
                           softcap, head_dim_pad)
            dkdv_strides = [s for t in (q, k, v, grad_out, dk, dv) for s in seq_strides(t, is_varlen)]
            # Packed sequences take the two kernels (the fused form's dQ tiles are dense).
            if not is_varlen and form != "two-kernel" and flash_bwd_hopper.fused_supports(head_dim_pad, softcap):
                flash_bwd_hopper.launch_fused(q, k, v, grad_out, dq, dk, dv, *launch_args, dkdv_strides, strides_stats,
                                              deterministic=deterministic, split_dq=form == "fused-split")
                return dq, dk, dv
            varlen = flash_bwd_hopper.Varlen(cu_seqlens_q, cu_seqlens_k, seqlen_q, seqlen_k) if is_varlen else None
            flash_bwd_dq_hopper.launch_dq(q, k, v, grad_out, dq, *launch_args,
                                          [s for t in (q, k, v, grad_out, dq) for s in seq_strides(t, is_varlen)],
                                          strides_stats, varlen=varlen)
            flash_bwd_hopper.launch_dkdv(q, k, v, grad_out, dk, dv, *launch_args, dkdv_strides, strides_stats,
                                         varlen=varlen)
            return dq, dk, dv
    mask, deterministic = table_mask(window_right), deterministic or not tl_reduced_dq_pays(q.device, head_dim_pad)
    if deterministic:  # the dQ kernel also writes delta and lse_log2
        kernel, config = pick_kernel(q.device, "bwd_dq", _bwd_dq_kernel, _bwd_dq_tuned, head_dim_pad, mask,
                                     buckets[0])
        launcher(kernel, lambda meta: tile_grid(meta["BLOCK_M"], seqlen_q, q.shape[0], batch, heads_q, is_varlen))(
            q, k, v, grad_out, dq, lse_log2, delta, cu_seqlens_q, cu_seqlens_k, out, lse, grad_lse, *extras,
            *strides_qkv, *seq_strides(dq, is_varlen), *seq_strides(out, is_varlen), *strides_lse, *strides_stats,
            stride_alibi,
            seqlen_q, seqlen_k, batch, *scalars, **common, HAS_DLSE=grad_lse is not None, **config,
        )
    else:
        launch_preprocess(out, grad_out, lse, grad_lse, delta, lse_log2, cu_seqlens_q, batch, seqlen_q, strides_lse,
                          strides_stats, head_dim, head_dim_pad, is_varlen)
    dq_acc = None if deterministic else torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    kind, tuned_kernel = ("bwd_dkdv", _bwd_dkdv_tuned) if deterministic else ("bwd_fused", _bwd_fused_tuned)
    kernel, config = pick_kernel(q.device, kind, _bwd_dkdv_kernel, tuned_kernel, head_dim_pad, mask, buckets[0])
    launcher(kernel, lambda meta: tile_grid(meta["BLOCK_N"], seqlen_k, k.shape[0], batch, heads_kv, is_varlen))(
        q, k, v, grad_out, dk, dv, dq_acc, lse_log2, delta, cu_seqlens_q, cu_seqlens_k, *extras,
        *strides_qkv, *seq_strides(dk, is_varlen), *seq_strides(dv, is_varlen),
        *(seq_strides(dq_acc, is_varlen) if dq_acc is not None else (0, 0, 0)), *strides_stats, stride_alibi,
        seqlen_q, seqlen_k, batch, *scalars, **common, ACCUMULATE_DQ=not deterministic,
        DQ_TMA_REDUCE=not INTERPRETED, ONE_LOOP=deterministic and head_dim_pad >= ONE_LOOP_DKDV_HEAD_DIM,
        **config,
    )
    if not deterministic:
        return dq.copy_(dq_acc.mul_(softmax_scale)), dk, dv
    return dq, dk, dv
