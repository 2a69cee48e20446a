"""Tile-level helpers shared by the forward and backward kernels."""

import triton
import triton.language as tl

from .settings import INTERPRETED

ROUND_BF16_ON_BITS = tl.constexpr(INTERPRETED)


@triton.jit
def mma(a, b, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """a @ b with fp32 accumulation."""
    if UPCAST_DOT:
        # Triton 3.6's interpreter multiplies bf16 bit patterns as integers; bf16 -> fp32 is exact,
        # and the tensor cores multiply bf16 exactly into fp32 too, so the numbers match the GPU's.
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=DOT_PRECISION)


@triton.jit
def narrow(x, DTYPE: tl.constexpr):
    """fp32 ``x`` in DTYPE, rounded to nearest even as the GPU's conversion does. Triton 3.6's
    interpreter truncates fp32 -> bf16 instead (up to one ulp of error, not half; with or without
    fp_downcast_rounding), so there the rounding is done on the bits first."""
    if DTYPE == tl.bfloat16 and ROUND_BF16_ON_BITS:
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)).to(tl.float32, bitcast=True)
        # Zeros and subnormals stay as they are: the interpreter's conversion mangles subnormals.
        x = tl.where(tl.abs(x) < 1.1754943508222875e-38, x, rounded)
    return x.to(DTYPE)


@triton.jit
def tanh(x):
    # tanh(x) = 1 - 2 / (exp(2x) + 1): exp2 only, no libdevice, runs in the interpreter too.
    return 1.0 - 2.0 / (tl.exp2(x * 2.8853900817779268) + 1.0)


@triton.jit
def opaque_copy(x):
    """``x`` through a side-effecting register move (Hopper kernels only: the interpreter runs no inline asm). Each
    element gets a register of its own, and the compiler cannot hoist the value's uses above the instructions
    issued before this one: a fill or a rescale placed after an asynchronous wgmma's issue stays there."""
    return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=False, pack=1)


@triton.jit
def key_range(m0, seqlen_q, seqlen_k, window_left, window_right,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              LEFT_BOUNDED: tl.constexpr, RIGHT_BOUNDED: tl.constexpr):
    """Key tiles for query rows [m0, m0 + BLOCK_M): start, unmasked start, unmasked end, end.

    Tiles in [start, unmasked start) and [unmasked end, end) need the mask; the middle does not.
    """
    diag = seqlen_k - seqlen_q
    last = tl.minimum(m0 + BLOCK_M, seqlen_q) - 1
    lo = 0
    hi = seqlen_k
    full_lo = 0
    full_hi = seqlen_k
    if RIGHT_BOUNDED:
        hi = tl.maximum(tl.minimum(hi, last + diag + window_right + 1), 0)
        full_hi = tl.minimum(full_hi, m0 + diag + window_right + 1)
    if LEFT_BOUNDED:
        lo = tl.minimum(tl.maximum(lo, m0 + diag - window_left), seqlen_k)
        full_lo = tl.maximum(full_lo, last + diag - window_left)
    start = (lo // BLOCK_N) * BLOCK_N
    end = tl.cdiv(hi, BLOCK_N) * BLOCK_N
    un_lo = tl.maximum(tl.cdiv(full_lo, BLOCK_N) * BLOCK_N, start)
    un_hi = tl.minimum((full_hi // BLOCK_N) * BLOCK_N, (hi // BLOCK_N) * BLOCK_N)
    if un_hi <= un_lo:
        un_lo = end
        un_hi = end
    return start, un_lo, un_hi, end


@triton.jit
def query_range(n0, seqlen_q, seqlen_k, window_left, window_right,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                LEFT_BOUNDED: tl.constexpr, RIGHT_BOUNDED: tl.constexpr):
    """Query tiles that see keys [n0, n0 + BLOCK_N): start, unmasked start, unmasked end, end.

    The transpose of key_range, for the dK/dV pass that walks queries for a fixed key tile. A key
    tile that runs past seqlen_k has no unmasked query tile: its padded keys (zero rows) have logit 0,
    so unmasked they would get p = exp2(-lse), which overflows dS where lse is very negative, and
    inf * 0 (the zero keys) puts NaN into dQ.
    """
    diag = seqlen_k - seqlen_q
    last = tl.minimum(n0 + BLOCK_N, seqlen_k) - 1
    lo = 0
    hi = seqlen_q
    full_lo = 0
    full_hi = seqlen_q
    if RIGHT_BOUNDED:  # key j visible to row i needs i >= j - diag - right
        lo = tl.minimum(tl.maximum(lo, n0 - diag - window_right), seqlen_q)
        full_lo = tl.maximum(full_lo, last - diag - window_right)
    if LEFT_BOUNDED:  # ... and i <= j - diag + left
        hi = tl.maximum(tl.minimum(hi, last - diag + window_left + 1), 0)
        full_hi = tl.minimum(full_hi, n0 - diag + window_left + 1)
    start = (lo // BLOCK_M) * BLOCK_M
    end = tl.cdiv(hi, BLOCK_M) * BLOCK_M
    un_lo = tl.maximum(tl.cdiv(full_lo, BLOCK_M) * BLOCK_M, start)
    un_hi = tl.minimum((full_hi // BLOCK_M) * BLOCK_M, (hi // BLOCK_M) * BLOCK_M)
    if (un_hi <= un_lo) | (n0 + BLOCK_N > seqlen_k):
        un_lo = end
        un_hi = end
    return start, un_lo, un_hi, end


@triton.jit
def last_key_block(m0, seqlen_q, seqlen_k, window_right, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   RIGHT_BOUNDED: tl.constexpr):
    """Index of the last BLOCK_N-key block whose query_range holds the query tile at row m0 (the blocks
    holding a tile are consecutive up to this one: query_range's start and end never decrease from block
    to block). Right-bounded, a block holds the tile while its first key, less the bound, is before the
    tile's end (shifted by seqlen_k - seqlen_q)."""
    last = tl.cdiv(seqlen_k, BLOCK_N) - 1
    if RIGHT_BOUNDED:
        last = tl.minimum(last, (m0 + BLOCK_M - 1 + seqlen_k - seqlen_q + window_right) // BLOCK_N)
    return last


@triton.jit
def visible(rows, cols, seqlen_q, seqlen_k, window_left, window_right,
            LEFT_BOUNDED: tl.constexpr, RIGHT_BOUNDED: tl.constexpr):
    """Bool tile: query ``rows`` sees key ``cols`` (broadcast 2-D index tensors; either layout)."""
    shifted = rows + (seqlen_k - seqlen_q)
    mask = (cols < seqlen_k) & (rows < seqlen_q)
    if RIGHT_BOUNDED:
        mask = mask & (cols <= shifted + window_right)
    if LEFT_BOUNDED:
        mask = mask & (cols >= shifted - window_left)
    return mask


@triton.jit
def program_tile(num_seqs, CU_SEQLENS, BLOCK: tl.constexpr, SEQS_PAD: tl.constexpr,
                 LAST_FIRST: tl.constexpr, IS_VARLEN: tl.constexpr):
    """(sequence, tile within it, head) of this program.

    Dense: grid (tiles per sequence, heads, batch). Varlen: grid (tiles of all sequences + num_seqs,
    heads, 1), the tiles of every sequence packed one after another (cdiv(total, BLOCK) + num_seqs
    bounds their count without reading cu_seqlens on the host), so no program lands past its
    sequence's end as with one grid row per sequence at the longest length; the few programs past
    the last tile get sequence = num_seqs. LAST_FIRST launches tiles in reverse order (a causal
    query tile's work grows with its index: the longest programs start first).
    """
    t = tl.program_id(0)
    if LAST_FIRST:
        t = tl.num_programs(0) - 1 - t
    if IS_VARLEN:
        head = tl.program_id(1)
        index = tl.arange(0, SEQS_PAD)
        starts = tl.load(CU_SEQLENS + index, mask=index < num_seqs, other=0)
        ends = tl.load(CU_SEQLENS + index + 1, mask=index < num_seqs, other=0)
        tiles = (ends - starts + BLOCK - 1) // BLOCK
        seq = tl.sum((tl.cumsum(tiles, 0) <= t).to(tl.int32), 0)
        tile = t - tl.sum(tl.where(index < seq, tiles, 0), 0)
    else:
        seq = tl.program_id(2)
        head = tl.program_id(1)
        tile = t
    # 64-bit: base offsets such as seq * stride_batch pass 2**31 in tensors over 2**31 elements.
    return seq.to(tl.int64), tile, head.to(tl.int64)


@triton.jit
def sequence_bounds(batch, seqlen_q, seqlen_k, CU_SEQLENS_Q, CU_SEQLENS_K, IS_VARLEN: tl.constexpr):
    """(first q row, first k row, seqlen_q, seqlen_k) of sequence ``batch``.

    Varlen inputs are packed rows located by cu_seqlens (their batch strides are 0); dense inputs
    start at row 0 of their batch (located by the batch strides).
    """
    if IS_VARLEN:
        q_first = tl.load(CU_SEQLENS_Q + batch)
        k_first = tl.load(CU_SEQLENS_K + batch)
        # Lengths stay 32-bit (they enter the per-element masks); starts, which scale strides, go 64-bit.
        seqlen_q = tl.load(CU_SEQLENS_Q + batch + 1) - q_first
        seqlen_k = tl.load(CU_SEQLENS_K + batch + 1) - k_first
        q_start = q_first.to(tl.int64)
        k_start = k_first.to(tl.int64)
    else:
        q_start = 0
        k_start = 0
    return q_start, k_start, seqlen_q, seqlen_k


@triton.jit
def rows_descriptor(BASE, rows, stride_rows, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr,
                    HEAD_DIM_PAD: tl.constexpr):
    """TMA view of one head: (rows, HEAD_DIM) from BASE, loaded in (BLOCK, HEAD_DIM_PAD) tiles that
    read zeros past either end. max(rows, 1): an empty sequence issues no load, but a descriptor
    wants a non-zero shape."""
    return tl.make_tensor_descriptor(BASE, shape=[tl.maximum(rows, 1), HEAD_DIM], strides=[stride_rows, 1],
                                     block_shape=[BLOCK, HEAD_DIM_PAD])


@triton.jit
def paged_rows(BASE, PAGES, n0, rows, page_size, stride_page, stride_row, BLOCK: tl.constexpr,
               HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr):
    """Rows n0 .. n0 + BLOCK of one head of a page pool (BASE at the head, PAGES the sequence's block-table row),
    as a (BLOCK, HEAD_DIM_PAD) tile with zeros past ``rows`` and HEAD_DIM, like rows_descriptor's loads. A row
    at a time: a tile may span pages (any page size that holds whole 16-key tiles)."""
    keys = n0 + tl.arange(0, BLOCK)
    inside = keys < rows
    page = tl.load(PAGES + keys // page_size, mask=inside, other=0).to(tl.int64)
    offsets = page * stride_page + (keys % page_size).to(tl.int64) * stride_row
    dims = tl.arange(0, HEAD_DIM_PAD)
    return tl.load(BASE + offsets[:, None] + dims[None, :], mask=inside[:, None] & (dims < HEAD_DIM)[None, :],
                   other=0.0)


@triton.jit
def attention_logits(q, k, rows, cols, qk_scale, softcap_log2, seqlen_q, seqlen_k, window_left, window_right,
                     HAS_SOFTCAP: tl.constexpr, MASKED: tl.constexpr, LEFT_BOUNDED: tl.constexpr,
                     RIGHT_BOUNDED: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """Logits of query tile q (M, D) against key tile k (N, D), -inf where masked: the raw q.k (times
    qk_scale they are in log2 units: online_softmax_step applies it, ``logit_scale``), or with softcap
    the capped logits already in log2 units."""
    s = mma(q, tl.trans(k), DOT_PRECISION, UPCAST_DOT)
    if HAS_SOFTCAP:
        s = tanh(s * qk_scale) * softcap_log2
    if MASKED:
        keep = visible(rows[:, None], cols[None, :], seqlen_q, seqlen_k, window_left, window_right,
                       LEFT_BOUNDED, RIGHT_BOUNDED)
        s = tl.where(keep, s, float("-inf"))
    return s


@triton.jit
def load_alibi_slope_log2(ALIBI_SLOPES, batch, head, stride_alibi_b, HAS_ALIBI: tl.constexpr):
    """The (batch, head)'s ALiBi slope in log2 units (the kernels' scores are), 0 without ALiBi."""
    slope = 0.0
    if HAS_ALIBI:
        slope = tl.load(ALIBI_SLOPES + batch * stride_alibi_b + head) * 1.4426950408889634
    return slope


@triton.jit
def load_dropout_key(DROPOUT_SEED, HAS_DROPOUT: tl.constexpr):
    """The call's Philox key, read on the device (no host sync), 0 without dropout."""
    seed = 0
    if HAS_DROPOUT:
        seed = tl.load(DROPOUT_SEED)
    return seed


@triton.jit
def alibi_bias(rows, cols, slope_log2, seqlen_q, seqlen_k):
    """ALiBi's bias in log2 units, -slope * |i + seqlen_k - seqlen_q - j| (flash-attn's bottom-right
    alignment), for query ``rows`` and key ``cols`` (broadcast 2-D index tensors; either layout)."""
    return (tl.abs(rows + (seqlen_k - seqlen_q) - cols).to(tl.float32)) * -slope_log2


@triton.jit
def dropout_keep(rows, cols, seed, head, batch, drop_threshold):
    """Bool tile: whether element (row, col) of (batch, head) survives dropout (broadcast 2-D index
    tensors; either layout). One Philox4x32-10 draw per element under the call's 64-bit seed, with the
    element's coordinates (col, row, head, batch) as the counter: any tiling, in the forward or the
    backward, regenerates the same mask, and reference.dropout_keep_mask computes it in PyTorch. An
    element is kept iff the draw's top 31 bits reach ``drop_threshold`` = dropout_p * 2**31."""
    rows, cols = tl.broadcast(rows, cols)
    zeros = cols * 0
    draw, _, _, _ = tl.philox(seed, cols, rows, zeros + head.to(tl.int32), zeros + batch.to(tl.int32))
    return (draw >> 1).to(tl.int32) >= drop_threshold


@triton.jit
def logit_scale(qk_scale, HAS_SOFTCAP: tl.constexpr):
    """What attention_logits' logits are multiplied by to be in log2 units."""
    if HAS_SOFTCAP:
        return 1.0
    return qk_scale


@triton.jit
def online_softmax_step(acc, row_max, row_sum, s, scale, v, MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr,
                        UPCAST_DOT: tl.constexpr, keep=None):
    """Fold one tile of logits s (M, N), in log2 units once multiplied by ``scale`` (> 0), and values v
    (N, D) into the running (acc, max, sum). The scale is applied to the tile's row maxima and inside
    exp2's argument (one fused multiply-add per logit), never to the tile itself: a scaled copy would
    cost a multiply per logit, since the maximum and the exponent both read it. ``keep`` (bool (M, N),
    dropout's mask) drops probabilities from acc only: the sum normalises by all of them, and the
    caller applies 1 / (1 - dropout_p)."""
    new_max = tl.maximum(row_max, tl.max(s, 1) * scale)
    if MASKED:
        # A row with no visible key so far keeps max = -inf: shift by 0 to avoid inf - inf.
        new_max_safe = tl.where(new_max == float("-inf"), 0.0, new_max)
    else:
        new_max_safe = new_max
    p = tl.exp2(s * scale - new_max_safe[:, None])
    alpha = tl.exp2(row_max - new_max_safe)
    row_sum = row_sum * alpha + tl.sum(p, 1)
    if keep is not None:
        p = tl.where(keep, p, 0.0)
    acc = acc * alpha[:, None] + mma(narrow(p, v.dtype), v, DOT_PRECISION, UPCAST_DOT)
    return acc, new_max, row_sum
