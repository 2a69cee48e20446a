"""The producer partition of the Hopper forward (flash_fwd_hopper.py): one warp that streams each query tile's Q
blocks and its K and V tiles by TMA into shared memory, a ring of NUM_STAGES slots with a "ready" and an "empty"
mbarrier per slot and tensor. A persistent program walks its slice of tile_schedule.py's deal, as its consumers do,
and its ring's slots and phases run on across tiles. A one-tile program reads one sequence's rows through TMA views
bounded at the sequence's ends (zeros past them), dense or packed (varlen)."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

from .hopper_ops import CONSUMER_ROWS, rows_descriptor
from .tile_ops import sequence_bounds
from .tile_schedule import query_block, scheduled_tiles, tile_coords


@gluon.constexpr_function
def _heads_layout(layout):
    """The rank-4 (1, rows, 1, head_dim) form of a tile's shared layout, same swizzle."""
    return gl.NVMMASharedLayout(swizzle_byte_width=layout.swizzle_byte_width,
                                element_bitwidth=layout.element_bitwidth, rank=4)


@gluon.jit
def heads_descriptor(base, batch_size, rows, heads, stride_b, stride_rows, stride_h, BLOCK: gl.constexpr,
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
def load_partition(Q, K, V, stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
                   stride_vh, seqlen_q, seqlen_k, window_left, window_right, batch_size, heads, num_m_blocks, section,
                   TILE_SCHEDULE, CU_SEQLENS_Q, CU_SEQLENS_K, seq, pid_m, q_smem, k_smem, v_smem, q_bars, q_free,
                   k_ready, v_ready, k_empty, v_empty, GROUP: gl.constexpr, HEAD_DIM: gl.constexpr,
                   HEAD_DIM_PAD: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
                   CONSUMERS: gl.constexpr, LEFT_BOUNDED: gl.constexpr, RIGHT_BOUNDED: gl.constexpr,
                   Q_BUFFERS: gl.constexpr, PERSISTENT: gl.constexpr, IS_VARLEN: gl.constexpr,
                   Q_SMEM: gl.constexpr, KV_SMEM: gl.constexpr):
    """The producer: a persistent program's tiles in its schedule's order, or a one-tile program's (seq, pid_m:
    hopper_ops.program_sequence_tile) query tile, whose rows are located by cu_seqlens where IS_VARLEN."""
    BLOCK_M: gl.constexpr = CONSUMERS * CONSUMER_ROWS
    if PERSISTENT:
        q_desc = heads_descriptor(Q, batch_size, seqlen_q, heads, stride_qb, stride_qs, stride_qh, CONSUMER_ROWS,
                                  HEAD_DIM, HEAD_DIM_PAD, Q_SMEM)
        k_desc = heads_descriptor(K, batch_size, seqlen_k, heads // GROUP, stride_kb, stride_ks, stride_kh, BLOCK_N,
                                  HEAD_DIM, HEAD_DIM_PAD, KV_SMEM)
        v_desc = heads_descriptor(V, batch_size, seqlen_k, heads // GROUP, stride_vb, stride_vs, stride_vh, BLOCK_N,
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
    elif seq < batch_size:  # a one-tile program; varlen, past the last sequence's tiles, has nothing to load
        q_first, k_first, seqlen_q, seqlen_k = sequence_bounds(seq, seqlen_q, seqlen_k, CU_SEQLENS_Q, CU_SEQLENS_K,
                                                               IS_VARLEN)
        m0, start, _, _, num_tiles = query_block(pid_m, seqlen_q, seqlen_k, window_left, window_right, BLOCK_M,
                                                 BLOCK_N, LEFT_BOUNDED, RIGHT_BOUNDED)
        head = gl.program_id(1)
        batch, kv_head = seq.to(gl.int64), (head // GROUP).to(gl.int64)
        q_desc = rows_descriptor(Q + batch * stride_qb + q_first * stride_qs + head.to(gl.int64) * stride_qh, seqlen_q,
                                 stride_qs, CONSUMER_ROWS, HEAD_DIM, HEAD_DIM_PAD, Q_SMEM)
        # A sequence may have no key (varlen): then no tile loads, but a TMA view needs a row.
        k_rows = gl.maximum(seqlen_k, 1)
        k_desc = rows_descriptor(K + batch * stride_kb + k_first * stride_ks + kv_head * stride_kh, k_rows, stride_ks,
                                 BLOCK_N, HEAD_DIM, HEAD_DIM_PAD, KV_SMEM)
        v_desc = rows_descriptor(V + batch * stride_vb + k_first * stride_vs + kv_head * stride_vh, k_rows, stride_vs,
                                 BLOCK_N, HEAD_DIM, HEAD_DIM_PAD, KV_SMEM)
        _load_query_tile(q_desc, k_desc, v_desc, batch, head, kv_head, m0, start, num_tiles, 0, 0, q_smem, k_smem,
                         v_smem, q_bars, q_free, k_ready, v_ready, k_empty, v_empty, BLOCK_N, NUM_STAGES, CONSUMERS,
                         Q_BUFFERS, PERSISTENT)
