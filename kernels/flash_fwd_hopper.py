"""FlashAttention forward for Hopper (sm_90) in Gluon: the algorithm of flash_fwd.py, scheduled by hand.

Triton's own pipeliner waits on every tensor-core product of the tl attention loop before the next instruction, so a
program's softmax never overlaps its matrix products. Here the schedule is written out, as FlashAttention-3 does it:

* warp specialisation: a producer warp streams K and V tiles by TMA into a ring of NUM_STAGES
  shared-memory slots (a "ready" and an "empty" mbarrier per slot and tensor); CONSUMERS (2 or 3)
  consumer warpgroups of 64 query rows each compute, with the registers setmaxnreg gives them;
* within a consumer, for key tile j: S_j = Q K_j^T and O += P_{j-1} V_{j-1} are issued back to back as asynchronous
  wgmma; the consumer waits for S_j alone and runs the softmax of tile j while P_{j-1} V_{j-1} is still on the tensor
  cores (P in registers, the A operand of P V), then waits for O and rescales it;
* across consumers: each releases a slot on its own, so they drift apart and one's products overlap another's
  softmax. Three consumers (192 rows) share each K/V tile among more rows, for head_dim 64, whose small products
  leave the per-tile costs (barriers, softmax) dominant.

The semantics are flash_fwd.py's (bottom-right causal, windows, softcap, GQA, lse in natural log, rows that see no key
give 0 and lse -inf); flash_fwd.py stays the portable, interpreter-tested statement of the algorithm.

PERSISTENT (where tuning.gluon_forward_config measured it faster): one program per SM, each walking its slice of
tile_schedule.py's deal (each tile to the least-loaded program) through the same partitions. The K/V ring and its
phases run on across tiles (the next tile's keys stream in while this one finishes), and two sets of Q blocks where
shared memory allows let the next tile's queries load under this tile's work and this tile's output store drain
under the next one's first product; TMA descriptors cover whole tensors. OVERLAP_TILES (two sets): a tile's end
and the next tile's start overlap as a key tile's softmax and P V do: the next tile's first S is issued under the
last P V, and the epilogue (normalise, lse, output store) runs while that S computes (_attend_overlapped).
"""

from __future__ import annotations

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from .flash_fwd_hopper_load import heads_descriptor, load_partition
from .flash_fwd_hopper_tile import (CONSUMER_WARPS, attend, finish_values, issue_scores, key_loop, normalised,
                                    opening_softmax, retire_store, store_out)
from .hopper_ops import (CONSUMER_ROWS, mma_layout, pass_turn, program_sequence_tile, rows_descriptor,
                         unspecialised_jit, wait_turn)
from .launch import ensure_allocator, launcher, seqs_pad, sm_count, tile_grid
from .tile_ops import sequence_bounds
from .tile_schedule import (device_schedule, q_buffers, query_block, scheduled_tiles, section_pairs,
                            tile_coords)
from .tuning import (GLUON_FORWARD_FROM_SEQLEN, GLUON_VARLEN_FORWARD_FROM_SEQLEN, gluon_consumers_take_turns,
                     gluon_forward_config, gluon_overlaps_tiles)

# A program is CONSUMERS + 1 partitions (gl.warp_specialize): one TMA producer warp and CONSUMERS
# consumer warpgroups, each over 64 of the tile's 64 * CONSUMERS query rows. A consumer frees a K/V slot
# by one arrival on the slot's "empty" barrier (count CONSUMERS) as soon as its own wgmma no longer
# reads it, so the warpgroups never wait for each other and drift apart: one's matrix products fill the
# tensor cores while another runs its softmax.
#
# setmaxnreg per thread of a consumer and of the producer, by CONSUMERS. The producer warp is padded to
# a warpgroup, and the SM's 65536 registers are shared: 2 x 128 x 232 + 128 x 40 = 64512;
# 3 x 128 x 160 + 128 x 32 = 65536 (FlashAttention-3's split for three consumers).
REGISTERS = {2: (232, 40), 3: (160, 32)}


@gluon.constexpr_function
def _partition_registers(consumers):
    """setmaxnreg of each worker partition: consumers 1..CONSUMERS-1, then the producer."""
    consumer, producer = REGISTERS[consumers]
    return [consumer] * (consumers - 1) + [producer]


@gluon.constexpr_function
def _partition_warps(consumers):
    """Warps of each worker partition: consumers 1..CONSUMERS-1, then the producer."""
    return [CONSUMER_WARPS.value] * (consumers - 1) + [1]


@gluon.jit
def _tile_at(TILE_SCHEDULE, index, last, seqlen_q, seqlen_k, window_left, window_right, batch_size, heads,
             num_m_blocks, section, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, LEFT_BOUNDED: gl.constexpr,
             RIGHT_BOUNDED: gl.constexpr):
    """(batch, head, m0, start, un_lo, un_hi, num_tiles) of the schedule's index-th entry, clamped to the
    program's last tile: the entry after a program's last one is another program's, or past the table."""
    tile = gl.load(TILE_SCHEDULE + gl.minimum(index, last - 1))
    batch, head, pid_m = tile_coords(tile, num_m_blocks, heads, batch_size * heads, section, RIGHT_BOUNDED)
    m0, start, un_lo, un_hi, num_tiles = query_block(pid_m, seqlen_q, seqlen_k, window_left, window_right, BLOCK_M,
                                                     BLOCK_N, LEFT_BOUNDED, RIGHT_BOUNDED)
    return batch, head, m0, start, un_lo, un_hi, num_tiles


@gluon.jit
def _attend_tiles(CONSUMER: gl.constexpr, o_desc, LSE, stride_lse_b, stride_lse_h, seqlen_q, seqlen_k, qk_scale,
                  softcap_log2, window_left, window_right, batch_size, heads, num_m_blocks, section, TILE_SCHEDULE,
                  q_smem, k_smem, v_smem, q_bars, q_free, k_ready, v_ready, k_empty, v_empty,
                  HEAD_DIM_PAD: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
                  CONSUMERS: gl.constexpr, LEFT_BOUNDED: gl.constexpr, RIGHT_BOUNDED: gl.constexpr,
                  HAS_SOFTCAP: gl.constexpr, Q_BUFFERS: gl.constexpr, TURNS: gl.constexpr):
    """A persistent consumer whose tiles run one after the other (each through _attend)."""
    BLOCK_M: gl.constexpr = CONSUMERS * CONSUMER_ROWS
    # With one set of Q blocks the next tile's queries need the block at once: no store drains under it.
    DEFER_STORE: gl.constexpr = Q_BUFFERS > 1
    WAIT_STORE: gl.constexpr = Q_BUFFERS == 1
    loaded = 0
    first, last = scheduled_tiles(TILE_SCHEDULE)
    for tile_index in range(last - first):
        batch, head, m0, start, un_lo, un_hi, num_tiles = _tile_at(
            TILE_SCHEDULE, first + tile_index, last, seqlen_q, seqlen_k, window_left, window_right, batch_size, heads,
            num_m_blocks, section, BLOCK_M, BLOCK_N, LEFT_BOUNDED, RIGHT_BOUNDED)
        row0 = m0 + CONSUMER * CONSUMER_ROWS
        slot = (tile_index % Q_BUFFERS) * CONSUMERS + CONSUMER
        previous = ((tile_index + Q_BUFFERS - 1) % Q_BUFFERS) * CONSUMERS + CONSUMER
        out = attend(q_smem.index(slot), q_bars.index(slot), k_smem, v_smem, k_ready, v_ready, k_empty, v_empty,
                     LSE + batch.to(gl.int64) * stride_lse_b + head.to(gl.int64) * stride_lse_h, row0, start,
                     un_lo, un_hi, num_tiles, loaded, (tile_index // Q_BUFFERS) & 1, seqlen_q, seqlen_k,
                     qk_scale, softcap_log2, window_left, window_right, q_free.index(previous), tile_index > 0,
                     HEAD_DIM_PAD, BLOCK_N, NUM_STAGES, LEFT_BOUNDED, RIGHT_BOUNDED, HAS_SOFTCAP, DEFER_STORE,
                     CONSUMER, TURNS)
        store_out(o_desc, batch, row0, head, out, q_smem.index(slot), True, WAIT_STORE)
        if WAIT_STORE:
            mbarrier.arrive(q_free.index(slot), count=1)  # the producer may load this buffer's next Q block
        loaded += num_tiles
    tma.store_wait(0)  # the last output store reads shared memory, which lives as long as the program


@gluon.jit
def _attend_overlapped(CONSUMER: gl.constexpr, o_desc, LSE, stride_lse_b, stride_lse_h, seqlen_q, seqlen_k, qk_scale,
                       softcap_log2, window_left, window_right, batch_size, heads, num_m_blocks, section,
                       TILE_SCHEDULE, q_smem, k_smem, v_smem, q_bars, q_free, k_ready, v_ready, k_empty, v_empty,
                       HEAD_DIM_PAD: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
                       CONSUMERS: gl.constexpr, LEFT_BOUNDED: gl.constexpr, RIGHT_BOUNDED: gl.constexpr,
                       HAS_SOFTCAP: gl.constexpr, TURNS: gl.constexpr):
    """A persistent consumer over two sets of Q blocks whose tiles overlap at their boundaries: the next tile's
    first S is issued under this tile's last P V, this tile's epilogue runs while that S computes, and its
    output store drains under that S's softmax. No product crosses the loop's back edge: the next tile's P, max
    and sum do, as plain values."""
    BLOCK_M: gl.constexpr = CONSUMERS * CONSUMER_ROWS
    O_LAYOUT: gl.constexpr = mma_layout(HEAD_DIM_PAD, CONSUMER_WARPS)
    P_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_LAYOUT, k_width=2)
    ROW_S: gl.constexpr = gl.SliceLayout(1, mma_layout(BLOCK_N, CONSUMER_WARPS))
    dtype: gl.constexpr = q_smem.dtype
    first, last = scheduled_tiles(TILE_SCHEDULE)
    batch, head, m0, start, un_lo, un_hi, num_tiles = _tile_at(
        TILE_SCHEDULE, first, last, seqlen_q, seqlen_k, window_left, window_right, batch_size, heads, num_m_blocks,
        section, BLOCK_M, BLOCK_N, LEFT_BOUNDED, RIGHT_BOUNDED)
    # The state a tile with no visible key finishes with: lse -inf, zeros out.
    no_p = gl.zeros([CONSUMER_ROWS, BLOCK_N], dtype, P_LAYOUT)
    no_max = gl.full([CONSUMER_ROWS], float("-inf"), gl.float32, ROW_S)
    no_sum = gl.zeros([CONSUMER_ROWS], gl.float32, ROW_S)
    p_op, row_max, row_sum = no_p, no_max, no_sum
    mbarrier.wait(q_bars.index(CONSUMER), 0)
    if num_tiles > 0:  # the first tile's first S, with nothing to overlap yet
        wait_turn(CONSUMER, TURNS)
        s = issue_scores(q_smem.index(CONSUMER), k_smem, k_ready, 0, BLOCK_N, NUM_STAGES)
        pass_turn(CONSUMER, TURNS)
        s = warpgroup_mma_wait(0, deps=[s])
        mbarrier.arrive(k_empty.index(0), count=1)
        p_op, row_max, row_sum = opening_softmax(
            s, m0 + CONSUMER * CONSUMER_ROWS + gl.arange(0, CONSUMER_ROWS, layout=ROW_S), start, un_lo, un_hi,
            seqlen_q, seqlen_k, qk_scale, softcap_log2, window_left, window_right, dtype, HEAD_DIM_PAD, BLOCK_N,
            LEFT_BOUNDED, RIGHT_BOUNDED, HAS_SOFTCAP)
    loaded = 0
    for tile_index in range(last - first):
        slot = (tile_index % 2) * CONSUMERS + CONSUMER
        following = ((tile_index + 1) % 2) * CONSUMERS + CONSUMER
        row0 = m0 + CONSUMER * CONSUMER_ROWS
        rows = row0 + gl.arange(0, CONSUMER_ROWS, layout=ROW_S)
        acc = gl.zeros([CONSUMER_ROWS, HEAD_DIM_PAD], gl.float32, O_LAYOUT)
        acc, p_op, row_max, row_sum = key_loop(q_smem.index(slot), k_smem, v_smem, k_ready, v_ready, k_empty,
                                               v_empty, acc, p_op, row_max, row_sum, rows, start, un_lo, un_hi,
                                               num_tiles, loaded, seqlen_q, seqlen_k, qk_scale, softcap_log2,
                                               window_left, window_right, HEAD_DIM_PAD, BLOCK_N, NUM_STAGES,
                                               LEFT_BOUNDED, RIGHT_BOUNDED, HAS_SOFTCAP, CONSUMER, TURNS)
        lse_ptr = LSE + batch.to(gl.int64) * stride_lse_b + head.to(gl.int64) * stride_lse_h
        next_batch, next_head, next_m0, next_start, next_un_lo, next_un_hi, next_tiles = _tile_at(
            TILE_SCHEDULE, first + tile_index + 1, last, seqlen_q, seqlen_k, window_left, window_right, batch_size,
            heads, num_m_blocks, section, BLOCK_M, BLOCK_N, LEFT_BOUNDED, RIGHT_BOUNDED)
        has_next = first + tile_index + 1 < last
        next_rows = next_m0 + CONSUMER * CONSUMER_ROWS + gl.arange(0, CONSUMER_ROWS, layout=ROW_S)
        next_loaded = loaded + num_tiles
        next_phase = ((tile_index + 1) // 2) & 1
        next_p, next_max, next_sum = no_p, no_max, no_sum
        if (num_tiles > 0) & has_next & (next_tiles > 0):
            stage = (next_loaded - 1) % NUM_STAGES
            wait_turn(CONSUMER, TURNS)
            mbarrier.wait(v_ready.index(stage), ((next_loaded - 1) // NUM_STAGES) & 1)
            o_run = warpgroup_mma(p_op, v_smem.index(stage), acc, is_async=True)
            mbarrier.wait(q_bars.index(following), next_phase)
            s = issue_scores(q_smem.index(following), k_smem, k_ready, next_loaded, BLOCK_N, NUM_STAGES)
            pass_turn(CONSUMER, TURNS)
            o_done = warpgroup_mma_wait(1, deps=[o_run])
            mbarrier.arrive(v_empty.index(stage), count=1)
            store_out(o_desc, batch, row0, head,
                      normalised(o_done, row_max, row_sum, lse_ptr, rows, seqlen_q, O_LAYOUT).to(dtype), q_smem.index(slot),
                      True, False)
            s = warpgroup_mma_wait(0, deps=[s])
            mbarrier.arrive(k_empty.index(next_loaded % NUM_STAGES), count=1)
            next_p, next_max, next_sum = opening_softmax(s, next_rows, next_start, next_un_lo, next_un_hi, seqlen_q,
                                                         seqlen_k, qk_scale, softcap_log2, window_left, window_right,
                                                         dtype, HEAD_DIM_PAD, BLOCK_N, LEFT_BOUNDED, RIGHT_BOUNDED,
                                                         HAS_SOFTCAP)
        else:
            if num_tiles > 0:
                acc = finish_values(p_op, v_smem, v_ready, v_empty, next_loaded - 1, acc, NUM_STAGES, CONSUMER, TURNS)
            store_out(o_desc, batch, row0, head, normalised(acc, row_max, row_sum, lse_ptr, rows, seqlen_q, O_LAYOUT).to(dtype),
                      q_smem.index(slot), True, False)
            if has_next & (next_tiles > 0):
                mbarrier.wait(q_bars.index(following), next_phase)
                wait_turn(CONSUMER, TURNS)
                s = issue_scores(q_smem.index(following), k_smem, k_ready, next_loaded, BLOCK_N, NUM_STAGES)
                pass_turn(CONSUMER, TURNS)
                s = warpgroup_mma_wait(0, deps=[s])
                mbarrier.arrive(k_empty.index(next_loaded % NUM_STAGES), count=1)
                next_p, next_max, next_sum = opening_softmax(s, next_rows, next_start, next_un_lo, next_un_hi,
                                                             seqlen_q, seqlen_k, qk_scale, softcap_log2, window_left,
                                                             window_right, dtype, HEAD_DIM_PAD, BLOCK_N,
                                                             LEFT_BOUNDED, RIGHT_BOUNDED, HAS_SOFTCAP)
            elif has_next:
                mbarrier.wait(q_bars.index(following), next_phase)
        # The store has read the block by now (a softmax later, where the tiles overlapped): the producer may
        # load the tile after next's queries into it.
        retire_store(q_free.index(slot), True)
        p_op, row_max, row_sum = next_p, next_max, next_sum
        batch, head, m0, start, un_lo, un_hi, num_tiles = (next_batch, next_head, next_m0, next_start, next_un_lo,
                                                           next_un_hi, next_tiles)
        loaded = next_loaded


@gluon.jit
def _consume_partition(CONSUMER: gl.constexpr, O, LSE, stride_ob, stride_os, stride_oh, stride_lse_b, stride_lse_h,
                       seqlen_q, seqlen_k, qk_scale, softcap_log2, window_left, window_right, batch_size, heads,
                       num_m_blocks, section, TILE_SCHEDULE, CU_SEQLENS_Q, CU_SEQLENS_K, seq, pid_m, q_smem, k_smem,
                       v_smem, q_bars, q_free, k_ready, v_ready, k_empty, v_empty, HEAD_DIM: gl.constexpr,
                       HEAD_DIM_PAD: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
                       CONSUMERS: gl.constexpr, LEFT_BOUNDED: gl.constexpr, RIGHT_BOUNDED: gl.constexpr,
                       HAS_SOFTCAP: gl.constexpr, Q_BUFFERS: gl.constexpr, PERSISTENT: gl.constexpr,
                       OVERLAP_TILES: gl.constexpr, IS_VARLEN: gl.constexpr, Q_SMEM: gl.constexpr,
                       TURNS: gl.constexpr):
    BLOCK_M: gl.constexpr = CONSUMERS * CONSUMER_ROWS
    if CONSUMER == CONSUMERS - 1:
        pass_turn(CONSUMER, TURNS)  # consumer 0 takes the first turn
    if PERSISTENT:
        o_desc = heads_descriptor(O, batch_size, seqlen_q, heads, stride_ob, stride_os, stride_oh, CONSUMER_ROWS,
                                  HEAD_DIM, HEAD_DIM_PAD, Q_SMEM)
        if OVERLAP_TILES:
            _attend_overlapped(CONSUMER, o_desc, LSE, stride_lse_b, stride_lse_h, seqlen_q, seqlen_k, qk_scale,
                               softcap_log2, window_left, window_right, batch_size, heads, num_m_blocks, section,
                               TILE_SCHEDULE, q_smem, k_smem, v_smem, q_bars, q_free, k_ready, v_ready, k_empty,
                               v_empty, HEAD_DIM_PAD, BLOCK_N, NUM_STAGES, CONSUMERS, LEFT_BOUNDED, RIGHT_BOUNDED,
                               HAS_SOFTCAP, TURNS)
        else:
            _attend_tiles(CONSUMER, o_desc, LSE, stride_lse_b, stride_lse_h, seqlen_q, seqlen_k, qk_scale,
                          softcap_log2, window_left, window_right, batch_size, heads, num_m_blocks, section,
                          TILE_SCHEDULE, q_smem, k_smem, v_smem, q_bars, q_free, k_ready, v_ready, k_empty, v_empty,
                          HEAD_DIM_PAD, BLOCK_N, NUM_STAGES, CONSUMERS, LEFT_BOUNDED, RIGHT_BOUNDED, HAS_SOFTCAP,
                          Q_BUFFERS, TURNS)
    elif seq < batch_size:  # a one-tile program (load_partition's)
        q_first, _, seqlen_q, seqlen_k = sequence_bounds(seq, seqlen_q, seqlen_k, CU_SEQLENS_Q, CU_SEQLENS_K,
                                                         IS_VARLEN)
        m0, start, un_lo, un_hi, num_tiles = query_block(pid_m, seqlen_q, seqlen_k, window_left, window_right,
                                                         BLOCK_M, BLOCK_N, LEFT_BOUNDED, RIGHT_BOUNDED)
        batch, head = seq.to(gl.int64), gl.program_id(1).to(gl.int64)
        row0 = m0 + CONSUMER * CONSUMER_ROWS
        out = attend(q_smem.index(CONSUMER), q_bars.index(CONSUMER), k_smem, v_smem, k_ready, v_ready, k_empty,
                     v_empty, LSE + batch * stride_lse_b + head * stride_lse_h + q_first, row0, start, un_lo, un_hi,
                     num_tiles, 0, 0, seqlen_q, seqlen_k, qk_scale, softcap_log2, window_left, window_right,
                     q_bars.index(CONSUMER), False, HEAD_DIM_PAD, BLOCK_N, NUM_STAGES, LEFT_BOUNDED, RIGHT_BOUNDED,
                     HAS_SOFTCAP, False, CONSUMER, TURNS)
        o_desc = rows_descriptor(O + batch * stride_ob + q_first * stride_os + head * stride_oh, seqlen_q, stride_os,
                                 CONSUMER_ROWS, HEAD_DIM, HEAD_DIM_PAD, Q_SMEM)
        store_out(o_desc, batch, row0, head, out, q_smem.index(CONSUMER), PERSISTENT, True)


@unspecialised_jit
def _attn_fwd_hopper_kernel(
    Q, K, V, O, LSE, TILE_SCHEDULE, CU_SEQLENS_Q, CU_SEQLENS_K,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ob, stride_os, stride_oh,
    stride_lse_b, stride_lse_h,
    seqlen_q, seqlen_k,
    qk_scale, softcap_log2, window_left, window_right,
    batch_size, heads, num_m_blocks, section,
    GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, HEAD_DIM_PAD: gl.constexpr,
    CONSUMERS: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
    LEFT_BOUNDED: gl.constexpr, RIGHT_BOUNDED: gl.constexpr, HAS_SOFTCAP: gl.constexpr,
    Q_BUFFERS: gl.constexpr, PERSISTENT: gl.constexpr, OVERLAP_TILES: gl.constexpr, Q_SMEM: gl.constexpr,
    KV_SMEM: gl.constexpr, TURNS: gl.constexpr, IS_VARLEN: gl.constexpr, SEQS_PAD: gl.constexpr,
):
    """One query tile per program on a (query blocks, heads, batch) grid or, PERSISTENT, a 1-D grid whose
    programs each walk their slice of TILE_SCHEDULE (tile_schedule.schedule_table), with Q_BUFFERS sets of Q
    blocks (2: the next tile's queries load while this tile runs). OVERLAP_TILES (persistent, two sets): a tile's
    boundary with the next overlaps (_attend_overlapped). TURNS (CONSUMERS, or 0): the consumers issue their
    products in rotation (flash_fwd_hopper_tile.wait_turn). IS_VARLEN (one tile per program): packed (total, heads,
    head_dim) rows, sequence b's at CU_SEQLENS_Q[b] (queries) and CU_SEQLENS_K[b] (keys, values), batch_size
    sequences; seqlen_q and seqlen_k go unread."""
    dtype: gl.constexpr = Q.dtype.element_ty
    seq, pid_m = program_sequence_tile(batch_size, CU_SEQLENS_Q, CONSUMERS * CONSUMER_ROWS, RIGHT_BOUNDED, IS_VARLEN,
                                       SEQS_PAD, CONSUMER_WARPS)
    q_smem = gl.allocate_shared_memory(dtype, [Q_BUFFERS * CONSUMERS, CONSUMER_ROWS, HEAD_DIM_PAD], Q_SMEM)
    k_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM_PAD], KV_SMEM)
    v_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM_PAD], KV_SMEM)
    q_bars = gl.allocate_shared_memory(gl.int64, [Q_BUFFERS * CONSUMERS, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for c in gl.static_range(Q_BUFFERS * CONSUMERS):
        mbarrier.init(q_bars.index(c), count=1)
    if PERSISTENT:
        q_free = gl.allocate_shared_memory(gl.int64, [Q_BUFFERS * CONSUMERS, 1], mbarrier.MBarrierLayout())
        for c in gl.static_range(Q_BUFFERS * CONSUMERS):
            mbarrier.init(q_free.index(c), count=1)
    else:
        q_free = q_bars  # never waited on: a one-tile program loads each Q block once
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=CONSUMERS)
        mbarrier.init(v_empty.index(i), count=CONSUMERS)
    # Partitions: consumers 0..CONSUMERS-1 (consumer 0 is the default partition, the launch's num_warps),
    # then the producer. A comprehension over a literal tuple is how Gluon unrolls a list at compile time;
    # one comprehension, as `+` on tuples of partitions strips their constexpr arguments.
    gl.warp_specialize(
        [(load_partition, (Q, K, V, stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb,
                           stride_vs, stride_vh, seqlen_q, seqlen_k, window_left, window_right, batch_size, heads,
                           num_m_blocks, section, TILE_SCHEDULE, CU_SEQLENS_Q, CU_SEQLENS_K, seq, pid_m, q_smem,
                           k_smem, v_smem, q_bars, q_free, k_ready, v_ready, k_empty, v_empty, GROUP, HEAD_DIM,
                           HEAD_DIM_PAD, BLOCK_N, NUM_STAGES, CONSUMERS, LEFT_BOUNDED, RIGHT_BOUNDED, Q_BUFFERS,
                           PERSISTENT, IS_VARLEN, Q_SMEM, KV_SMEM))
         if c == CONSUMERS else
         (_consume_partition, (c, O, LSE, stride_ob, stride_os, stride_oh, stride_lse_b, stride_lse_h, seqlen_q,
                               seqlen_k, qk_scale, softcap_log2, window_left, window_right, batch_size, heads,
                               num_m_blocks, section, TILE_SCHEDULE, CU_SEQLENS_Q, CU_SEQLENS_K, seq, pid_m,
                               q_smem, k_smem, v_smem, q_bars, q_free, k_ready, v_ready, k_empty, v_empty, HEAD_DIM,
                               HEAD_DIM_PAD, BLOCK_N, NUM_STAGES, CONSUMERS, LEFT_BOUNDED, RIGHT_BOUNDED, HAS_SOFTCAP,
                               Q_BUFFERS, PERSISTENT, OVERLAP_TILES, IS_VARLEN, Q_SMEM, TURNS))
         for c in (0, 1, 2, 3)[:CONSUMERS + 1]],
        _partition_warps(CONSUMERS), _partition_registers(CONSUMERS))


def supports(q, seqlen_q, head_dim_pad, has_alibi, has_dropout, is_varlen=False):
    """Whether this kernel takes these inputs (the caller has chosen the Gluon path for the device): 16-bit,
    dense or varlen, a padded head_dim and query length (varlen: max_seqlen_q) where it is the faster forward, no
    ALiBi and no dropout (the tl kernel has them)."""
    from_seqlen = GLUON_VARLEN_FORWARD_FROM_SEQLEN if is_varlen else GLUON_FORWARD_FROM_SEQLEN
    return (q.dtype in (torch.float16, torch.bfloat16) and not has_alibi and not has_dropout
            and seqlen_q >= from_seqlen.get(head_dim_pad, float("inf")))


@functools.cache  # built once per config, not on every launch
def shared_layouts(block_n, head_dim_pad, dtype):
    """NVMMA (swizzled) shared-memory layouts of a consumer's Q/O tile and of a K/V tile."""
    gl_dtype = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    return (gl.NVMMASharedLayout.get_default_for([CONSUMER_ROWS.value, head_dim_pad], gl_dtype),
            gl.NVMMASharedLayout.get_default_for([block_n, head_dim_pad], gl_dtype))


def launch_forward(q, k, v, out, lse, qk_scale, softcap_log2, window_left, window_right, softcap, head_dim_pad,
                   strides, strides_lse, block_n=None, num_stages=None, consumers=None, persistent=None,
                   overlap_tiles=None, turns=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                   max_seqlen_k=None):
    """Launch the kernel on dense (batch, seqlen, heads, head_dim) inputs the caller has validated, or packed
    (total, heads, head_dim) ones with cu_seqlens_q / cu_seqlens_k and max_seqlen_q / max_seqlen_k (hints that
    pick the config; one tile per program); block_n, num_stages, consumers (2 or 3 warpgroups of 64 rows) and
    persistent (one program per SM, each walking its share of tile_schedule's order) override
    gluon_forward_config's choice, overlap_tiles (a persistent program's tile boundaries overlapped, where it has
    two sets of Q blocks) the rule's, and turns (the consumers issuing their products in rotation)
    tuning.gluon_consumers_take_turns'."""
    is_varlen = cu_seqlens_q is not None
    if is_varlen:
        if persistent:
            raise ValueError("persistent: the varlen forward runs one tile per program (its schedule would need "
                             "the sequence lengths on the host)")
        batch, (heads_q, head_dim), heads_kv = cu_seqlens_q.numel() - 1, q.shape[1:], k.shape[1]
        seqlen_q, seqlen_k, persistent = max_seqlen_q, max_seqlen_k, False
    else:
        batch, seqlen_q, heads_q, head_dim = q.shape
        seqlen_k, heads_kv = k.shape[1], k.shape[2]
    default_n, default_stages, default_consumers, default_persistent = gluon_forward_config(head_dim_pad, seqlen_k,
                                                                                            window_right >= 0)
    block_n, num_stages, consumers = block_n or default_n, num_stages or default_stages, consumers or default_consumers
    persistent = default_persistent if persistent is None else persistent
    if consumers not in REGISTERS:
        raise ValueError(f"consumers must be one of {sorted(REGISTERS)}, got {consumers}")
    q_smem, kv_smem = shared_layouts(block_n, head_dim_pad, q.dtype)
    ensure_allocator(q.device)  # the in-kernel TMA descriptors' scratch
    block_m = consumers * CONSUMER_ROWS.value
    num_m_blocks = triton.cdiv(seqlen_q, block_m)
    section = section_pairs(seqlen_k, head_dim_pad, heads_q, heads_kv, q.element_size())
    programs = min(num_m_blocks * heads_q * batch, sm_count(q.device.index))
    schedule = device_schedule(q.device, programs, batch, heads_q, num_m_blocks, section, seqlen_q, seqlen_k,
                               window_left, window_right, block_m, block_n) if persistent else None
    persistent = schedule is not None  # no table yet for this shape inside a CUDA-graph capture: one tile per program
    q_sets = q_buffers(2 * num_stages * block_n, block_m, head_dim_pad, q.element_size()) if persistent else 1
    if turns is None:
        turns = gluon_consumers_take_turns(head_dim_pad, consumers, persistent)
    if overlap_tiles is None:
        overlap_tiles = gluon_overlaps_tiles(head_dim_pad, seqlen_k, window_right >= 0)
    grid = (programs,) if persistent else tile_grid(block_m, seqlen_q, q.shape[0], batch, heads_q, is_varlen)
    offsets = (cu_seqlens_q, cu_seqlens_k) if is_varlen else (q, q)
    launcher(_attn_fwd_hopper_kernel, grid)(  # q stands in for the tables and offsets a launch never reads
        q, k, v, out, lse, q if schedule is None else schedule, *offsets, *strides, *strides_lse, seqlen_q, seqlen_k,
        qk_scale, softcap_log2, window_left, window_right, batch, heads_q, num_m_blocks, section,
        GROUP=heads_q // heads_kv, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        CONSUMERS=consumers, BLOCK_N=block_n, NUM_STAGES=num_stages,
        LEFT_BOUNDED=window_left >= 0, RIGHT_BOUNDED=window_right >= 0, HAS_SOFTCAP=softcap > 0.0,
        Q_BUFFERS=q_sets, PERSISTENT=persistent, OVERLAP_TILES=overlap_tiles and q_sets == 2, Q_SMEM=q_smem,
        KV_SMEM=kv_smem, TURNS=consumers if turns else 0, IS_VARLEN=is_varlen, SEQS_PAD=seqs_pad(batch, is_varlen),
        num_warps=CONSUMER_WARPS.value,
    )
