"""One consumer warpgroup's share of a query tile in the Hopper forward (flash_fwd_hopper.py): its 64 query rows
against the tile's key tiles, read from the producer's ring (flash_fwd_hopper_load.py). S_j = Q K_j^T and
O += P_{j-1} V_{j-1} are issued back to back as asynchronous wgmma; the consumer waits for S_j alone and runs the
softmax of tile j while P_{j-1} V_{j-1} is still on the tensor cores (P in registers, the A operand of P V), then
waits for O and rescales it. The pieces are separate so that a persistent consumer can overlap one tile's end
with the next tile's start."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from .hopper_ops import CONSUMER_ROWS, mma_layout, pass_turn, wait_turn
from .tile_ops import tanh, visible

CONSUMER_WARPS = gl.constexpr(4)  # a warpgroup
@gluon.jit
def logits(s, n0, rows, seqlen_q, seqlen_k, window_left, window_right, qk_scale, softcap_log2, masked,
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
def softmax_step(s, row_max, row_sum, scale):
    """Fold logits s (times ``scale`` in log2 units) into the running max and sum; return the
    probabilities and the factor the output accumulated so far must be rescaled by."""
    new_max = gl.maximum(row_max, gl.max(s, 1) * scale)
    # A row with no visible key so far keeps max = -inf: shift by 0 to avoid inf - inf.
    new_max_safe = gl.where(new_max == float("-inf"), 0.0, new_max)
    p = gl.exp2(s * scale - gl.expand_dims(new_max_safe, 1))
    alpha = gl.exp2(row_max - new_max_safe)
    row_sum = row_sum * alpha + gl.sum(p, 1)
    return p, alpha, new_max, row_sum


@gluon.jit
def softmax_scale(qk_scale, HAS_SOFTCAP: gl.constexpr):
    """The factor _softmax_step takes: softcapped logits are already in log2 units."""
    scale = qk_scale
    if HAS_SOFTCAP:
        scale = 1.0
    return scale


@gluon.jit
def issue_scores(q_tile, k_smem, k_ready, count, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr):
    """Issue S = Q K^T (asynchronous) on the program's count-th key tile once its slot has arrived."""
    s_zero = gl.zeros([CONSUMER_ROWS, BLOCK_N], gl.float32, mma_layout(BLOCK_N, CONSUMER_WARPS))
    stage = count % NUM_STAGES
    mbarrier.wait(k_ready.index(stage), (count // NUM_STAGES) & 1)
    return warpgroup_mma(q_tile, k_smem.index(stage).permute((1, 0)), s_zero, use_acc=False, is_async=True)


@gluon.jit
def finish_values(p_op, v_smem, v_ready, v_empty, count, acc, NUM_STAGES: gl.constexpr, CONSUMER: gl.constexpr,
                  TURNS: gl.constexpr):
    """O += P V on the program's count-th value tile, waited for, its slot released."""
    stage = count % NUM_STAGES
    wait_turn(CONSUMER, TURNS)
    mbarrier.wait(v_ready.index(stage), (count // NUM_STAGES) & 1)
    acc = warpgroup_mma(p_op, v_smem.index(stage), acc, is_async=True)
    pass_turn(CONSUMER, TURNS)
    acc = warpgroup_mma_wait(0, deps=[acc])
    mbarrier.arrive(v_empty.index(stage), count=1)
    return acc


@gluon.jit
def opening_softmax(s, rows, start, un_lo, un_hi, seqlen_q, seqlen_k, qk_scale, softcap_log2, window_left,
                    window_right, dtype: gl.constexpr, HEAD_DIM_PAD: gl.constexpr, BLOCK_N: gl.constexpr,
                    LEFT_BOUNDED: gl.constexpr, RIGHT_BOUNDED: gl.constexpr, HAS_SOFTCAP: gl.constexpr):
    """A query tile's first S (computed) -> P as the A operand of P V, the running max and sum."""
    S_LAYOUT: gl.constexpr = mma_layout(BLOCK_N, CONSUMER_WARPS)
    P_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout(HEAD_DIM_PAD, CONSUMER_WARPS),
                                                 k_width=2)
    s = logits(s, start, rows, seqlen_q, seqlen_k, window_left, window_right, qk_scale, softcap_log2,
               (start < un_lo) | (start >= un_hi), S_LAYOUT, BLOCK_N, HAS_SOFTCAP, LEFT_BOUNDED, RIGHT_BOUNDED)
    ROW_S: gl.constexpr = gl.SliceLayout(1, S_LAYOUT)
    p, _, row_max, row_sum = softmax_step(s, gl.full([CONSUMER_ROWS], float("-inf"), gl.float32, ROW_S),
                                          gl.zeros([CONSUMER_ROWS], gl.float32, ROW_S),
                                          softmax_scale(qk_scale, HAS_SOFTCAP))
    return gl.convert_layout(p.to(dtype), P_LAYOUT), row_max, row_sum


@gluon.jit
def key_loop(q_tile, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, acc, p_op, row_max, row_sum, rows, start,
             un_lo, un_hi, num_tiles, loaded, seqlen_q, seqlen_k, qk_scale, softcap_log2, window_left, window_right,
             HEAD_DIM_PAD: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
             LEFT_BOUNDED: gl.constexpr, RIGHT_BOUNDED: gl.constexpr, HAS_SOFTCAP: gl.constexpr,
             CONSUMER: gl.constexpr, TURNS: gl.constexpr):
    """Key tiles 1 .. num_tiles - 1 of a query tile whose tile 0 is in p_op, row_max, row_sum (ring slots as in
    flash_fwd_hopper_load): S_j and P_{j-1} V_{j-1} issued back to back (in CONSUMER's turn where TURNS), the
    softmax of tile j under P V. Returns O through tile num_tiles - 2 and the last tile's P, max and sum."""
    S_LAYOUT: gl.constexpr = mma_layout(BLOCK_N, CONSUMER_WARPS)
    O_LAYOUT: gl.constexpr = mma_layout(HEAD_DIM_PAD, CONSUMER_WARPS)
    P_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_LAYOUT, k_width=2)
    scale = softmax_scale(qk_scale, HAS_SOFTCAP)
    for j in range(1, num_tiles):
        n0 = start + j * BLOCK_N
        count = loaded + j
        prev = (count - 1) % NUM_STAGES
        wait_turn(CONSUMER, TURNS)
        s = issue_scores(q_tile, k_smem, k_ready, count, BLOCK_N, NUM_STAGES)
        mbarrier.wait(v_ready.index(prev), ((count - 1) // NUM_STAGES) & 1)
        acc = warpgroup_mma(p_op, v_smem.index(prev), acc, is_async=True)
        pass_turn(CONSUMER, TURNS)
        s = warpgroup_mma_wait(1, deps=[s])
        mbarrier.arrive(k_empty.index(count % NUM_STAGES), count=1)
        s = logits(s, n0, rows, seqlen_q, seqlen_k, window_left, window_right, qk_scale, softcap_log2,
                   (n0 < un_lo) | (n0 >= un_hi), S_LAYOUT, BLOCK_N, HAS_SOFTCAP, LEFT_BOUNDED, RIGHT_BOUNDED)
        p, alpha, row_max, row_sum = softmax_step(s, row_max, row_sum, scale)
        acc, p_op = warpgroup_mma_wait(0, deps=[acc, p_op])
        mbarrier.arrive(v_empty.index(prev), count=1)
        # Rescaled here, not under S_j as in FlashAttention-3: held there (tile_ops.opaque_copy) it ran 0-2.5%
        # slower on the H200 (docs/perf-notes.md)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, O_LAYOUT)), 1)
        p_op = gl.convert_layout(p.to(q_tile.dtype), P_LAYOUT)
    return acc, p_op, row_max, row_sum


@gluon.jit
def normalised(acc, row_max, row_sum, lse_ptr, rows, seqlen_q, ACC_LAYOUT: gl.constexpr):
    """Stores the rows' lse (natural log; -inf where no key was visible) and returns O / row_sum, 16-bit."""
    empty = row_sum == 0.0
    inv = gl.convert_layout(1.0 / gl.where(empty, 1.0, row_sum), gl.SliceLayout(1, ACC_LAYOUT))
    lse = gl.where(empty, float("-inf"), (row_max + gl.log2(row_sum)) * 0.6931471805599453)
    gl.store(lse_ptr + rows, lse, mask=rows < seqlen_q)
    return acc * gl.expand_dims(inv, 1)


@gluon.jit
def attend(q_tile, q_bar, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, lse_ptr, row0, start, un_lo, un_hi,
           num_tiles, loaded, q_phase, seqlen_q, seqlen_k, qk_scale, softcap_log2, window_left, window_right,
           pending_free, store_pending, HEAD_DIM_PAD: gl.constexpr, BLOCK_N: gl.constexpr,
           NUM_STAGES: gl.constexpr, LEFT_BOUNDED: gl.constexpr, RIGHT_BOUNDED: gl.constexpr,
           HAS_SOFTCAP: gl.constexpr, DEFER_STORE: gl.constexpr, CONSUMER: gl.constexpr, TURNS: gl.constexpr):
    """One consumer's 64 query rows from row0, its Q block q_tile (ready at q_bar's phase q_phase), over
    the query tile's num_tiles key tiles, the program's loaded-th onwards: stores the rows' lse at ``lse_ptr``
    and returns the normalised output tile. DEFER_STORE: the previous tile's output store drains under this
    tile's first product, then (where store_pending) its Q block's barrier pending_free is released."""
    O_LAYOUT: gl.constexpr = mma_layout(HEAD_DIM_PAD, CONSUMER_WARPS)
    dtype: gl.constexpr = q_tile.dtype
    ROW_S: gl.constexpr = gl.SliceLayout(1, mma_layout(BLOCK_N, CONSUMER_WARPS))
    row_max = gl.full([CONSUMER_ROWS], float("-inf"), gl.float32, ROW_S)
    row_sum = gl.zeros([CONSUMER_ROWS], gl.float32, ROW_S)
    rows = row0 + gl.arange(0, CONSUMER_ROWS, layout=ROW_S)
    acc = gl.zeros([CONSUMER_ROWS, HEAD_DIM_PAD], gl.float32, O_LAYOUT)
    mbarrier.wait(q_bar, q_phase)
    if num_tiles > 0:
        wait_turn(CONSUMER, TURNS)
        s = issue_scores(q_tile, k_smem, k_ready, loaded, BLOCK_N, NUM_STAGES)
        pass_turn(CONSUMER, TURNS)
        if DEFER_STORE:
            retire_store(pending_free, store_pending)
        s = warpgroup_mma_wait(0, deps=[s])
        mbarrier.arrive(k_empty.index(loaded % NUM_STAGES), count=1)
        p_op, row_max, row_sum = opening_softmax(s, rows, start, un_lo, un_hi, seqlen_q, seqlen_k, qk_scale,
                                                 softcap_log2, window_left, window_right, dtype, HEAD_DIM_PAD,
                                                 BLOCK_N, LEFT_BOUNDED, RIGHT_BOUNDED, HAS_SOFTCAP)
        acc, p_op, row_max, row_sum = key_loop(q_tile, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, acc, p_op,
                                               row_max, row_sum, rows, start, un_lo, un_hi, num_tiles, loaded,
                                               seqlen_q, seqlen_k, qk_scale, softcap_log2, window_left,
                                               window_right, HEAD_DIM_PAD, BLOCK_N, NUM_STAGES, LEFT_BOUNDED,
                                               RIGHT_BOUNDED, HAS_SOFTCAP, CONSUMER, TURNS)
        acc = finish_values(p_op, v_smem, v_ready, v_empty, loaded + num_tiles - 1, acc, NUM_STAGES, CONSUMER, TURNS)
    elif DEFER_STORE:
        retire_store(pending_free, store_pending)
    return normalised(acc, row_max, row_sum, lse_ptr, rows, seqlen_q, O_LAYOUT).to(dtype)


@gluon.jit
def retire_store(q_free, store_pending):
    """Wait until this consumer's output store has read its Q block, then (where pending) free it: q_free."""
    tma.store_wait(0)
    mbarrier.arrive(q_free, count=1, pred=store_pending)


@gluon.jit
def store_out(o_desc, batch, row0, head, out, q_tile, PERSISTENT: gl.constexpr, WAIT: gl.constexpr):
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
