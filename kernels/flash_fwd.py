"""FlashAttention forward in Triton: tiled, online softmax, the score matrix never leaves the chip.

One program computes BLOCK_M query rows of one (batch, head): it streams key/value tiles through
shared memory, keeps a running max and sum per row, and writes the output and the row's
log-sum-exp. The softmax runs in the log2 domain: scale * log2(e) multiplies the raw q.k inside exp2's
argument (one fused multiply-add per logit) and the row maxima, so the inner loop uses exp2. Key tiles come in three runs: a masked run at the window's left edge, an
unmasked middle and a masked run at the right edge (the causal diagonal, the end of the keys), so
only edge tiles pay for the mask.

Tensors are read through tensor descriptors (TMA on Hopper), which also zero-fill rows and columns
past the end: any seqlen and any head_dim up to the padded HEAD_DIM_PAD work without copies.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .launch import (as_descriptor_compatible, dot_precision, ensure_allocator, launcher, new_output, seq_strides,
                     seqs_pad, tile_grid, upcast_dot)
from .reference import dropout_threshold
from .sizes import next_power_of_2, pad_head_dim
from .tile_ops import (alibi_bias, attention_logits, dropout_keep, key_range, load_alibi_slope_log2, load_dropout_key,
                       logit_scale, narrow, online_softmax_step, paged_rows, program_tile, rows_descriptor,
                       sequence_bounds)
from .tuning import pick_kernel, row_pointer_config, table_mask, tuned

LOG2E = 1.4426950408889634


@triton.jit
def _fwd_tiles(acc, row_max, row_sum, q, k_src, v_src, pages, rows, start, end,
               qk_scale, softcap_log2, seqlen_q, seqlen_k, window_left, window_right,
               alibi_slope_log2, dropout_seed, head, batch, drop_threshold, page_size,
               stride_kpage, stride_ks, stride_vpage, stride_vs,
               BLOCK_N: tl.constexpr, HAS_SOFTCAP: tl.constexpr, MASKED: tl.constexpr,
               LEFT_BOUNDED: tl.constexpr, RIGHT_BOUNDED: tl.constexpr, DOT_PRECISION: tl.constexpr,
               UPCAST_DOT: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr,
               IS_PAGED: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr):
    for n0 in tl.range(start, end, BLOCK_N):
        if IS_PAGED:
            k = paged_rows(k_src, pages, n0, seqlen_k, page_size, stride_kpage, stride_ks, BLOCK_N, HEAD_DIM,
                           HEAD_DIM_PAD)
            v = paged_rows(v_src, pages, n0, seqlen_k, page_size, stride_vpage, stride_vs, BLOCK_N, HEAD_DIM,
                           HEAD_DIM_PAD)
        else:
            k = k_src.load([n0, 0])
            v = v_src.load([n0, 0])
        cols = n0 + tl.arange(0, BLOCK_N)
        s = attention_logits(q, k, rows, cols, qk_scale, softcap_log2, seqlen_q, seqlen_k,
                             window_left, window_right, HAS_SOFTCAP, MASKED, LEFT_BOUNDED, RIGHT_BOUNDED,
                             DOT_PRECISION, UPCAST_DOT)
        scale = logit_scale(qk_scale, HAS_SOFTCAP)
        if HAS_ALIBI:  # the bias is in log2 units: the logits go there first
            s = s * scale + alibi_bias(rows[:, None], cols[None, :], alibi_slope_log2, seqlen_q, seqlen_k)
            scale = 1.0
        keep = None
        if HAS_DROPOUT:
            keep = dropout_keep(rows[:, None], cols[None, :], dropout_seed, head, batch, drop_threshold)
        acc, row_max, row_sum = online_softmax_step(acc, row_max, row_sum, s, scale, v, MASKED, DOT_PRECISION,
                                                    UPCAST_DOT, keep)
    return acc, row_max, row_sum


@triton.jit
def _attn_fwd_kernel(
    Q, K, V, O, LSE, CU_SEQLENS_Q, CU_SEQLENS_K, ALIBI_SLOPES, DROPOUT_SEED, BLOCK_TABLE,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ob, stride_os, stride_oh,
    stride_lse_b, stride_lse_h, stride_alibi_b, stride_bt, page_size,
    seqlen_q, seqlen_k, num_seqs,
    qk_scale, softcap_log2, window_left, window_right, drop_threshold, dropout_rescale,
    seqlen_q_bucket, seqlen_k_bucket,  # autotune keys only
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    LEFT_BOUNDED: tl.constexpr, RIGHT_BOUNDED: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    IS_VARLEN: tl.constexpr, SEQS_PAD: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
    HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr, IS_PAGED: tl.constexpr,
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
    if IS_PAGED:  # K and V are page pools; stride_kb / stride_vb step pages, the block table's row finds them
        k_src = K + kv_head * stride_kh
        v_src = V + kv_head * stride_vh
        pages = BLOCK_TABLE + batch * stride_bt
    else:
        k_src = rows_descriptor(K + batch * stride_kb + k_start * stride_ks + kv_head * stride_kh, seqlen_k,
                                stride_ks, BLOCK_N, HEAD_DIM, HEAD_DIM_PAD)
        v_src = rows_descriptor(V + batch * stride_vb + k_start * stride_vs + kv_head * stride_vh, seqlen_k,
                                stride_vs, BLOCK_N, HEAD_DIM, HEAD_DIM_PAD)
        pages = BLOCK_TABLE
    o_desc = rows_descriptor(O + batch * stride_ob + q_start * stride_os + head * stride_oh, seqlen_q, stride_os,
                             BLOCK_M, HEAD_DIM, HEAD_DIM_PAD)

    rows = m0 + tl.arange(0, BLOCK_M)
    row_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    q = q_desc.load([m0, 0])
    alibi_slope_log2 = load_alibi_slope_log2(ALIBI_SLOPES, batch, head, stride_alibi_b, HAS_ALIBI)
    dropout_seed = load_dropout_key(DROPOUT_SEED, HAS_DROPOUT)

    start, un_lo, un_hi, end = key_range(m0, seqlen_q, seqlen_k, window_left, window_right,
                                         BLOCK_M, BLOCK_N, LEFT_BOUNDED, RIGHT_BOUNDED)
    acc, row_max, row_sum = _fwd_tiles(acc, row_max, row_sum, q, k_src, v_src, pages, rows, start, un_lo,
                                       qk_scale, softcap_log2, seqlen_q, seqlen_k, window_left, window_right,
                                       alibi_slope_log2, dropout_seed, head, batch, drop_threshold, page_size,
                                       stride_kb, stride_ks, stride_vb, stride_vs,
                                       BLOCK_N, HAS_SOFTCAP, True, LEFT_BOUNDED, RIGHT_BOUNDED, DOT_PRECISION, UPCAST_DOT,
                                       HAS_ALIBI, HAS_DROPOUT, IS_PAGED, HEAD_DIM, HEAD_DIM_PAD)
    acc, row_max, row_sum = _fwd_tiles(acc, row_max, row_sum, q, k_src, v_src, pages, rows, un_lo, un_hi,
                                       qk_scale, softcap_log2, seqlen_q, seqlen_k, window_left, window_right,
                                       alibi_slope_log2, dropout_seed, head, batch, drop_threshold, page_size,
                                       stride_kb, stride_ks, stride_vb, stride_vs,
                                       BLOCK_N, HAS_SOFTCAP, False, LEFT_BOUNDED, RIGHT_BOUNDED, DOT_PRECISION, UPCAST_DOT,
                                       HAS_ALIBI, HAS_DROPOUT, IS_PAGED, HEAD_DIM, HEAD_DIM_PAD)
    acc, row_max, row_sum = _fwd_tiles(acc, row_max, row_sum, q, k_src, v_src, pages, rows, un_hi, end,
                                       qk_scale, softcap_log2, seqlen_q, seqlen_k, window_left, window_right,
                                       alibi_slope_log2, dropout_seed, head, batch, drop_threshold, page_size,
                                       stride_kb, stride_ks, stride_vb, stride_vs,
                                       BLOCK_N, HAS_SOFTCAP, True, LEFT_BOUNDED, RIGHT_BOUNDED, DOT_PRECISION, UPCAST_DOT,
                                       HAS_ALIBI, HAS_DROPOUT, IS_PAGED, HEAD_DIM, HEAD_DIM_PAD)

    # A row that saw no key: output 0 and lse = -inf (log of an empty sum).
    empty = row_sum == 0.0
    nonzero_sum = tl.where(empty, 1.0, row_sum)  # the interpreter (numpy) warns on log2(0)
    if HAS_DROPOUT:
        acc = acc * (dropout_rescale / nonzero_sum)[:, None]
    else:
        acc = acc / nonzero_sum[:, None]
    lse = tl.where(empty, float("-inf"), (row_max + tl.log2(nonzero_sum)) * 0.6931471805599453)
    o_desc.store([m0, 0], narrow(acc, O.dtype.element_ty))
    tl.store(LSE + batch * stride_lse_b + q_start + head * stride_lse_h + rows, lse, mask=rows < seqlen_q)


_attn_fwd_tuned = tuned(_attn_fwd_kernel, "fwd", extra_key=("HAS_ALIBI", "HAS_DROPOUT", "IS_PAGED"))


def log2_scales(softmax_scale: float, softcap: float) -> tuple[float, float]:
    """(qk_scale, softcap_log2): what the kernels multiply raw q.k by, and the softcap factor.

    Without softcap the logit in log2 units is qk * scale * log2(e). With softcap it is
    softcap * log2(e) * tanh(qk * scale / softcap).
    """
    if softcap > 0.0:
        return softmax_scale / softcap, softcap * LOG2E
    return softmax_scale * LOG2E, 1.0


def lse_shape(q, is_varlen):
    """The forward's lse shape for ``q``: (batch, heads_q, seqlen_q), or (heads_q, total_q) for varlen."""
    return (q.shape[1], q.shape[0]) if is_varlen else (q.shape[0], q.shape[2], q.shape[1])


def attention_forward(q, k, v, softmax_scale, window_left, window_right, softcap,
                      cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, gluon=False,
                      alibi_slopes=None, dropout_p=0.0, dropout_seed=None, block_table=None):
    """Launch the forward kernel on validated inputs.

    Args:
        q: (batch, seqlen_q, heads_q, head_dim), or (total_q, heads_q, head_dim) with cu_seqlens.
        k, v: (batch, seqlen_k, heads_kv, head_dim), or (total_k, heads_kv, head_dim).
        window_left, window_right: -1 = unbounded; causal is window_right = 0.
        cu_seqlens_q, cu_seqlens_k: int32 (batch + 1,) offsets for varlen inputs, with max_seqlen_q/_k.
        gluon: run the Hopper Gluon kernel (flash_fwd_hopper.py) where it covers the inputs.
        alibi_slopes: None, or fp32 (heads_q,) / (batch, heads_q) contiguous.
        dropout_p: probability of dropping each attention probability; > 0 needs dropout_seed, an
            int64 (1,) tensor on q's device (read by the kernel: no host sync).
        block_table: None, or int32 (batch, pages per sequence) with varlen queries: k, v are then page pools
            (num_pages, page_size, heads_kv, head_dim) and cu_seqlens_k counts each sequence's keys in its
            pages (the tl kernel only).
    Returns:
        out like q; lse fp32 (batch, heads_q, seqlen_q), or (heads_q, total_q) for varlen.
    """
    is_varlen = cu_seqlens_q is not None
    paged = block_table is not None
    # Page pools are read a row at a time, not through descriptors: no copy of a whole pool.
    q, k, v = (t if paged and t is not q else as_descriptor_compatible(t) for t in (q, k, v))
    if paged and block_table.stride(1) != 1:  # the kernel steps through a row of the table at unit stride
        block_table = block_table.contiguous()
    head_dim = q.shape[-1]
    heads_q, heads_kv = q.shape[-2], k.shape[-2]
    out = new_output(q)
    lse = new_output(q, lse_shape(q, is_varlen), torch.float32)
    if is_varlen:
        batch = cu_seqlens_q.numel() - 1
        seqlen_q, seqlen_k = max_seqlen_q, max_seqlen_k
        strides_lse = (0, lse.stride(0))
    else:
        batch, seqlen_q = q.shape[0], q.shape[1]
        seqlen_k = k.shape[1]
        strides_lse = lse.stride()[:2]
    if out.numel() == 0:
        return out, lse
    # Nothing to attend to: every row is empty. Varlen asks the key count, not max_seqlen_k, which the
    # kernels otherwise take as a tuning hint only (unchecked unless the offsets are read).
    if (k.shape[0] if is_varlen else seqlen_k) == 0:
        return out.zero_(), lse.fill_(-math.inf)
    qk_scale, softcap_log2 = log2_scales(softmax_scale, softcap)
    head_dim_pad = pad_head_dim(head_dim)
    ensure_allocator(q.device)
    has_alibi, has_dropout = alibi_slopes is not None, dropout_p > 0.0
    if gluon and not paged:
        from . import flash_fwd_hopper

        if flash_fwd_hopper.supports(q, seqlen_q, head_dim_pad, has_alibi, has_dropout, is_varlen):
            flash_fwd_hopper.launch_forward(q, k, v, out, lse, qk_scale, softcap_log2, window_left, window_right,
                                            softcap, head_dim_pad,
                                            [s for t in (q, k, v, out) for s in seq_strides(t, is_varlen)],
                                            strides_lse, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                            max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
            return out, lse
    seqlen_q_bucket = next_power_of_2(max(seqlen_q, 1))
    kernel, config = pick_kernel(q.device, "fwd", _attn_fwd_kernel, _attn_fwd_tuned, head_dim_pad,
                                 table_mask(window_right), seqlen_q_bucket)
    if paged:
        config = row_pointer_config(config)
    launcher(kernel, lambda meta: tile_grid(meta["BLOCK_M"], seqlen_q, q.shape[0], batch, heads_q, is_varlen))(
        q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, dropout_seed if has_dropout else None,
        block_table, *seq_strides(q, is_varlen), *(k.stride()[:3] if paged else seq_strides(k, is_varlen)),
        *(v.stride()[:3] if paged else seq_strides(v, is_varlen)), *seq_strides(out, is_varlen), *strides_lse,
        alibi_slopes.stride(0) if has_alibi and alibi_slopes.dim() == 2 else 0,
        block_table.stride(0) if paged else 0, k.shape[1] if paged else 0,
        seqlen_q, seqlen_k, batch,
        qk_scale, softcap_log2, window_left, window_right, dropout_threshold(dropout_p), 1.0 / (1.0 - dropout_p),
        seqlen_q_bucket, next_power_of_2(max(seqlen_k, 1)),
        GROUP=heads_q // heads_kv, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        LEFT_BOUNDED=window_left >= 0, RIGHT_BOUNDED=window_right >= 0, HAS_SOFTCAP=softcap > 0.0,
        IS_VARLEN=is_varlen, SEQS_PAD=seqs_pad(batch, is_varlen), DOT_PRECISION=dot_precision(q.dtype),
        UPCAST_DOT=upcast_dot(q.dtype), HAS_ALIBI=has_alibi, HAS_DROPOUT=has_dropout, IS_PAGED=paged, **config,
    )
    return out, lse
