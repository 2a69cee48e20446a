"""FlashAttention backward for Hopper (sm_90) in Gluon: flash_bwd.py's dK/dV kernel (the dQ kernel is in
flash_bwd_dq_hopper.py), scheduled by hand as FlashAttention-3 does it, after flash_bwd.py's preprocess (delta, lse in
log2 units). Each launch: a producer warp (24 registers, TMA into a ring of NUM_STAGES slots, a "ready" mbarrier per
tile, one "empty" per slot; in dK/dV a query tile's delta and lse ride with its Q and dO) and two consumer warpgroups
(240 registers, setmaxnreg) that drift apart, so that one's products overlap the other's exponentials.

dK/dV: a program owns BLOCK_N = 128 keys of one kv head (64 at head_dim 256, see SPLIT_HEAD_DIM_ABOVE) and walks the
query tiles that see them, for every query head of its GQA group in one loop (deterministic, no atomics). A consumer
owns 64 keys; per query tile it issues S^T = K Q^T and dP^T - delta = V dO^T - delta (accumulator started at -delta)
as asynchronous wgmma, forms P^T while dP^T runs, issues dV += P^T dO, forms dS^T = P^T (dP^T - delta) while dV runs,
then dK += dS^T Q; P^T and dS^T are register A operands, kept live until their product is waited for. Semantics as
flash_bwd.py's (bottom-right causal, windows, softcap, GQA, the lse gradient); keys and rows past the ends get p = 0.

Fused (DQ_MODE, launch_fused; deterministic=False's form where tuning.gluon_backward_form has it): a consumer also adds
its share of the query tile's dQ, dS K from dS^T in shared memory, into an fp32 accumulator by one TMA reduction
(dq_reduce_hopper.py): 5 products per tile, not 7 (DQ_SPLIT: half of dQ's columns per consumer, over both dS^T tiles).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                             warpgroup_mma_wait)

from .bwd_stats import stats_start
from .hopper_ops import mma_layout, program_sequence_tile, rows_descriptor, unspecialised_jit
from .launch import ensure_allocator, launcher, seqs_pad, tile_grid
from .dq_reduce_hopper import add_dq_share, heads_descriptor, release_dq_share
from .flash_bwd_hopper_load import dkdv_load_partition
from .tile_ops import last_key_block, opaque_copy, query_range, sequence_bounds, tanh, visible
from .tuning import GLUON_BACKWARD_FROM_SEQLEN

CONSUMER_WARPS = gl.constexpr(4)
CONSUMER_KEYS = gl.constexpr(64)
# Above this padded head_dim a consumer's dK and dV (64 x head_dim fp32 each) overflow its registers: both consumers
# take the same 64 keys and half of dK's and dV's columns each (1.5x the products of the 128-key program).
SPLIT_HEAD_DIM_ABOVE = 128
# Where dQ goes (DQ_MODE). SEPARATE: flash_bwd_dq_hopper.py's kernel recomputes S and dP (7 products per tile pair).
# ORDERED / UNORDERED: each consumer reduces its share dS K into an fp32 accumulator (5 products) in a fixed key-block
# order behind a semaphore per query tile (ORDERED) or as the shares arrive.
DQ_SEPARATE = gl.constexpr(0)
DQ_ORDERED = gl.constexpr(1)
DQ_UNORDERED = gl.constexpr(2)


@gluon.jit
def _dkdv_consume_partition(CONSUMER: gl.constexpr, dk_base, dv_base, stride_dks, stride_dvs, q_smem, do_smem,
                            k_smem, v_smem, lse_smem, delta_smem, kv_bars, pair_bars, q_ready,
                            do_ready, slot_empty, n0, start, un_lo, un_hi, tiles_per_head, seqlen_q, seqlen_k,
                            softmax_scale, qk_scale, softcap_log2, window_left, window_right, ds_smem, dq_smem,
                            dq_group, stride_dqs, stride_dqh, semaphore_group, q_tiles,
                            GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, HEAD_DIM_PAD: gl.constexpr,
                            BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
                            LEFT_BOUNDED: gl.constexpr, RIGHT_BOUNDED: gl.constexpr, HAS_SOFTCAP: gl.constexpr,
                            SPLIT_HEAD_DIM: gl.constexpr, KV_SMEM: gl.constexpr, DQ_MODE: gl.constexpr,
                            DQ_TMA: gl.constexpr, DQ_SPLIT: gl.constexpr):
    # The consumer's keys and its columns of dK and dV.
    TILE: gl.constexpr = 0 if SPLIT_HEAD_DIM else CONSUMER
    OUT_DIM: gl.constexpr = HEAD_DIM_PAD // 2 if SPLIT_HEAD_DIM else HEAD_DIM_PAD
    OUT_COL: gl.constexpr = CONSUMER * OUT_DIM if SPLIT_HEAD_DIM else 0
    # The consumer's dQ columns and (dS^T, K) tile pairs: its own, or with DQ_SPLIT both consumers'.
    DQ_DIM: gl.constexpr = HEAD_DIM_PAD // 2 if DQ_SPLIT else HEAD_DIM_PAD
    DQ_COL: gl.constexpr = CONSUMER * DQ_DIM if DQ_SPLIT else 0
    DQ_PARTS: gl.constexpr = 2 if DQ_SPLIT else 1
    ST_LAYOUT: gl.constexpr = mma_layout(BLOCK_M, CONSUMER_WARPS)
    DKV_LAYOUT: gl.constexpr = mma_layout(OUT_DIM, CONSUMER_WARPS)
    A_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=DKV_LAYOUT, k_width=2)
    KEYS: gl.constexpr = gl.SliceLayout(1, ST_LAYOUT)
    QUERIES: gl.constexpr = gl.SliceLayout(0, ST_LAYOUT)
    ROW_VECTOR: gl.constexpr = gl.BlockedLayout([1], [32], [CONSUMER_WARPS], [0])
    dtype: gl.constexpr = q_smem.dtype
    k_tile = k_smem.index(TILE)
    v_tile = v_smem.index(TILE)
    key0 = n0 + TILE * CONSUMER_KEYS
    cols = gl.expand_dims(key0 + gl.arange(0, CONSUMER_KEYS, layout=KEYS), 1)
    dk = gl.zeros([CONSUMER_KEYS, OUT_DIM], gl.float32, DKV_LAYOUT)
    dv = gl.zeros([CONSUMER_KEYS, OUT_DIM], gl.float32, DKV_LAYOUT)
    st_zero = gl.zeros([CONSUMER_KEYS, BLOCK_M], gl.float32, ST_LAYOUT)
    if DQ_MODE != DQ_SEPARATE:
        gl.static_assert((not SPLIT_HEAD_DIM) & (BLOCK_M == 64))  # dQ's wgmma is 64 rows by HEAD_DIM_PAD
        dq_zero = gl.zeros([BLOCK_M, DQ_DIM], gl.float32, mma_layout(DQ_DIM, CONSUMER_WARPS))
        ds_tile = ds_smem.index(CONSUMER)
        dq_stage = dq_smem.index(CONSUMER)
        dq_desc = heads_descriptor(dq_group, GROUP, seqlen_q, stride_dqh, stride_dqs, BLOCK_M, HEAD_DIM_PAD,
                                    DQ_DIM, DQ_TMA)
        if DQ_SPLIT:  # both dS^T tiles stored; both consumers' dQ products that read them done
            ds_ready, ds_free = pair_bars.index(1), pair_bars.index(2)

    for t in gl.static_range(DQ_PARTS):  # with DQ_SPLIT the dQ products read both K tiles
        mbarrier.wait(kv_bars.index((TILE + t) % 2), 0)
    previous_share = semaphore_group  # DQ_ORDERED: the share added last, released a query tile later
    for i in range(GROUP * tiles_per_head):
        stage = i % NUM_STAGES
        phase = (i // NUM_STAGES) & 1
        head = i // tiles_per_head
        m0 = start + (i - head * tiles_per_head) * BLOCK_M
        q_tile = q_smem.index(stage)
        do_tile = do_smem.index(stage)

        # dP^T's accumulator starts at -delta, so the product is dP^T - delta: no delta row vector stays
        # live beside the four accumulator tiles. It is filled before S^T is issued: ptxas serialises
        # the two products if registers are written between them. The producer's TMA brought the statistics
        # with Q and dO: read from shared memory in S^T's column layout, with no global load's latency before
        # the products and no layout conversion's barriers.
        mbarrier.wait(q_ready.index(stage), phase)
        dp_t = opaque_copy(st_zero - gl.expand_dims(delta_smem.index(stage).load(QUERIES), 0))
        s_t = warpgroup_mma(k_tile, q_tile.permute((1, 0)), st_zero, use_acc=False, is_async=True)
        mbarrier.wait(do_ready.index(stage), phase)
        dp_t = warpgroup_mma(v_tile, do_tile.permute((1, 0)), dp_t, is_async=True)
        lse_log2 = lse_smem.index(stage).load(QUERIES)
        s_t = warpgroup_mma_wait(1, deps=[s_t])
        s_t = s_t * qk_scale
        if HAS_SOFTCAP:
            tanh_t = tanh(s_t)
            s_t = tanh_t * softcap_log2
        p_t = gl.exp2(s_t - gl.expand_dims(lse_log2, 0))
        if (m0 < un_lo) | (m0 >= un_hi):
            rows = m0 + gl.arange(0, BLOCK_M, layout=QUERIES)
            keep = visible(gl.expand_dims(rows, 0), cols, seqlen_q, seqlen_k, window_left, window_right,
                           LEFT_BOUNDED, RIGHT_BOUNDED)
            p_t = gl.where(keep, p_t, 0.0)
        p_op = gl.convert_layout(p_t.to(dtype), A_LAYOUT)
        dv = warpgroup_mma(p_op, do_tile.slice(OUT_COL, OUT_DIM, dim=1), dv, is_async=True)
        if DQ_MODE == DQ_SEPARATE:  # dV's product runs on while dS^T is formed
            dp_t = warpgroup_mma_wait(1, deps=[dp_t])
        else:  # the fused forms' dS^T tile and dQ share leave no registers for it (ptxas spills 100 B more)
            dv, dp_t, p_op = warpgroup_mma_wait(0, deps=[dv, dp_t, p_op])
        ds_t = p_t * dp_t
        if HAS_SOFTCAP:
            ds_t = ds_t * (1.0 - tanh_t * tanh_t)
        if DQ_MODE == DQ_SEPARATE:
            ds_op = gl.convert_layout(ds_t.to(dtype), A_LAYOUT)
            dk = warpgroup_mma(ds_op, q_tile.slice(OUT_COL, OUT_DIM, dim=1), dk, is_async=True)
            dv, dk, p_op, ds_op = warpgroup_mma_wait(0, deps=[dv, dk, p_op, ds_op])
            mbarrier.arrive(slot_empty.index(stage), count=1)
        else:
            # dS^T goes through shared memory: as stored it is dK's A operand, and its permuted view
            # (dS, BLOCK_M x keys, MN-major) dQ's; the previous tile's products that read it (DQ_SPLIT: both
            # consumers') are done.
            if DQ_SPLIT:
                mbarrier.wait(ds_free, (i & 1) ^ 1, pred=i > 0)
            ds_tile.store(ds_t.to(dtype))
            fence_async_shared()
            dk = warpgroup_mma(ds_tile, q_tile, dk, is_async=True)
            if DQ_SPLIT:
                mbarrier.arrive(ds_ready, count=1)
                mbarrier.wait(ds_ready, i & 1)
            # DQ_SPLIT: the tile pairs from the query tile's parity on: a varying index keeps their wgmma
            # descriptors in the loop (hoisted, ptxas spilled them: 852 B instead of 440 at head_dim 128).
            dq = dq_zero
            for part in gl.static_range(DQ_PARTS):
                tile = (part + i) % 2 if DQ_SPLIT else CONSUMER
                dq = warpgroup_mma(ds_smem.index(tile).permute((1, 0)), k_smem.index(tile).slice(DQ_COL, DQ_DIM, dim=1),
                                   dq, use_acc=part > 0, is_async=True)
            dk = warpgroup_mma_wait(DQ_PARTS, deps=[dk])
            mbarrier.arrive(slot_empty.index(stage), count=1)
            dq = warpgroup_mma_wait(0, deps=[dq])
            if DQ_SPLIT:
                mbarrier.arrive(ds_free, count=1)
            # This consumer's place among the tile's contributors: 2 per key block, counted down from the
            # last block that sees the tile (the first to reach it: the blocks above walk fewer tiles
            # before it), consumer 0 first; with DQ_SPLIT both halves (different columns) take the first.
            rank = 2 * (last_key_block(m0, seqlen_q, seqlen_k, window_right, BLOCK_M, BLOCK_N, RIGHT_BOUNDED)
                        - n0 // BLOCK_N) + (0 if DQ_SPLIT else CONSUMER)
            share = semaphore_group + head * q_tiles + m0 // BLOCK_M
            add_dq_share(dq, dq_stage, dq_desc, head, m0, DQ_COL, share, rank, previous_share, i > 0,
                         DQ_MODE == DQ_ORDERED, CONSUMER_WARPS * 32, ROW_VECTOR)
            if DQ_MODE == DQ_ORDERED:  # carried through the loop only where it is read
                previous_share = share
    if DQ_MODE == DQ_ORDERED:  # the last share's release
        release_dq_share(previous_share, GROUP * tiles_per_head > 0, CONSUMER_WARPS * 32, ROW_VECTOR)

    # K and V are read by no product any more (with a split head_dim or DQ_SPLIT: by neither consumer,
    # once both have arrived): their tiles stage this consumer's dK and dV.
    if SPLIT_HEAD_DIM | DQ_SPLIT:
        mbarrier.arrive(pair_bars.index(0), count=1)
        mbarrier.wait(pair_bars.index(0), 0)
    dk_out = k_tile.slice(OUT_COL, OUT_DIM, dim=1)
    dv_out = v_tile.slice(OUT_COL, OUT_DIM, dim=1)
    dk_out.store((dk * softmax_scale).to(dtype))
    dv_out.store(dv.to(dtype))
    fence_async_shared()
    dk_desc = rows_descriptor(dk_base, seqlen_k, stride_dks, CONSUMER_KEYS, HEAD_DIM, OUT_DIM, KV_SMEM)
    dv_desc = rows_descriptor(dv_base, seqlen_k, stride_dvs, CONSUMER_KEYS, HEAD_DIM, OUT_DIM, KV_SMEM)
    tma.async_copy_shared_to_global(dk_desc, [key0, OUT_COL], dk_out)
    tma.async_copy_shared_to_global(dv_desc, [key0, OUT_COL], dv_out)
    tma.store_wait(0)


@unspecialised_jit
def _attn_bwd_dkdv_hopper_kernel(
    Q, K, V, DO, DK, DV, LSE_LOG2, DELTA, DQ_ACC, DQ_SEMAPHORES, CU_SEQLENS_Q, CU_SEQLENS_K,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_dob, stride_dos, stride_doh,
    stride_dkb, stride_dks, stride_dkh,
    stride_dvb, stride_dvs, stride_dvh,
    stride_dqb, stride_dqs, stride_dqh,
    stride_lse_b, stride_lse_h,
    seqlen_q, seqlen_k, batch_size,
    softmax_scale, qk_scale, softcap_log2, window_left, window_right,
    GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, HEAD_DIM_PAD: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
    LEFT_BOUNDED: gl.constexpr, RIGHT_BOUNDED: gl.constexpr, HAS_SOFTCAP: gl.constexpr,
    SPLIT_HEAD_DIM: gl.constexpr, QO_SMEM: gl.constexpr, QO_TMA: gl.constexpr, KV_SMEM: gl.constexpr,
    DQ_MODE: gl.constexpr, DS_SMEM: gl.constexpr, DQ_SMEM: gl.constexpr, DQ_TMA: gl.constexpr,
    DQ_SPLIT: gl.constexpr, IS_VARLEN: gl.constexpr, SEQS_PAD: gl.constexpr,
):
    """One program per BLOCK_N keys of one kv head; IS_VARLEN (DQ_SEPARATE only): packed sequences located by
    CU_SEQLENS_Q / CU_SEQLENS_K, the row statistics one padded run per head (bwd_stats.row_stats_buffers)."""
    KV_TILES: gl.constexpr = 1 if SPLIT_HEAD_DIM else 2
    gl.static_assert((BLOCK_N == KV_TILES * CONSUMER_KEYS) & ((DQ_MODE != DQ_SEPARATE) | (not DQ_SPLIT))
                     & ((DQ_MODE == DQ_SEPARATE) | (not IS_VARLEN)))
    dtype: gl.constexpr = Q.dtype.element_ty
    # Dense, each value is formed where ptxas can rematerialise it (from the program ids): with the varlen form's
    # selects the dK/dV consumers spill at head_dim 128.
    if IS_VARLEN:
        seq, pid_n = program_sequence_tile(batch_size, CU_SEQLENS_K, BLOCK_N, False, IS_VARLEN, SEQS_PAD,
                                           CONSUMER_WARPS)
        live = seq < batch_size  # programs past the last sequence's key blocks load and store nothing
        batch = gl.minimum(seq, batch_size - 1)
        q_first, k_first, seqlen_q, seqlen_k = sequence_bounds(batch, seqlen_q, seqlen_k, CU_SEQLENS_Q,
                                                               CU_SEQLENS_K, IS_VARLEN)
        # Past the sequence's last key (a program that is not live) the dK / dV stores are clipped away.
        n0 = gl.where(live, pid_n * BLOCK_N, gl.maximum(seqlen_k, 1))
        batch = batch.to(gl.int64)
    else:
        n0 = gl.program_id(0) * BLOCK_N
        if DQ_MODE == DQ_ORDERED:
            # Key blocks last first: a contributor waits only for higher blocks, which the grid then starts
            # earlier (FlashAttention-3's deterministic backward relies on the same launch order).
            n0 = (gl.num_programs(0) - 1 - gl.program_id(0)) * BLOCK_N
        batch = gl.program_id(2).to(gl.int64)
        q_first, k_first = 0, 0
    kv_head = gl.program_id(1).to(gl.int64)
    head0 = kv_head * GROUP
    q_base = Q + batch * stride_qb + q_first * stride_qs + head0 * stride_qh
    do_base = DO + batch * stride_dob + q_first * stride_dos + head0 * stride_doh
    k_base = K + batch * stride_kb + k_first * stride_ks + kv_head * stride_kh
    v_base = V + batch * stride_vb + k_first * stride_vs + kv_head * stride_vh
    dk_base = DK + batch * stride_dkb + k_first * stride_dks + kv_head * stride_dkh
    dv_base = DV + batch * stride_dvb + k_first * stride_dvs + kv_head * stride_dvh
    # Varlen: the group's statistics from each head's run (aligned for TMA); the sequence's rows from stats_first on
    # (bwd_stats.stats_start: a 16-byte boundary, as the TMA copies' coordinates must be).
    stats_first = stats_start(batch, q_first, IS_VARLEN)
    lse_group = LSE_LOG2 + batch * stride_lse_b + head0 * stride_lse_h
    delta_group = DELTA + batch * stride_lse_b + head0 * stride_lse_h
    # Fused: the group's dQ accumulator, and its semaphores, one per (batch, query head, query tile)
    q_tiles = (seqlen_q + BLOCK_M - 1) // BLOCK_M
    dq_group = DQ_ACC + batch * stride_dqb + head0 * stride_dqh
    semaphore_group = DQ_SEMAPHORES + (batch * gl.num_programs(1) + kv_head) * GROUP * q_tiles
    q_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_M, HEAD_DIM_PAD], QO_SMEM)
    do_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_M, HEAD_DIM_PAD], QO_SMEM)
    k_smem = gl.allocate_shared_memory(dtype, [KV_TILES, CONSUMER_KEYS, HEAD_DIM_PAD], KV_SMEM)
    v_smem = gl.allocate_shared_memory(dtype, [KV_TILES, CONSUMER_KEYS, HEAD_DIM_PAD], KV_SMEM)
    STATS_SMEM: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1)
    lse_smem = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, BLOCK_M], STATS_SMEM)
    delta_smem = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, BLOCK_M], STATS_SMEM)
    if DQ_MODE == DQ_SEPARATE:
        ds_smem, dq_smem = v_smem, v_smem  # not read
    else:  # each consumer's dS^T tile and dQ share
        ds_smem = gl.allocate_shared_memory(dtype, [2, CONSUMER_KEYS, BLOCK_M], DS_SMEM)
        dq_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M, HEAD_DIM_PAD // (2 if DQ_SPLIT else 1)], DQ_SMEM)
    kv_bars = gl.allocate_shared_memory(gl.int64, [KV_TILES, 1], mbarrier.MBarrierLayout())
    # Both consumers done with K and V; with DQ_SPLIT also the dS^T tiles' ready / free pair
    pair_bars = gl.allocate_shared_memory(gl.int64, [3 if DQ_SPLIT else 1, 1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    do_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    # A slot's Q and dO are released together, after dK's product: each arrive costs two warpgroup barriers.
    slot_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for c in gl.static_range(KV_TILES):
        mbarrier.init(kv_bars.index(c), count=1)
    for b in gl.static_range(3 if DQ_SPLIT else 1):
        mbarrier.init(pair_bars.index(b), count=2)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(do_ready.index(i), count=1)
        mbarrier.init(slot_empty.index(i), count=2)
    start, un_lo, un_hi, end = query_range(n0, seqlen_q, seqlen_k, window_left, window_right,
                                           BLOCK_M, BLOCK_N, LEFT_BOUNDED, RIGHT_BOUNDED)
    tiles_per_head = (end - start) // BLOCK_M
    if IS_VARLEN:
        tiles_per_head = gl.where(live, tiles_per_head, 0)
        # A TMA view needs a row: a sequence with no query loads no query tile, and one past the last takes the
        # last sequence's bounds, which may hold no key.
        seqlen_q, seqlen_k = gl.maximum(seqlen_q, 1), gl.maximum(seqlen_k, 1)
    # Consumers 0 and 1, then the producer (a comprehension: `+` on partition tuples strips constexprs)
    gl.warp_specialize(
        [(dkdv_load_partition, (q_base, do_base, k_base, v_base, lse_group, delta_group, stride_qh, stride_qs,
                                stride_doh, stride_dos, stride_ks, stride_vs, stride_lse_h, seqlen_q, seqlen_k, q_smem,
                                do_smem, k_smem, v_smem, lse_smem, delta_smem, kv_bars, q_ready, do_ready, slot_empty,
                                n0, start, tiles_per_head, stats_first, GROUP, HEAD_DIM, HEAD_DIM_PAD, BLOCK_M, NUM_STAGES,
                                SPLIT_HEAD_DIM, QO_TMA, KV_SMEM, CONSUMER_KEYS))
         if c == 2 else
         (_dkdv_consume_partition, (c, dk_base, dv_base, stride_dks, stride_dvs, q_smem, do_smem, k_smem, v_smem,
                                    lse_smem, delta_smem, kv_bars, pair_bars, q_ready,
                                    do_ready, slot_empty, n0, start, un_lo, un_hi, tiles_per_head, seqlen_q,
                                    seqlen_k, softmax_scale, qk_scale, softcap_log2, window_left, window_right,
                                    ds_smem, dq_smem, dq_group, stride_dqs, stride_dqh, semaphore_group, q_tiles,
                                    GROUP, HEAD_DIM, HEAD_DIM_PAD, BLOCK_M, BLOCK_N, NUM_STAGES, LEFT_BOUNDED,
                                    RIGHT_BOUNDED, HAS_SOFTCAP, SPLIT_HEAD_DIM, KV_SMEM, DQ_MODE, DQ_TMA, DQ_SPLIT))
         for c in (0, 1, 2)],
        [CONSUMER_WARPS, 1], [240, 24])


# (BLOCK_M, NUM_STAGES) per padded head_dim, FlashAttention-3's tile: two stages of Q and dO tiles plus K and V take
# 66-196 KB of shared memory. Registers bound BLOCK_M: a consumer holds S^T and dP^T (64 x BLOCK_M fp32 each) beside
# its dK and dV columns (64 x head_dim fp32 each), so head_dim 64 has room for BLOCK_M 128; softcap's tanh tile
# (64 x BLOCK_M) needs BLOCK_M 32 at 128 and 256, 64 at head_dim 64.
CONFIGS = {64: (128, 2), 128: (64, 2), 256: (64, 2)}
SOFTCAP_BLOCK_M = {64: 64, 128: 32, 256: 32}


# Fused (launch_fused), BLOCK_M is dQ's wgmma M: 64, with softcap too. Shared memory at head_dim 128: the Q/dO ring
# (64 KB), K and V (64 KB), the dS^T tiles (16 KB) and the two fp32 dQ stages (64 KB; 32 KB half-width with split_dq).
FUSED_BLOCK_M = 64


def config(head_dim_pad, softcap):
    """(BLOCK_M, NUM_STAGES) for a padded head_dim, with or without softcap."""
    block_m, num_stages = CONFIGS[head_dim_pad]
    return (SOFTCAP_BLOCK_M[head_dim_pad] if softcap > 0.0 else block_m), num_stages


def block_n(head_dim_pad):
    """Keys per program: 64 per consumer, or 64 shared by both when they split the head_dim."""
    return CONSUMER_KEYS.value * (1 if split_head_dim(head_dim_pad) else 2)


def split_head_dim(head_dim_pad):
    """Whether the dK/dV consumers split the head_dim (SPLIT_HEAD_DIM_ABOVE)."""
    return head_dim_pad > SPLIT_HEAD_DIM_ABOVE


def supports(q, seqlen_q, head_dim_pad, has_alibi, has_dropout):
    """Whether these kernels take these inputs (the caller has chosen the Gluon path for the device): 16-bit,
    dense or varlen, a padded head_dim and query length (varlen: max_seqlen_q) where they are the faster backward
    (tuning.GLUON_BACKWARD_FROM_SEQLEN), no ALiBi and no dropout (the tl kernels have them)."""
    return (q.dtype in (torch.float16, torch.bfloat16) and not has_alibi and not has_dropout
            and seqlen_q >= GLUON_BACKWARD_FROM_SEQLEN.get(head_dim_pad, float("inf")))


class Varlen(NamedTuple):
    """Packed sequences for the backward's launchers: int32 offsets (batch + 1,) and the longest lengths."""
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int


def dimensions(q, k, varlen):
    """(batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim) of dense inputs, or of packed ones with
    ``varlen`` (a Varlen; the longest lengths)."""
    if varlen is None:
        return (*q.shape[:2], k.shape[1], q.shape[2], k.shape[2], q.shape[3])
    return (varlen.cu_seqlens_q.numel() - 1, varlen.max_seqlen_q, varlen.max_seqlen_k, *q.shape[1:2], k.shape[1],
            q.shape[2])


@functools.cache  # built once per config, not on every launch
def shared_layouts(block_m, head_dim_pad, dtype):
    """NVMMA (swizzled) layouts: a Q/dO tile, the same tile as the box of a heads descriptor, a K/V tile."""
    gl_dtype = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    return (gl.NVMMASharedLayout.get_default_for([block_m, head_dim_pad], gl_dtype),
            gl.NVMMASharedLayout.get_default_for([1, block_m, head_dim_pad], gl_dtype),
            gl.NVMMASharedLayout.get_default_for([CONSUMER_KEYS.value, head_dim_pad], gl_dtype))


@functools.cache
def fused_layouts(block_m, head_dim_pad, dtype, split_dq=False):
    """NVMMA layouts of the fused kernel's tiles: a consumer's (keys, BLOCK_M) dS^T (dK's and, permuted, dQ's A
    operand), its fp32 dQ stage (half the head_dim wide with ``split_dq``), and that stage as the accumulator's TMA box."""
    gl_dtype = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    dq_box = [block_m, head_dim_pad // 2 if split_dq else head_dim_pad]
    return (gl.NVMMASharedLayout.get_default_for([CONSUMER_KEYS.value, block_m], gl_dtype),
            gl.NVMMASharedLayout.get_default_for(dq_box, gl.float32),
            gl.NVMMASharedLayout.get_default_for([1, *dq_box], gl.float32))


def launch_dkdv(q, k, v, grad_out, dk, dv, lse_log2, delta, softmax_scale, qk_scale, softcap_log2, window_left,
                window_right, softcap, head_dim_pad, strides, strides_lse, block_m=None, num_stages=None,
                dq_acc=None, dq_semaphores=None, split_dq=False, varlen=None):
    """Launch the dK/dV kernel on dense (batch, seqlen, heads, head_dim) inputs the caller has validated, or on
    packed (total, heads, head_dim) ones with ``varlen`` (a Varlen; not with dq_acc); ``strides`` are (batch, seq,
    head) strides of q, k, v, grad_out, dk, dv; lse_log2 and delta as flash_bwd's preprocess wrote them. With
    ``dq_acc`` (fp32 zeros, (batch, seqlen_q, heads, head_dim_pad), contiguous) the kernel also adds dQ /
    softmax_scale into it: in key-block order behind ``dq_semaphores`` (int32 zeros, one per (batch, query head,
    FUSED_BLOCK_M query tile)), or in arrival order where they are None; with ``split_dq`` each consumer adds half
    of dQ's columns (DQ_SPLIT)."""
    batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim = dimensions(q, k, varlen)
    is_varlen = varlen is not None
    if is_varlen and dq_acc is not None:
        raise ValueError("dq_acc: the dK/dV kernel forms dQ for dense inputs only (varlen runs the dQ kernel)")
    default_m, default_stages = config(head_dim_pad, softcap)
    if dq_acc is not None:
        default_m = FUSED_BLOCK_M
    block_m, num_stages = block_m or default_m, num_stages or default_stages
    qo_smem, qo_tma, kv_smem = shared_layouts(block_m, head_dim_pad, q.dtype)
    ensure_allocator(q.device)  # the in-kernel TMA descriptors' scratch
    keys = block_n(head_dim_pad)
    mode = DQ_SEPARATE if dq_acc is None else DQ_UNORDERED if dq_semaphores is None else DQ_ORDERED
    # DQ_MODE decides whether the dQ pointers are read; placeholders of their types where they are not.
    placeholders = (delta if dq_acc is None else dq_acc,
                    delta.view(torch.int32) if dq_semaphores is None else dq_semaphores)
    # Key blocks on the grid's fastest axis: DQ_ORDERED's contributors wait for blocks started earlier.
    grid = tile_grid(keys, seqlen_k, k.shape[0], batch, heads_kv, is_varlen)
    ds_smem, dq_smem, dq_tma = fused_layouts(block_m, head_dim_pad, q.dtype, split_dq)
    launcher(_attn_bwd_dkdv_hopper_kernel, grid)(  # q stands in for the offsets a dense launch never reads
        q, k, v, grad_out, dk, dv, lse_log2, delta, *placeholders, *(varlen[:2] if is_varlen else (q, q)),
        *strides, *(dq_acc.stride()[:3] if dq_acc is not None else (0, 0, 0)), *strides_lse, seqlen_q, seqlen_k,
        batch, softmax_scale, qk_scale, softcap_log2, window_left, window_right,
        GROUP=heads_q // heads_kv, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        BLOCK_M=block_m, BLOCK_N=keys, NUM_STAGES=num_stages,
        LEFT_BOUNDED=window_left >= 0, RIGHT_BOUNDED=window_right >= 0, HAS_SOFTCAP=softcap > 0.0,
        SPLIT_HEAD_DIM=split_head_dim(head_dim_pad), QO_SMEM=qo_smem, QO_TMA=qo_tma, KV_SMEM=kv_smem,
        DQ_MODE=mode, DS_SMEM=ds_smem, DQ_SMEM=dq_smem, DQ_TMA=dq_tma, DQ_SPLIT=split_dq, IS_VARLEN=is_varlen,
        SEQS_PAD=seqs_pad(batch, is_varlen), num_warps=CONSUMER_WARPS.value,
    )


def fused_supports(head_dim_pad, softcap):
    """Whether the dK/dV kernel can also form dQ here: not where the consumers split the head_dim (each
    would own half of dQ's columns), nor with softcap past head_dim 64, where its tanh tile does not fit
    the registers beside the four accumulators at BLOCK_M = 64 (ptxas spilled 1.3 KB at 128)."""
    return not split_head_dim(head_dim_pad) and (softcap == 0.0 or head_dim_pad <= 64)


def launch_fused(q, k, v, grad_out, dq, dk, dv, lse_log2, delta, softmax_scale, qk_scale, softcap_log2, window_left,
                 window_right, softcap, head_dim_pad, strides, strides_lse, deterministic=True, split_dq=False):
    """dQ, dK and dV from the dK/dV kernel alone (where fused_supports): the dQ shares summed in fp32 in a
    fixed order (``deterministic``) or in arrival order, then scaled into ``dq``; with ``split_dq`` each
    consumer adds half of dQ's columns. Arguments as launch_dkdv's, ``strides`` without dq's."""
    batch, seqlen_q, heads_q, head_dim = q.shape
    dq_acc = torch.zeros(batch, seqlen_q, heads_q, head_dim_pad, dtype=torch.float32, device=q.device)
    semaphores = None
    if deterministic:
        semaphores = torch.zeros(batch * heads_q * triton.cdiv(seqlen_q, FUSED_BLOCK_M), dtype=torch.int32,
                                 device=q.device)
    launch_dkdv(q, k, v, grad_out, dk, dv, lse_log2, delta, softmax_scale, qk_scale, softcap_log2, window_left,
                window_right, softcap, head_dim_pad, strides, strides_lse, dq_acc=dq_acc, dq_semaphores=semaphores,
                split_dq=split_dq)
    return dq.copy_(dq_acc[..., :head_dim].mul_(softmax_scale))
