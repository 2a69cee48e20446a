"""The backward's row statistics. Every query row needs two: delta_i = sum_d dO_id * O_id - dLSE_i (a
gradient into lse enters as -delta, since d lse_i / d s_ij = p_ij), and lse in log2 units with empty rows
(-inf) turned into +inf so that their recomputed probabilities are 0. flash_bwd.py's dQ kernel forms them
for its own rows (row_stats); where no dQ kernel runs first, ``_bwd_preprocess`` does.

Both are stored with each head's rows padded to a multiple of STATS_ROWS, the padding +inf / 0 (rows that add
nothing), so that the dK/dV kernels load a query tile's statistics without a per-row mask: at a length not
divisible by 16 that mask cost the tl dK/dV kernel ~30 registers on sm_90 (191 against 162 at head_dim 64, 64 x
64 tiles), past what three programs per SM can hold. Packed sequences (varlen) pad each head's run of all the
sequences' rows, and start each sequence's on a 16-byte boundary (stats_start): the Gluon dK/dV kernel copies
them by TMA, whose innermost coordinate must be 16-byte aligned (an unaligned one is an illegal instruction on
sm_90); the tl kernels' loads keep the mask there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import launcher, new_output, seq_strides, seqs_pad, tile_grid
from .sizes import cdiv
from .tile_ops import program_tile, sequence_bounds

PREPROCESS_BLOCK = 64
# Rows of the padded statistics: a multiple of every dK/dV BLOCK_M (the tl kernel asserts it).
STATS_ROWS = tl.constexpr(128)


@triton.jit(do_not_specialize=["seqlen_q", "num_seqs"])  # lengths: no vector width depends on them
def _bwd_preprocess(
    O, DO, LSE, DLSE, DELTA, LSE_LOG2, CU_SEQLENS_Q,
    stride_ob, stride_os, stride_oh, stride_dob, stride_dos, stride_doh, stride_lse_b, stride_lse_h,
    stride_stats_b, stride_stats_h, seqlen_q, num_seqs,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK: tl.constexpr, IS_VARLEN: tl.constexpr,
    SEQS_PAD: tl.constexpr, HAS_DLSE: tl.constexpr,
):
    batch, pid_m, head = program_tile(num_seqs, CU_SEQLENS_Q, BLOCK, SEQS_PAD, False, IS_VARLEN)
    if batch >= num_seqs:
        return
    q_start, _, seqlen_q, _ = sequence_bounds(batch, seqlen_q, 0, CU_SEQLENS_Q, CU_SEQLENS_Q, IS_VARLEN)
    o_base = batch * stride_ob + q_start * stride_os
    do_base = batch * stride_dob + q_start * stride_dos
    rows = pid_m * BLOCK + tl.arange(0, BLOCK)
    dims = tl.arange(0, HEAD_DIM_PAD)
    valid = (rows[:, None] < seqlen_q) & (dims[None, :] < HEAD_DIM)
    rows_64 = rows.to(tl.int64)[:, None]  # a sequence's rows * stride can pass 2**31 too
    o = tl.load(O + o_base + head * stride_oh + rows_64 * stride_os + dims[None, :], mask=valid, other=0.0)
    do = tl.load(DO + do_base + head * stride_doh + rows_64 * stride_dos + dims[None, :], mask=valid, other=0.0)
    lse_offsets = batch * stride_lse_b + q_start + head * stride_lse_h + rows
    stats_offsets = (batch * stride_stats_b + stats_start(batch, q_start, IS_VARLEN) + head * stride_stats_h
                     + rows)
    row_stats(o, do, LSE, DLSE, DELTA, LSE_LOG2, lse_offsets, stats_offsets, rows < seqlen_q, HAS_DLSE)


@triton.jit
def stats_start(seq, q_start, IS_VARLEN: tl.constexpr):
    """Where sequence ``seq``'s row statistics start in its head's run: dense, at its own run's start (q_start, 0);
    packed, at its first query row moved on to a 16-byte boundary (4 rows), since the Gluon dK/dV kernel's TMA
    copies of them need an aligned innermost coordinate; 3 rows more per earlier sequence keep the runs apart."""
    if IS_VARLEN:
        return (q_start + 3 * seq + 3) // 4 * 4
    return q_start


@triton.jit
def row_stats(o, do, LSE, DLSE, DELTA, LSE_LOG2, lse_offsets, stats_offsets, in_seq, HAS_DLSE: tl.constexpr):
    """Compute, store and return (delta, lse_log2) of a tile of rows (see the module docstring): lse and its
    gradient read at ``lse_offsets``, the statistics stored at ``stats_offsets``; rows outside the sequence
    get lse_log2 = +inf (p = 0) and are not stored."""
    lse = tl.load(LSE + lse_offsets, mask=in_seq, other=float("-inf"))
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    if HAS_DLSE:
        delta -= tl.load(DLSE + lse_offsets, mask=in_seq, other=0.0)
    lse_log2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    tl.store(DELTA + stats_offsets, delta, mask=in_seq)
    tl.store(LSE_LOG2 + stats_offsets, lse_log2, mask=in_seq)
    return delta, lse_log2


def launch_preprocess(out, grad_out, lse, grad_lse, delta, lse_log2, cu_seqlens_q, batch, seqlen_q, strides_lse,
                      strides_stats, head_dim, head_dim_pad, is_varlen):
    """Launch ``_bwd_preprocess``: every row's delta and lse_log2."""
    launcher(_bwd_preprocess, tile_grid(PREPROCESS_BLOCK, seqlen_q, out.shape[0], batch, out.shape[-2], is_varlen))(
        out, grad_out, lse, grad_lse, delta, lse_log2, cu_seqlens_q,
        *seq_strides(out, is_varlen), *seq_strides(grad_out, is_varlen), *strides_lse, *strides_stats,
        seqlen_q, batch,
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, BLOCK=PREPROCESS_BLOCK, IS_VARLEN=is_varlen,
        SEQS_PAD=seqs_pad(batch, is_varlen), HAS_DLSE=grad_lse is not None,
    )


def row_stats_buffers(lse, seqlen_q, is_varlen, num_seqs=1):
    """(lse_log2, delta, their (batch, head) strides) for a backward of ``lse`` (dense (batch, heads,
    seqlen_q), packed (heads, total) over ``num_seqs`` sequences), laid out as the module docstring says: each
    head's rows (dense, a sequence's; packed, all sequences', each from stats_start) padded to a multiple of
    STATS_ROWS with +inf / 0 there and between sequences."""
    # Packed rows are one run per head, as batch 1 of a dense layout, with up to 3 rows moved per sequence.
    batch, heads, length = ((1, lse.shape[0], lse.shape[1] + 3 * num_seqs) if is_varlen
                            else (*lse.shape[:2], seqlen_q))
    rows = cdiv(length, STATS_ROWS.value) * STATS_ROWS.value
    # One allocation for both (a backward's host time counts its allocations); each half starts on a
    # multiple of STATS_ROWS rows, so both stay 16-byte aligned for the TMA copies.
    lse_log2, delta = new_output(lse, shape=(2, batch, heads, rows), dtype=torch.float32).unbind()
    if rows != length:
        lse_log2.fill_(float("inf"))
        delta.zero_()
    return lse_log2, delta, (0 if is_varlen else heads * rows, rows)
