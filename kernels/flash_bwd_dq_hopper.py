"""The dQ kernel of the Hopper (sm_90) Gluon backward, in the forward's shape: a program owns 128 query
rows of one head (64 per consumer warpgroup, 240 registers each); a producer warp streams K and V tiles
into a ring of NUM_STAGES slots; per key tile a consumer issues S = Q K^T and dP - delta = dO V^T - delta
back to back as asynchronous wgmma, forms P while dP is still on the tensor cores, then dQ += dS K.
Deterministic: every dQ row is written by one program, in key order. Runs after flash_bwd.py's
preprocess (delta, lse in log2 units); flash_bwd_hopper.py has the dK/dV kernel and the shared rules.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)

from . import flash_bwd_hopper, flash_fwd_hopper
from .flash_bwd_hopper import CONSUMER_WARPS
from .bwd_stats import stats_start
from .hopper_ops import mma_layout, program_sequence_tile, rows_descriptor, unspecialised_jit
from .launch import ensure_allocator, launcher, seqs_pad, tile_grid
from .tile_ops import key_range, opaque_copy, sequence_bounds, tanh, visible


# Query rows per dQ consumer.
DQ_ROWS = gl.constexpr(64)


@gluon.jit
def _dq_load_partition(q_base, do_base, k_base, v_base, stride_qs, stride_dos, stride_ks, stride_vs, seqlen_q,
                       seqlen_k, q_smem, do_smem, k_smem, v_smem, q_bars, k_ready, v_ready, slot_empty, m0,
                       start, num_tiles, HEAD_DIM: gl.constexpr, HEAD_DIM_PAD: gl.constexpr, BLOCK_N: gl.constexpr,
                       NUM_STAGES: gl.constexpr, Q_SMEM: gl.constexpr, KV_SMEM: gl.constexpr):
    q_desc = rows_descriptor(q_base, seqlen_q, stride_qs, DQ_ROWS, HEAD_DIM, HEAD_DIM_PAD, Q_SMEM)
    do_desc = rows_descriptor(do_base, seqlen_q, stride_dos, DQ_ROWS, HEAD_DIM, HEAD_DIM_PAD, Q_SMEM)
    k_desc = rows_descriptor(k_base, seqlen_k, stride_ks, BLOCK_N, HEAD_DIM, HEAD_DIM_PAD, KV_SMEM)
    v_desc = rows_descriptor(v_base, seqlen_k, stride_vs, BLOCK_N, HEAD_DIM, HEAD_DIM_PAD, KV_SMEM)
    for c in gl.static_range(2):
        bar = q_bars.index(c)
        mbarrier.expect(bar, 2 * q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [m0 + c * DQ_ROWS, 0], bar, q_smem.index(c))
        tma.async_copy_global_to_shared(do_desc, [m0 + c * DQ_ROWS, 0], bar, do_smem.index(c))
    for j in range(num_tiles):
        stage = j % NUM_STAGES
        n0 = start + j * BLOCK_N
        mbarrier.wait(slot_empty.index(stage), ((j // NUM_STAGES) & 1) ^ 1, pred=j >= NUM_STAGES)
        mbarrier.expect(k_ready.index(stage), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [n0, 0], k_ready.index(stage), k_smem.index(stage))
        mbarrier.expect(v_ready.index(stage), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [n0, 0], v_ready.index(stage), v_smem.index(stage))


@gluon.jit
def _dq_consume_partition(CONSUMER: gl.constexpr, dq_base, stride_dqs, lse_row, delta_row, q_smem, do_smem, k_smem,
                          v_smem, q_bars, k_ready, v_ready, slot_empty, m0, start, un_lo, un_hi, num_tiles,
                          seqlen_q, seqlen_k, softmax_scale, qk_scale, softcap_log2, window_left, window_right,
                          HEAD_DIM: gl.constexpr, HEAD_DIM_PAD: gl.constexpr, BLOCK_N: gl.constexpr,
                          NUM_STAGES: gl.constexpr, LEFT_BOUNDED: gl.constexpr, RIGHT_BOUNDED: gl.constexpr,
                          HAS_SOFTCAP: gl.constexpr, Q_SMEM: gl.constexpr):
    S_LAYOUT: gl.constexpr = mma_layout(BLOCK_N, CONSUMER_WARPS)
    DQ_LAYOUT: gl.constexpr = mma_layout(HEAD_DIM_PAD, CONSUMER_WARPS)
    A_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=DQ_LAYOUT, k_width=2)
    ROWS: gl.constexpr = gl.SliceLayout(1, S_LAYOUT)
    KEYS: gl.constexpr = gl.SliceLayout(0, S_LAYOUT)
    dtype: gl.constexpr = q_smem.dtype
    q_tile = q_smem.index(CONSUMER)
    do_tile = do_smem.index(CONSUMER)
    row0 = m0 + CONSUMER * DQ_ROWS
    rows = row0 + gl.arange(0, DQ_ROWS, layout=ROWS)
    # Rows past the end: lse = +inf, so p = 0 and they add nothing.
    lse_log2 = gl.load(lse_row + rows, mask=rows < seqlen_q, other=float("inf"))
    delta = gl.load(delta_row + rows, mask=rows < seqlen_q, other=0.0)
    s_zero = gl.zeros([DQ_ROWS, BLOCK_N], gl.float32, S_LAYOUT)
    # dP's accumulator starts at -delta (see the dK/dV consumer).
    minus_delta = s_zero - gl.expand_dims(delta, 1)
    dq = gl.zeros([DQ_ROWS, HEAD_DIM_PAD], gl.float32, DQ_LAYOUT)

    mbarrier.wait(q_bars.index(CONSUMER), 0)
    for j in range(num_tiles):
        stage = j % NUM_STAGES
        phase = (j // NUM_STAGES) & 1
        n0 = start + j * BLOCK_N
        k_tile = k_smem.index(stage)
        dp = opaque_copy(minus_delta)
        mbarrier.wait(k_ready.index(stage), phase)
        s = warpgroup_mma(q_tile, k_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        mbarrier.wait(v_ready.index(stage), phase)
        dp = warpgroup_mma(do_tile, v_smem.index(stage).permute((1, 0)), dp, is_async=True)
        s = warpgroup_mma_wait(1, deps=[s])
        s = s * qk_scale
        if HAS_SOFTCAP:
            tanh_s = tanh(s)
            s = tanh_s * softcap_log2
        p = gl.exp2(s - gl.expand_dims(lse_log2, 1))
        if (n0 < un_lo) | (n0 >= un_hi):
            cols = n0 + gl.arange(0, BLOCK_N, layout=KEYS)
            keep = visible(gl.expand_dims(rows, 1), gl.expand_dims(cols, 0), seqlen_q, seqlen_k, window_left,
                           window_right, LEFT_BOUNDED, RIGHT_BOUNDED)
            p = gl.where(keep, p, 0.0)
        dp = warpgroup_mma_wait(0, deps=[dp])
        ds = p * dp
        if HAS_SOFTCAP:
            ds = ds * (1.0 - tanh_s * tanh_s)
        ds_op = gl.convert_layout(ds.to(dtype), A_LAYOUT)
        dq = warpgroup_mma(ds_op, k_tile, dq, is_async=True)
        dq, ds_op = warpgroup_mma_wait(0, deps=[dq, ds_op])
        mbarrier.arrive(slot_empty.index(stage), count=1)

    # Q is read by no product any more: its tile stages dQ.
    q_tile.store((dq * softmax_scale).to(dtype))
    fence_async_shared()
    dq_desc = rows_descriptor(dq_base, seqlen_q, stride_dqs, DQ_ROWS, HEAD_DIM, HEAD_DIM_PAD, Q_SMEM)
    tma.async_copy_shared_to_global(dq_desc, [row0, 0], q_tile)
    tma.store_wait(0)


@unspecialised_jit
def _attn_bwd_dq_hopper_kernel(
    Q, K, V, DO, DQ, LSE_LOG2, DELTA, CU_SEQLENS_Q, CU_SEQLENS_K,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_dob, stride_dos, stride_doh,
    stride_dqb, stride_dqs, stride_dqh,
    stride_lse_b, stride_lse_h,
    seqlen_q, seqlen_k, batch_size,
    softmax_scale, qk_scale, softcap_log2, window_left, window_right,
    GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, HEAD_DIM_PAD: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
    LEFT_BOUNDED: gl.constexpr, RIGHT_BOUNDED: gl.constexpr, HAS_SOFTCAP: gl.constexpr,
    Q_SMEM: gl.constexpr, KV_SMEM: gl.constexpr, IS_VARLEN: gl.constexpr, SEQS_PAD: gl.constexpr,
):
    """One program per BLOCK_M query rows of one head, the longest (causal) first; IS_VARLEN: packed
    sequences located by CU_SEQLENS_Q / CU_SEQLENS_K, as the forward takes them (flash_fwd_hopper.py)."""
    gl.static_assert(BLOCK_M == 2 * DQ_ROWS)
    dtype: gl.constexpr = Q.dtype.element_ty
    seq, pid_m = program_sequence_tile(batch_size, CU_SEQLENS_Q, BLOCK_M, RIGHT_BOUNDED, IS_VARLEN, SEQS_PAD,
                                       CONSUMER_WARPS)
    m0 = pid_m * BLOCK_M
    if IS_VARLEN:  # dense, every program is live and its values stay as ptxas can rematerialise them
        live = seq < batch_size  # programs past the last sequence's tiles load and store nothing
        seq = gl.minimum(seq, batch_size - 1)
    q_first, k_first, seqlen_q, seqlen_k = sequence_bounds(seq, seqlen_q, seqlen_k, CU_SEQLENS_Q, CU_SEQLENS_K,
                                                           IS_VARLEN)
    if IS_VARLEN:  # past the sequence's last row, loads read zeros and the store is clipped away
        m0 = gl.where(live, m0, gl.maximum(seqlen_q, 1))
    batch = seq.to(gl.int64)
    head = gl.program_id(1).to(gl.int64)
    kv_head = head // GROUP
    q_base = Q + batch * stride_qb + q_first * stride_qs + head * stride_qh
    do_base = DO + batch * stride_dob + q_first * stride_dos + head * stride_doh
    k_base = K + batch * stride_kb + k_first * stride_ks + kv_head * stride_kh
    v_base = V + batch * stride_vb + k_first * stride_vs + kv_head * stride_vh
    dq_base = DQ + batch * stride_dqb + q_first * stride_dqs + head * stride_dqh
    stats_first = stats_start(batch, q_first, IS_VARLEN)
    lse_row = LSE_LOG2 + batch * stride_lse_b + head * stride_lse_h + stats_first
    delta_row = DELTA + batch * stride_lse_b + head * stride_lse_h + stats_first
    q_smem = gl.allocate_shared_memory(dtype, [2, DQ_ROWS, HEAD_DIM_PAD], Q_SMEM)
    do_smem = gl.allocate_shared_memory(dtype, [2, DQ_ROWS, HEAD_DIM_PAD], Q_SMEM)
    k_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM_PAD], KV_SMEM)
    v_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM_PAD], KV_SMEM)
    q_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    # A slot's K and V tiles are released together, once dQ's product has read K (flash_bwd_hopper.py's
    # dK/dV kernel says why).
    slot_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for c in gl.static_range(2):
        mbarrier.init(q_bars.index(c), count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(slot_empty.index(i), count=2)
    start, un_lo, un_hi, end = key_range(m0, seqlen_q, seqlen_k, window_left, window_right,
                                         BLOCK_M, BLOCK_N, LEFT_BOUNDED, RIGHT_BOUNDED)
    num_tiles = (end - start) // BLOCK_N
    if IS_VARLEN:
        num_tiles = gl.where(live, num_tiles, 0)
        # A TMA view needs a row: a sequence with no key loads no key tile, and one past the last takes the last
        # sequence's bounds, which may hold no query.
        seqlen_q, seqlen_k = gl.maximum(seqlen_q, 1), gl.maximum(seqlen_k, 1)
    gl.warp_specialize([
        (_dq_consume_partition, (0, dq_base, stride_dqs, lse_row, delta_row, q_smem, do_smem, k_smem, v_smem,
                                 q_bars, k_ready, v_ready, slot_empty, m0, start, un_lo, un_hi, num_tiles,
                                 seqlen_q, seqlen_k, softmax_scale, qk_scale, softcap_log2, window_left,
                                 window_right, HEAD_DIM, HEAD_DIM_PAD, BLOCK_N, NUM_STAGES, LEFT_BOUNDED,
                                 RIGHT_BOUNDED, HAS_SOFTCAP, Q_SMEM)),
        (_dq_consume_partition, (1, dq_base, stride_dqs, lse_row, delta_row, q_smem, do_smem, k_smem, v_smem,
                                 q_bars, k_ready, v_ready, slot_empty, m0, start, un_lo, un_hi, num_tiles,
                                 seqlen_q, seqlen_k, softmax_scale, qk_scale, softcap_log2, window_left,
                                 window_right, HEAD_DIM, HEAD_DIM_PAD, BLOCK_N, NUM_STAGES, LEFT_BOUNDED,
                                 RIGHT_BOUNDED, HAS_SOFTCAP, Q_SMEM)),
        (_dq_load_partition, (q_base, do_base, k_base, v_base, stride_qs, stride_dos, stride_ks, stride_vs, seqlen_q,
                              seqlen_k, q_smem, do_smem, k_smem, v_smem, q_bars, k_ready, v_ready, slot_empty,
                              m0, start, num_tiles, HEAD_DIM, HEAD_DIM_PAD, BLOCK_N, NUM_STAGES, Q_SMEM, KV_SMEM)),
    ], [CONSUMER_WARPS, 1], [240, 24])


# BLOCK_N (keys per K/V tile) of the dQ kernel per padded head_dim, two stages: the two 64-row Q and dO
# tiles and the K/V ring within the shared memory (192 KB at head_dim 256), and S, dP (64 x BLOCK_N
# fp32 each, and softcap's tanh tile) beside dQ (64 x head_dim fp32) in a consumer's registers.
DQ_BLOCK_N = {64: 64, 128: 64, 256: 32}
DQ_NUM_STAGES = 2
DQ_BLOCK_M = 2 * DQ_ROWS.value


def launch_dq(q, k, v, grad_out, dq, lse_log2, delta, softmax_scale, qk_scale, softcap_log2, window_left,
              window_right, softcap, head_dim_pad, strides, strides_lse, block_n=None, varlen=None):
    """Launch the dQ kernel on inputs the caller has validated; ``strides`` are (batch, seq, head) strides of q,
    k, v, grad_out, dq; lse_log2 and delta as flash_bwd's preprocess wrote them. Dense (batch, seqlen, heads,
    head_dim), or packed (total, heads, head_dim) with ``varlen`` = flash_bwd_hopper.Varlen."""
    batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim = flash_bwd_hopper.dimensions(q, k, varlen)
    block_n = block_n or DQ_BLOCK_N[head_dim_pad]
    q_smem = flash_bwd_hopper.shared_layouts(DQ_ROWS.value, head_dim_pad, q.dtype)[0]
    kv_smem = flash_fwd_hopper.shared_layouts(block_n, head_dim_pad, q.dtype)[1]
    ensure_allocator(q.device)
    is_varlen = varlen is not None
    grid = tile_grid(DQ_BLOCK_M, seqlen_q, q.shape[0], batch, heads_q, is_varlen)
    launcher(_attn_bwd_dq_hopper_kernel, grid)(  # q stands in for the offsets a dense launch never reads
        q, k, v, grad_out, dq, lse_log2, delta, *(varlen[:2] if is_varlen else (q, q)), *strides, *strides_lse,
        seqlen_q, seqlen_k, batch, softmax_scale, qk_scale, softcap_log2, window_left, window_right,
        GROUP=heads_q // heads_kv, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        BLOCK_M=DQ_BLOCK_M, BLOCK_N=block_n, NUM_STAGES=DQ_NUM_STAGES,
        LEFT_BOUNDED=window_left >= 0, RIGHT_BOUNDED=window_right >= 0, HAS_SOFTCAP=softcap > 0.0,
        Q_SMEM=q_smem, KV_SMEM=kv_smem, IS_VARLEN=is_varlen, SEQS_PAD=seqs_pad(batch, is_varlen),
        num_warps=CONSUMER_WARPS.value,
    )
