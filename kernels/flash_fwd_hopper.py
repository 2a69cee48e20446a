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
under the next one's first product; TMA descriptors cover whole tensors.
"""

from __future__ import annotations

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                             warpgroup_mma_wait)

from .hopper_ops import mma_layout, rows_descriptor, unspecialised_jit
from .launch import ensure_allocator, launcher, sm_count
from .tile_ops import tanh, visible
from .tile_schedule import (device_schedule, program_tile, q_buffers, query_block, scheduled_tiles, section_pairs,
                            tile_coords)
from .tuning import GLUON_FORWARD_FROM_SEQLEN, gluon_forward_config


@gluon.jit
def _logits(s, n0, rows, seqlen_q, seqlen_k, window_left, window_right, qk_scale, softcap_log2, masked,
            S_LAYOUT: gl.constexpr, BLOCK_N: gl.constexpr, HAS_SOFTCAP: gl.constexpr,
            LEFT_BOUNDED: gl.constexpr, RIGHT_BOUNDED: gl.constexpr):
    """Raw q.k of one tile -> logits (softcapped ones already in log2 units), -inf where not visible."""
    if HAS_SOFTCAP:
        s = tanh(s * qk_scale) * softcap_log2
    if masked:
        cols = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_LAYOUT))
        keep = visible(gl.expand_dims(rows, 1), gl.expand_dims(cols, 0), seqlen_q, seqlen_k, window_left,
                       window_right, LEFT_BOUNDED, RIGHT_BOUNDED)
        s = gl.where(keep, s, float("-inf"))
    return s


@gluon.jit
def _softmax_step(s, row_max, row_sum, scale):
    """Fold logits s (times ``scale`` in log2 units) into the running max and sum; return the
    probabilities and the factor the output accumulated so far must be rescaled by."""
    new_max = gl.maximum(row_max, gl.max(s, 1) * scale)
    # A row with no visible key so far keeps max = -inf: shift by 0 to avoid inf - inf.
    new_max_safe = gl.where(new_max == float("-inf"), 0.0, new_max)
    p = gl.exp2(s * scale - gl.expand_dims(new_max_safe, 1))
    alpha = gl.exp2(row_max - new_max_safe)
    row_sum = row_sum * alpha + gl.sum(p, 1)
    return p, alpha, new_max, row_sum


# A program is CONSUMERS + 1 partitions (gl.warp_specialize): one TMA producer warp and CONSUMERS
# consumer warpgroups, each over 64 of the tile's 64 * CONSUMERS query rows. A consumer frees a K/V slot
# by one arrival on the slot's "empty" barrier (count CONSUMERS) as soon as its own wgmma no longer
# reads it, so the warpgroups never wait for each other and drift apart: one's matrix products fill the
# tensor cores while another runs its softmax.
CONSUMER_WARPS = gl.constexpr(4)
CONSUMER_ROWS = gl.constexpr(64)
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


@gluon.constexpr_function
def _heads_layout(layout):
    """The rank-4 (1, rows, 1, head_dim) form of a tile's shared layout, same swizzle."""
    return gl.NVMMASharedLayout(swizzle_byte_width=layout.swizzle_byte_width,
                                element_bitwidth=layout.element_bitwidth, rank=4)


@gluon.jit
def _heads_descriptor(base, batch_size, rows, heads, stride_b, stride_rows, stride_h, BLOCK: gl.constexpr,
                      HEAD_DIM: gl.constexpr, HEAD_DIM_PAD: gl.constexpr, LAYOUT: gl.constexpr):
    """TMA view of a whole (batch, rows, heads, HEAD_DIM) tensor in (1, BLOCK, 1, HEAD_DIM_PAD) tiles, zeros past
    each head's ends, built once per persistent program: a per-head one rewritten per tile races with its copies."""
    return tma.make_tensor_descriptor(base, [batch_size, rows, heads, HEAD_DIM], [stride_b, stride_rows, stride_h, 1],
                                      [1, BLOCK, 1, HEAD_DIM_PAD], _heads_layout(LAYOUT))


@gluon.jit
def _load_tile(desc, batch, row, head, bar, dest, PERSISTENT: gl.constexpr):
    """TMA copy of one head's rows [row, row + BLOCK) into ``dest``, completing on ``bar``; a per-head
    descriptor (rows_descriptor) ignores batch and head, a persistent program's (_heads_descriptor) takes them."""
    mbarrier.expect(bar, desc.block_type.nbytes)
    if PERSISTENT:
        tma.async_copy_global_to_shared(desc, [batch, row, head, 0], bar,
                                        dest.reshape([1, dest.shape[0], 1, dest.shape[1]]))
    else:
        tma.async_copy_global_to_shared(desc, [row, 0], bar, dest)


@gluon.jit
def _load_query_tile(q_desc, k_desc, v_desc, batch, head, kv_head, m0, start, num_tiles, loaded, tile_index,
                     q_smem, k_smem, v_smem, q_bars, q_free, k_ready, v_ready, k_empty, v_empty,
                     BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, CONSUMERS: gl.constexpr,
                     Q_BUFFERS: gl.constexpr, PERSISTENT: gl.constexpr):
    """The TMA loads of one query tile (the program's tile_index-th): a Q block per consumer into Q buffer
    tile_index % Q_BUFFERS, then its num_tiles K and V tiles. Ring slots and phases run on across a
    program's tiles: key tile j is the program's (loaded + j)-th, in slot (loaded + j) % NUM_STAGES."""
    first = (tile_index % Q_BUFFERS) * CONSUMERS
    for c in gl.static_range(CONSUMERS):
        if PERSISTENT:
            # The block held the queries, then the output, of tile tile_index - Q_BUFFERS: consumer c frees
            # it once that output's TMA store has read it.
            mbarrier.wait(q_free.index(first + c), ((tile_index // Q_BUFFERS) & 1) ^ 1, pred=tile_index >= Q_BUFFERS)
        _load_tile(q_desc, batch, m0 + c * CONSUMER_ROWS, head, q_bars.index(first + c), q_smem.index(first + c),
                   PERSISTENT)
    for j in range(num_tiles):
        count = loaded + j
        stage = count % NUM_STAGES
        # The slot's previous use (count - NUM_STAGES) must be released by every consumer first.
        free_phase = ((count // NUM_STAGES) & 1) ^ 1
        mbarrier.wait(k_empty.index(stage), free_phase, pred=count >= NUM_STAGES)
        _load_tile(k_desc, batch, start + j * BLOCK_N, kv_head, k_ready.index(stage), k_smem.index(stage), PERSISTENT)
        mbarrier.wait(v_empty.index(stage), free_phase, pred=count >= NUM_STAGES)
        _load_tile(v_desc, batch, start + j * BLOCK_N, kv_head, v_ready.index(stage), v_smem.index(stage), PERSISTENT)


@gluon.jit
def _load_partition(Q, K, V, stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
                    stride_vh, seqlen_q, seqlen_k, window_left, window_right, batch_size, heads, num_m_blocks, section,
                    TILE_SCHEDULE, q_smem, k_smem, v_smem, q_bars, q_free, k_ready, v_ready, k_empty, v_empty,
                    GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, HEAD_DIM_PAD: gl.constexpr, BLOCK_N: gl.constexpr,
                    NUM_STAGES: gl.constexpr, CONSUMERS: gl.constexpr, LEFT_BOUNDED: gl.constexpr,
                    RIGHT_BOUNDED: gl.constexpr, Q_BUFFERS: gl.constexpr, PERSISTENT: gl.constexpr,
                    Q_SMEM: gl.constexpr, KV_SMEM: gl.constexpr):
    BLOCK_M: gl.constexpr = CONSUMERS * CONSUMER_ROWS
    if PERSISTENT:
        q_desc = _heads_descriptor(Q, batch_size, seqlen_q, heads, stride_qb, stride_qs, stride_qh, CONSUMER_ROWS,
                                   HEAD_DIM, HEAD_DIM_PAD, Q_SMEM)
        k_desc = _heads_descriptor(K, batch_size, seqlen_k, heads // GROUP, stride_kb, stride_ks, stride_kh, BLOCK_N,
                                   HEAD_DIM, HEAD_DIM_PAD, KV_SMEM)
        v_desc = _heads_descriptor(V, batch_size, seqlen_k, heads // GROUP, stride_vb, stride_vs, stride_vh, BLOCK_N,
                                   HEAD_DIM, HEAD_DIM_PAD, KV_SMEM)
        loaded = 0
        first, last = scheduled_tiles(TILE_SCHEDULE)
        for tile_index in range(last - first):
            tile = gl.load(TILE_SCHEDULE + first + tile_index)
            batch, head, pid_m = tile_coords(tile, num_m_blocks, heads, batch_size * heads, section, RIGHT_BOUNDED)
            m0, start, _, _, num_tiles = query_block(pid_m, seqlen_q, seqlen_k, window_left, window_right, BLOCK_M,
                                                     BLOCK_N, LEFT_BOUNDED, RIGHT_BOUNDED)
            _load_query_tile(q_desc, k_desc, v_desc, batch, head, head // GROUP, m0, start, num_tiles, loaded,
                             tile_index, q_smem, k_smem, v_smem, q_bars, q_free, k_ready, v_ready, k_empty, v_empty,
                             BLOCK_N, NUM_STAGES, CONSUMERS, Q_BUFFERS, PERSISTENT)
            loaded += num_tiles
    else:
        batch, head, pid_m = program_tile(RIGHT_BOUNDED)
        m0, start, _, _, num_tiles = query_block(pid_m, seqlen_q, seqlen_k, window_left, window_right, BLOCK_M,
                                                 BLOCK_N, LEFT_BOUNDED, RIGHT_BOUNDED)
        batch, kv_head = batch.to(gl.int64), (head // GROUP).to(gl.int64)
        q_desc = rows_descriptor(Q + batch * stride_qb + head.to(gl.int64) * stride_qh, seqlen_q, stride_qs,
                                 CONSUMER_ROWS, HEAD_DIM, HEAD_DIM_PAD, Q_SMEM)
        k_desc = rows_descriptor(K + batch * stride_kb + kv_head * stride_kh, seqlen_k, stride_ks, BLOCK_N, HEAD_DIM,
                                 HEAD_DIM_PAD, KV_SMEM)
        v_desc = rows_descriptor(V + batch * stride_vb + kv_head * stride_vh, seqlen_k, stride_vs, BLOCK_N, HEAD_DIM,
                                 HEAD_DIM_PAD, KV_SMEM)
        _load_query_tile(q_desc, k_desc, v_desc, batch, head, kv_head, m0, start, num_tiles, 0, 0, q_smem, k_smem,
                         v_smem, q_bars, q_free, k_ready, v_ready, k_empty, v_empty, BLOCK_N, NUM_STAGES, CONSUMERS,
                         Q_BUFFERS, PERSISTENT)


@gluon.jit
def _attend(q_tile, q_bar, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, lse_ptr, row0, start, un_lo, un_hi,
            num_tiles, loaded, q_phase, seqlen_q, seqlen_k, qk_scale, softcap_log2, window_left, window_right,
            pending_free, store_pending, HEAD_DIM_PAD: gl.constexpr, BLOCK_N: gl.constexpr,
            NUM_STAGES: gl.constexpr, LEFT_BOUNDED: gl.constexpr, RIGHT_BOUNDED: gl.constexpr,
            HAS_SOFTCAP: gl.constexpr, DEFER_STORE: gl.constexpr):
    """One consumer's 64 query rows from row0, its Q block q_tile (ready at q_bar's phase q_phase), over
    the query tile's num_tiles key tiles (ring slots as in _load_query_tile): stores the rows' lse at
    ``lse_ptr`` and returns the normalised output tile. DEFER_STORE: the previous tile's output store drains under
    this tile's first product, then (where store_pending) its Q block's barrier pending_free is released."""
    S_LAYOUT: gl.constexpr = mma_layout(BLOCK_N, CONSUMER_WARPS)
    O_LAYOUT: gl.constexpr = mma_layout(HEAD_DIM_PAD, CONSUMER_WARPS)
    P_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_LAYOUT, k_width=2)
    ROW_S: gl.constexpr = gl.SliceLayout(1, S_LAYOUT)
    ROW_O: gl.constexpr = gl.SliceLayout(1, O_LAYOUT)
    dtype: gl.constexpr = q_tile.dtype
    rows = row0 + gl.arange(0, CONSUMER_ROWS, layout=ROW_S)
    scale = qk_scale
    if HAS_SOFTCAP:
        scale = 1.0
    row_max = gl.full([CONSUMER_ROWS], float("-inf"), gl.float32, ROW_S)
    row_sum = gl.zeros([CONSUMER_ROWS], gl.float32, ROW_S)
    acc = gl.zeros([CONSUMER_ROWS, HEAD_DIM_PAD], gl.float32, O_LAYOUT)
    s_zero = gl.zeros([CONSUMER_ROWS, BLOCK_N], gl.float32, S_LAYOUT)

    mbarrier.wait(q_bar, q_phase)
    if num_tiles > 0:
        first = loaded % NUM_STAGES
        mbarrier.wait(k_ready.index(first), (loaded // NUM_STAGES) & 1)
        s = warpgroup_mma(q_tile, k_smem.index(first).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        if DEFER_STORE:
            _retire_store(pending_free, store_pending)
        s = warpgroup_mma_wait(0, deps=[s])
        mbarrier.arrive(k_empty.index(first), count=1)
        s = _logits(s, start, rows, seqlen_q, seqlen_k, window_left, window_right, qk_scale, softcap_log2,
                    (start < un_lo) | (start >= un_hi), S_LAYOUT, BLOCK_N, HAS_SOFTCAP, LEFT_BOUNDED, RIGHT_BOUNDED)
        p, alpha, row_max, row_sum = _softmax_step(s, row_max, row_sum, scale)
        p_op = gl.convert_layout(p.to(dtype), P_LAYOUT)
        for j in range(1, num_tiles):
            n0 = start + j * BLOCK_N
            count = loaded + j
            stage = count % NUM_STAGES
            prev = (count - 1) % NUM_STAGES
            mbarrier.wait(k_ready.index(stage), (count // NUM_STAGES) & 1)
            s = warpgroup_mma(q_tile, k_smem.index(stage).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            mbarrier.wait(v_ready.index(prev), ((count - 1) // NUM_STAGES) & 1)
            acc = warpgroup_mma(p_op, v_smem.index(prev), acc, is_async=True)
            s = warpgroup_mma_wait(1, deps=[s])
            mbarrier.arrive(k_empty.index(stage), count=1)
            s = _logits(s, n0, rows, seqlen_q, seqlen_k, window_left, window_right, qk_scale, softcap_log2,
                        (n0 < un_lo) | (n0 >= un_hi), S_LAYOUT, BLOCK_N, HAS_SOFTCAP, LEFT_BOUNDED, RIGHT_BOUNDED)
            p, alpha, row_max, row_sum = _softmax_step(s, row_max, row_sum, scale)
            acc, p_op = warpgroup_mma_wait(0, deps=[acc, p_op])
            mbarrier.arrive(v_empty.index(prev), count=1)
            # Rescaled here, not under S_j as in FlashAttention-3: held there (tile_ops.opaque_copy) it ran 0-2.5%
            # slower on the H200 (docs/perf-notes.md)
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, ROW_O), 1)
            p_op = gl.convert_layout(p.to(dtype), P_LAYOUT)
        last = loaded + num_tiles - 1
        mbarrier.wait(v_ready.index(last % NUM_STAGES), (last // NUM_STAGES) & 1)
        acc = warpgroup_mma(p_op, v_smem.index(last % NUM_STAGES), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=[acc])
        mbarrier.arrive(v_empty.index(last % NUM_STAGES), count=1)
    elif DEFER_STORE:
        _retire_store(pending_free, store_pending)

    empty = row_sum == 0.0
    inv = gl.convert_layout(1.0 / gl.where(empty, 1.0, row_sum), ROW_O)
    lse = gl.where(empty, float("-inf"), (row_max + gl.log2(row_sum)) * 0.6931471805599453)
    gl.store(lse_ptr + rows, lse, mask=rows < seqlen_q)
    return (acc * gl.expand_dims(inv, 1)).to(dtype)


@gluon.jit
def _retire_store(q_free, store_pending):
    """Wait until this consumer's output store has read its Q block, then (where pending) free it: q_free."""
    tma.store_wait(0)
    mbarrier.arrive(q_free, count=1, pred=store_pending)


@gluon.jit
def _store_out(o_desc, batch, row0, head, out, q_tile, PERSISTENT: gl.constexpr, WAIT: gl.constexpr):
    """Store a consumer's output tile through its Q block (the queries are spent) by one TMA store, clipped
    at the head's ends; WAIT: until the store has read the block. Descriptors as in _load_tile."""
    q_tile.store(out)
    fence_async_shared()
    if PERSISTENT:
        tma.async_copy_shared_to_global(o_desc, [batch, row0, head, 0],
                                        q_tile.reshape([1, q_tile.shape[0], 1, q_tile.shape[1]]))
    else:
        tma.async_copy_shared_to_global(o_desc, [row0, 0], q_tile)
    if WAIT:
        tma.store_wait(0)


@gluon.jit
def _consume_partition(CONSUMER: gl.constexpr, O, LSE, stride_ob, stride_os, stride_oh, stride_lse_b, stride_lse_h,
                       seqlen_q, seqlen_k, qk_scale, softcap_log2, window_left, window_right, batch_size, heads,
                       num_m_blocks, section, TILE_SCHEDULE, q_smem, k_smem, v_smem, q_bars, q_free, k_ready,
                       v_ready, k_empty, v_empty, HEAD_DIM: gl.constexpr, HEAD_DIM_PAD: gl.constexpr,
                       BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, CONSUMERS: gl.constexpr,
                       LEFT_BOUNDED: gl.constexpr, RIGHT_BOUNDED: gl.constexpr, HAS_SOFTCAP: gl.constexpr,
                       Q_BUFFERS: gl.constexpr, PERSISTENT: gl.constexpr, Q_SMEM: gl.constexpr):
    BLOCK_M: gl.constexpr = CONSUMERS * CONSUMER_ROWS
    if PERSISTENT:
        # With one set of Q blocks the next tile's queries need the block at once: no store drains under it.
        DEFER_STORE: gl.constexpr = Q_BUFFERS > 1
        WAIT_STORE: gl.constexpr = Q_BUFFERS == 1
        o_desc = _heads_descriptor(O, batch_size, seqlen_q, heads, stride_ob, stride_os, stride_oh, CONSUMER_ROWS,
                                   HEAD_DIM, HEAD_DIM_PAD, Q_SMEM)
        loaded = 0
        first, last = scheduled_tiles(TILE_SCHEDULE)
        for tile_index in range(last - first):
            tile = gl.load(TILE_SCHEDULE + first + tile_index)
            batch, head, pid_m = tile_coords(tile, num_m_blocks, heads, batch_size * heads, section, RIGHT_BOUNDED)
            m0, start, un_lo, un_hi, num_tiles = query_block(pid_m, seqlen_q, seqlen_k, window_left, window_right,
                                                             BLOCK_M, BLOCK_N, LEFT_BOUNDED, RIGHT_BOUNDED)
            row0 = m0 + CONSUMER * CONSUMER_ROWS
            slot = (tile_index % Q_BUFFERS) * CONSUMERS + CONSUMER
            previous = ((tile_index + Q_BUFFERS - 1) % Q_BUFFERS) * CONSUMERS + CONSUMER
            out = _attend(q_smem.index(slot), q_bars.index(slot), k_smem, v_smem, k_ready, v_ready, k_empty, v_empty,
                          LSE + batch.to(gl.int64) * stride_lse_b + head.to(gl.int64) * stride_lse_h, row0, start,
                          un_lo, un_hi, num_tiles, loaded, (tile_index // Q_BUFFERS) & 1, seqlen_q, seqlen_k,
                          qk_scale, softcap_log2, window_left, window_right, q_free.index(previous), tile_index > 0,
                          HEAD_DIM_PAD, BLOCK_N, NUM_STAGES, LEFT_BOUNDED, RIGHT_BOUNDED, HAS_SOFTCAP, DEFER_STORE)
            _store_out(o_desc, batch, row0, head, out, q_smem.index(slot), PERSISTENT, WAIT_STORE)
            if WAIT_STORE:
                mbarrier.arrive(q_free.index(slot), count=1)  # the producer may load this buffer's next Q block
            loaded += num_tiles
        tma.store_wait(0)  # the last output store reads shared memory, which lives as long as the program
    else:
        batch, head, pid_m = program_tile(RIGHT_BOUNDED)
        m0, start, un_lo, un_hi, num_tiles = query_block(pid_m, seqlen_q, seqlen_k, window_left, window_right,
                                                         BLOCK_M, BLOCK_N, LEFT_BOUNDED, RIGHT_BOUNDED)
        batch, head = batch.to(gl.int64), head.to(gl.int64)
        row0 = m0 + CONSUMER * CONSUMER_ROWS
        out = _attend(q_smem.index(CONSUMER), q_bars.index(CONSUMER), k_smem, v_smem, k_ready, v_ready, k_empty,
                      v_empty, LSE + batch * stride_lse_b + head * stride_lse_h, row0, start, un_lo, un_hi, num_tiles,
                      0, 0, seqlen_q, seqlen_k, qk_scale, softcap_log2, window_left, window_right,
                      q_bars.index(CONSUMER), False, HEAD_DIM_PAD, BLOCK_N, NUM_STAGES, LEFT_BOUNDED, RIGHT_BOUNDED,
                      HAS_SOFTCAP, False)
        o_desc = rows_descriptor(O + batch * stride_ob + head * stride_oh, seqlen_q, stride_os, CONSUMER_ROWS,
                                 HEAD_DIM, HEAD_DIM_PAD, Q_SMEM)
        _store_out(o_desc, batch, row0, head, out, q_smem.index(CONSUMER), PERSISTENT, True)


@unspecialised_jit
def _attn_fwd_hopper_kernel(
    Q, K, V, O, LSE, TILE_SCHEDULE,
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
    Q_BUFFERS: gl.constexpr, PERSISTENT: gl.constexpr, Q_SMEM: gl.constexpr, KV_SMEM: gl.constexpr,
):
    """One query tile per program on a (query blocks, heads, batch) grid or, PERSISTENT, a 1-D grid whose
    programs each walk their slice of TILE_SCHEDULE (tile_schedule.schedule_table), with Q_BUFFERS sets of Q
    blocks (2: the next tile's queries load while this tile runs)."""
    dtype: gl.constexpr = Q.dtype.element_ty
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
        [(_load_partition, (Q, K, V, stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb,
                            stride_vs, stride_vh, seqlen_q, seqlen_k, window_left, window_right, batch_size, heads,
                            num_m_blocks, section, TILE_SCHEDULE, q_smem, k_smem, v_smem, q_bars, q_free, k_ready,
                            v_ready, k_empty, v_empty, GROUP, HEAD_DIM, HEAD_DIM_PAD, BLOCK_N, NUM_STAGES, CONSUMERS,
                            LEFT_BOUNDED, RIGHT_BOUNDED, Q_BUFFERS, PERSISTENT, Q_SMEM, KV_SMEM))
         if c == CONSUMERS else
         (_consume_partition, (c, O, LSE, stride_ob, stride_os, stride_oh, stride_lse_b, stride_lse_h, seqlen_q,
                               seqlen_k, qk_scale, softcap_log2, window_left, window_right, batch_size, heads,
                               num_m_blocks, section, TILE_SCHEDULE, q_smem, k_smem, v_smem, q_bars, q_free,
                               k_ready, v_ready, k_empty, v_empty, HEAD_DIM, HEAD_DIM_PAD, BLOCK_N, NUM_STAGES,
                               CONSUMERS, LEFT_BOUNDED, RIGHT_BOUNDED, HAS_SOFTCAP, Q_BUFFERS, PERSISTENT, Q_SMEM))
         for c in (0, 1, 2, 3)[:CONSUMERS + 1]],
        _partition_warps(CONSUMERS), _partition_registers(CONSUMERS))


def supports(q, cu_seqlens_q, head_dim_pad, has_alibi, has_dropout):
    """Whether this kernel takes these inputs (the caller has chosen the Gluon path for the device):
    dense, 16-bit, a padded head_dim and query length where it is the faster forward, no ALiBi and no
    dropout (the tl kernel has them)."""
    return (cu_seqlens_q is None and q.dtype in (torch.float16, torch.bfloat16)
            and q.shape[1] >= GLUON_FORWARD_FROM_SEQLEN.get(head_dim_pad, float("inf")) and not has_alibi and not has_dropout)


@functools.cache  # built once per config, not on every launch
def shared_layouts(block_n, head_dim_pad, dtype):
    """NVMMA (swizzled) shared-memory layouts of a consumer's Q/O tile and of a K/V tile."""
    gl_dtype = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    return (gl.NVMMASharedLayout.get_default_for([CONSUMER_ROWS.value, head_dim_pad], gl_dtype),
            gl.NVMMASharedLayout.get_default_for([block_n, head_dim_pad], gl_dtype))


def launch_forward(q, k, v, out, lse, qk_scale, softcap_log2, window_left, window_right, softcap, head_dim_pad,
                   strides, strides_lse, block_n=None, num_stages=None, consumers=None, persistent=None):
    """Launch the kernel on dense (batch, seqlen, heads, head_dim) inputs the caller has validated;
    block_n, num_stages, consumers (2 or 3 warpgroups of 64 rows) and persistent (one program per SM, each
    walking its share of tile_schedule's order) override gluon_forward_config's choice."""
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
    grid = (programs,) if persistent else (num_m_blocks, heads_q, batch)
    launcher(_attn_fwd_hopper_kernel, grid)(  # q stands in for the table a one-tile launch never reads
        q, k, v, out, lse, q if schedule is None else schedule, *strides, *strides_lse, seqlen_q, seqlen_k,
        qk_scale, softcap_log2, window_left, window_right, batch, heads_q, num_m_blocks, section,
        GROUP=heads_q // heads_kv, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        CONSUMERS=consumers, BLOCK_N=block_n, NUM_STAGES=num_stages,
        LEFT_BOUNDED=window_left >= 0, RIGHT_BOUNDED=window_right >= 0, HAS_SOFTCAP=softcap > 0.0,
        Q_BUFFERS=q_buffers(2 * num_stages * block_n, block_m, head_dim_pad, q.element_size()) if persistent else 1,
        PERSISTENT=persistent, Q_SMEM=q_smem, KV_SMEM=kv_smem, num_warps=CONSUMER_WARPS.value,
    )
