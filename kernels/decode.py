"""Split-KV decoding ("flash-decoding") in Triton, against contiguous or paged KV caches.

A decode step has few query tokens and a long cache, so the dense forward's grid (query tiles x
heads) would leave most SMs idle and read each kv head's cache once per query head. Here one program
owns one kv head of one sequence: every query head of its GQA group and every query token become
the rows (M) of its tiles, so K and V are read once per kv head. To fill the GPU when
batch x kv_heads is small, the cache is cut into ``num_splits`` chunks, each program writes a
partial (out, lse) in fp32, and a second small kernel merges the splits through log-sum-exp.

Row r of a program's tile is query token ``t0 + r // GROUP_PAD`` and query head
``kv_head * GROUP + r % GROUP_PAD``: whole tokens per program, so the dense kernel's causal /
window tile ranges (tile_ops.key_range) apply with tokens as rows.

Both cache layouts are read as one 2-D (rows, head_dim) tensor descriptor per kv head: cache row
``page * page_rows + offset``, where a contiguous cache is a pool with one page per sequence (page =
batch index) and a paged cache looks its page up in block_table. Key tiles never straddle a page
(BLOCK_N divides the page size).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .flash_fwd import log2_scales
from .launch import (CompiledLaunch, as_descriptor_compatible, dot_precision, ensure_allocator, new_output,
                     reused_buffers, sm_count, upcast_dot)
from .sizes import WIDE_HEAD_DIM, cdiv, next_power_of_2, pad_head_dim
from .tile_ops import attention_logits, key_range, logit_scale, narrow, online_softmax_step

LN2 = tl.constexpr(math.log(2.0))
# The interpreter has no SMs: use the H200's count so that CPU runs take the GPU's split decisions.
DEFAULT_SMS = 132
# Programs of the decode kernel resident on one SM at a time: its launch config (_launch_config) leaves
# shared memory for two. Splits fill these slots in whole waves (choose_num_splits).
RESIDENT_PER_SM = 2
# A split should stream at least this many keys, or its fixed costs (Q load, partial write, combine)
# outweigh the bandwidth it adds; once every SM has a program, splits grow to TARGET_KEYS_PER_SPLIT.
MIN_KEYS_PER_SPLIT = 512
TARGET_KEYS_PER_SPLIT = 4096
# The combine kernel holds (splits x head_dim) fp32 in registers.
MAX_SPLITS = 64
# Query rows (tokens x padded GQA group) per program: at least tl.dot's minimum M, at most a size that
# keeps the score tile in registers when a long chunk of queries attends to the cache.
MIN_ROWS, MAX_ROWS = 16, 64
# Programs per SM of the stream-K split (_decode_stream_k_kernel), 0 = split per (sequence, kv head) as
# choose_num_splits says. Off until the H200 has timed it against those splits (bench_decode.py --stream-k).
STREAM_K_PER_SM = 0
# Its programs hold every sequence's length in registers.
STREAM_K_MAX_BATCH = 256


@triton.jit
def _decode_tiles(acc, row_max, row_sum, q, k_desc, v_desc, BLOCK_TABLE, stride_bt, batch, kv_head, tokens, start,
                  end, qk_scale, softcap_log2, seqlen_q, seqlen_k, window_left, window_right, k_page_rows, v_page_rows,
                  BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, HEAD_AXIS: tl.constexpr,
                  HAS_SOFTCAP: tl.constexpr, MASKED: tl.constexpr, LEFT_BOUNDED: tl.constexpr,
                  RIGHT_BOUNDED: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr):
    for n0 in tl.range(start, end, BLOCK_N):
        if PAGE_SIZE > 0:
            page = tl.load(BLOCK_TABLE + batch * stride_bt + n0 // PAGE_SIZE)
            offset = n0 % PAGE_SIZE
        else:
            page = batch
            offset = n0
        if HEAD_AXIS:  # (rows, kv heads, head_dim) descriptors: one pair serves every kv head
            k = k_desc.load([page * k_page_rows + offset, kv_head, 0]).reshape(BLOCK_N, HEAD_DIM_PAD)
            v = v_desc.load([page * v_page_rows + offset, kv_head, 0]).reshape(BLOCK_N, HEAD_DIM_PAD)
        else:  # one kv head's (rows, head_dim)
            k = k_desc.load([page * k_page_rows + offset, 0])
            v = v_desc.load([page * v_page_rows + offset, 0])
        cols = n0 + tl.arange(0, BLOCK_N)
        s = attention_logits(q, k, tokens, cols, qk_scale, softcap_log2, seqlen_q, seqlen_k, window_left, window_right,
                             HAS_SOFTCAP, MASKED, LEFT_BOUNDED, RIGHT_BOUNDED, DOT_PRECISION, UPCAST_DOT)
        if MASKED:
            # Past the sequence's end a cache holds stale entries (NaN in a fresh torch.empty cache):
            # p = 0 there, but 0 * NaN would still poison the product, so zero those rows of V.
            v = tl.where((cols < seqlen_k)[:, None], v, 0.0)
        acc, row_max, row_sum = online_softmax_step(acc, row_max, row_sum, s, logit_scale(qk_scale, HAS_SOFTCAP), v,
                                                    MASKED, DOT_PRECISION, UPCAST_DOT)
    return acc, row_max, row_sum


@triton.jit
def _query_rows(q_base, t0, kv_head, seqlen_q, stride_qs, stride_qh, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                BLOCK_T: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr):
    """The queries of one kv head's GQA group at tokens [t0, t0 + BLOCK_T): row r is token t0 + r // GROUP_PAD
    and query head kv_head * GROUP + r % GROUP_PAD. Returns q, tokens, heads, row_ok, tile_ok."""
    r = tl.arange(0, BLOCK_T * GROUP_PAD)
    tokens = t0 + r // GROUP_PAD
    heads = kv_head * GROUP + r % GROUP_PAD
    row_ok = (tokens < seqlen_q) & (r % GROUP_PAD < GROUP)
    dims = tl.arange(0, HEAD_DIM_PAD)
    tile_ok = row_ok[:, None] & (dims[None, :] < HEAD_DIM)
    q = tl.load(q_base + tokens[:, None] * stride_qs + heads[:, None] * stride_qh + dims[None, :],
                mask=tile_ok, other=0.0)
    return q, tokens, heads, row_ok, tile_ok


@triton.jit
def _attend(q, k_desc, v_desc, BLOCK_TABLE, stride_bt, batch, kv_head, tokens, lo, hi, un_lo, un_hi,
            qk_scale, softcap_log2, seqlen_q, seqlen_k, window_left, window_right, k_page_rows, v_page_rows,
            BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, HEAD_AXIS: tl.constexpr,
            HAS_SOFTCAP: tl.constexpr, LEFT_BOUNDED: tl.constexpr, RIGHT_BOUNDED: tl.constexpr,
            DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """Attention of the rows to keys [lo, hi) (tile aligned, inside key_range's span, whose [un_lo, un_hi)
    needs no mask): the normalised output and lse per row; a row that sees no key gets 0 and -inf."""
    un_lo = tl.minimum(tl.maximum(un_lo, lo), hi)
    un_hi = tl.minimum(tl.maximum(un_hi, un_lo), hi)
    row_max = tl.full([q.shape[0]], float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros([q.shape[0]], dtype=tl.float32)
    acc = tl.zeros([q.shape[0], HEAD_DIM_PAD], dtype=tl.float32)
    acc, row_max, row_sum = _decode_tiles(acc, row_max, row_sum, q, k_desc, v_desc, BLOCK_TABLE, stride_bt, batch,
                                          kv_head, tokens, lo, un_lo, qk_scale, softcap_log2, seqlen_q, seqlen_k,
                                          window_left, window_right, k_page_rows, v_page_rows, BLOCK_N, PAGE_SIZE,
                                          HEAD_DIM_PAD, HEAD_AXIS, HAS_SOFTCAP, True, LEFT_BOUNDED, RIGHT_BOUNDED,
                                          DOT_PRECISION, UPCAST_DOT)
    acc, row_max, row_sum = _decode_tiles(acc, row_max, row_sum, q, k_desc, v_desc, BLOCK_TABLE, stride_bt, batch,
                                          kv_head, tokens, un_lo, un_hi, qk_scale, softcap_log2, seqlen_q, seqlen_k,
                                          window_left, window_right, k_page_rows, v_page_rows, BLOCK_N, PAGE_SIZE,
                                          HEAD_DIM_PAD, HEAD_AXIS, HAS_SOFTCAP, False, LEFT_BOUNDED, RIGHT_BOUNDED,
                                          DOT_PRECISION, UPCAST_DOT)
    acc, row_max, row_sum = _decode_tiles(acc, row_max, row_sum, q, k_desc, v_desc, BLOCK_TABLE, stride_bt, batch,
                                          kv_head, tokens, un_hi, hi, qk_scale, softcap_log2, seqlen_q, seqlen_k,
                                          window_left, window_right, k_page_rows, v_page_rows, BLOCK_N, PAGE_SIZE,
                                          HEAD_DIM_PAD, HEAD_AXIS, HAS_SOFTCAP, True, LEFT_BOUNDED, RIGHT_BOUNDED,
                                          DOT_PRECISION, UPCAST_DOT)
    # A row that saw no key: output 0 and lse = -inf (log of an empty sum).
    empty = row_sum == 0.0
    acc = acc / tl.where(empty, 1.0, row_sum)[:, None]
    lse = tl.where(empty, float("-inf"), (row_max + tl.log2(tl.where(empty, 1.0, row_sum))) * LN2)
    return acc, lse


# Launched through launch.CompiledLaunch: no int is specialised, and of the pointers only the caller's
# SEQLENS_K, BLOCK_TABLE and CU_SEQLENS_Q may be unaligned (q and the caches pass as_descriptor_compatible;
# the outputs and partials are fresh allocations).
@triton.jit(do_not_specialize=["stride_qb", "stride_qs", "stride_qh", "stride_ks", "stride_kh", "stride_vs",
                               "stride_vh", "stride_bt", "stride_lse_h", "seqlen_q", "heads_kv", "num_splits",
                               "k_page_rows", "v_page_rows", "k_rows", "v_rows", "cache_len", "window_left",
                               "window_right"],
            do_not_specialize_on_alignment=["SEQLENS_K", "BLOCK_TABLE", "CU_SEQLENS_Q"])
def _decode_kernel(
    Q, K, V, O, LSE, O_PART, LSE_PART, SEQLENS_K, BLOCK_TABLE, CU_SEQLENS_Q,
    stride_qb, stride_qs, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_bt, stride_lse_h,
    seqlen_q, heads_kv, num_splits, k_page_rows, v_page_rows, k_rows, v_rows, cache_len,
    qk_scale, softcap_log2, window_left, window_right,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    LEFT_BOUNDED: tl.constexpr, RIGHT_BOUNDED: tl.constexpr, HAS_SOFTCAP: tl.constexpr, SPLIT: tl.constexpr,
    PER_SEQUENCE_LENGTHS: tl.constexpr, VARLEN_Q: tl.constexpr, DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    # Token blocks and (sequence, kv head) share grid dimension 0, whose cap (2**31 - 1) no batch reaches.
    token_blocks = tl.cdiv(seqlen_q, BLOCK_T)
    pid_t = tl.program_id(0) % token_blocks
    pid_bh = tl.program_id(0) // token_blocks
    split = tl.program_id(1)
    batch = pid_bh // heads_kv
    kv_head = pid_bh % heads_kv
    heads_q = heads_kv * GROUP
    if PER_SEQUENCE_LENGTHS:
        seqlen_k = tl.load(SEQLENS_K + batch)
    else:  # every sequence holds cache_len entries (the model's decoding loop): no lengths tensor to fill
        seqlen_k = cache_len

    t0 = pid_t * BLOCK_T
    # Queries packed along the token dim (flash_attn_varlen_func): the grid covers the longest sequence
    # (seqlen_q is max_seqlen_q), and this sequence's first row and length come from the offsets.
    if VARLEN_Q:
        q_first = tl.load(CU_SEQLENS_Q + batch)
        seqlen_q = tl.load(CU_SEQLENS_Q + batch + 1) - q_first
        q_base = Q + q_first.to(tl.int64) * stride_qs
        out_first = q_first  # out's flat row of the sequence's first token
        lse_base = q_first
    else:
        q_base = Q + batch * stride_qb
        out_first = batch * seqlen_q
        lse_base = batch * heads_q * seqlen_q
    if t0 >= seqlen_q:  # a token block past a shorter packed sequence's end
        return
    q, tokens, heads, row_ok, tile_ok = _query_rows(q_base, t0, kv_head, seqlen_q, stride_qs, stride_qh, GROUP,
                                                    GROUP_PAD, BLOCK_T, HEAD_DIM, HEAD_DIM_PAD)
    k_desc = tl.make_tensor_descriptor(K + kv_head * stride_kh, shape=[k_rows, HEAD_DIM], strides=[stride_ks, 1],
                                       block_shape=[BLOCK_N, HEAD_DIM_PAD])
    v_desc = tl.make_tensor_descriptor(V + kv_head * stride_vh, shape=[v_rows, HEAD_DIM], strides=[stride_vs, 1],
                                       block_shape=[BLOCK_N, HEAD_DIM_PAD])

    # This split's share of the key tiles the rows can see; an empty share still writes lse = -inf.
    start, un_lo, un_hi, end = key_range(t0, seqlen_q, seqlen_k, window_left, window_right,
                                         BLOCK_T, BLOCK_N, LEFT_BOUNDED, RIGHT_BOUNDED)
    split_tiles = tl.cdiv((end - start) // BLOCK_N, num_splits)
    lo = tl.minimum(start + split * split_tiles * BLOCK_N, end)
    hi = tl.minimum(lo + split_tiles * BLOCK_N, end)
    acc, lse = _attend(q, k_desc, v_desc, BLOCK_TABLE, stride_bt, batch, kv_head, tokens, lo, hi, un_lo, un_hi,
                       qk_scale, softcap_log2, seqlen_q, seqlen_k, window_left, window_right, k_page_rows,
                       v_page_rows, BLOCK_N, PAGE_SIZE, HEAD_DIM_PAD, False, HAS_SOFTCAP, LEFT_BOUNDED, RIGHT_BOUNDED,
                       DOT_PRECISION, UPCAST_DOT)
    dims = tl.arange(0, HEAD_DIM_PAD)
    # out and the partials are contiguous (batch, seqlen_q or total_q, heads_q[, splits], head_dim): one flat
    # row index; lse is (batch, heads_q, seqlen_q), or (heads_q, total_q) with stride_lse_h = total_q.
    out_row = (out_first + tokens) * heads_q + heads
    if SPLIT:
        part_row = out_row * num_splits + split
        tl.store(O_PART + part_row[:, None] * HEAD_DIM + dims[None, :], acc, mask=tile_ok)
        tl.store(LSE_PART + part_row, lse, mask=row_ok)
    else:
        tl.store(O + out_row[:, None] * HEAD_DIM + dims[None, :], narrow(acc, O.dtype.element_ty), mask=tile_ok)
        tl.store(LSE + lse_base + heads * stride_lse_h + tokens, lse, mask=row_ok)


@triton.jit
def _owner(tile, programs, total_tiles):
    """The stream-K program whose share [p G / P, (p + 1) G / P) holds global tile ``tile`` (G = total_tiles)."""
    return ((tile + 1) * programs - 1) // total_tiles


@triton.jit
def _sequence_tiles(SEQLENS_K, batch, cache_len, heads_kv, BLOCK_N: tl.constexpr, BATCH_PAD: tl.constexpr,
                    PER_SEQUENCE_LENGTHS: tl.constexpr):
    """The stream-K tile space: per sequence its key count, its tiles per kv head and its first global tile
    (sequences in order, each one's kv heads in order), and the total. Read on the device, so that the
    shares follow the lengths the cache holds, not its capacity."""
    seqs = tl.arange(0, BATCH_PAD)
    if PER_SEQUENCE_LENGTHS:
        lengths = tl.load(SEQLENS_K + seqs, mask=seqs < batch, other=0)
    else:
        lengths = tl.where(seqs < batch, cache_len, 0)
    tiles = tl.cdiv(lengths, BLOCK_N).to(tl.int64)
    first = (tl.cumsum(tiles, 0) - tiles) * heads_kv
    return lengths, tiles, first, tl.sum(tiles, 0) * heads_kv


@triton.jit
def _pick(values, index, BATCH_PAD: tl.constexpr):
    """values[index] of a vector held in registers."""
    return tl.sum(tl.where(tl.arange(0, BATCH_PAD) == index, values, 0), 0)


# Launched through launch.CompiledLaunch, as _decode_kernel.
@triton.jit(do_not_specialize=["stride_qb", "stride_qs", "stride_qh", "stride_ks", "stride_kh", "stride_vs",
                               "stride_vh", "stride_bt", "seqlen_q", "heads_kv", "batch", "slots", "k_page_rows",
                               "v_page_rows", "k_rows", "v_rows", "cache_len", "window_right"],
            do_not_specialize_on_alignment=["SEQLENS_K", "BLOCK_TABLE"])
def _decode_stream_k_kernel(
    Q, K, V, O_PART, LSE_PART, SEQLENS_K, BLOCK_TABLE,
    stride_qb, stride_qs, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_bt,
    seqlen_q, heads_kv, batch, slots, k_page_rows, v_page_rows, k_rows, v_rows, cache_len,
    qk_scale, softcap_log2, window_right,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, RIGHT_BOUNDED: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, PER_SEQUENCE_LENGTHS: tl.constexpr, BATCH_PAD: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
):
    # The key tiles of every (sequence, kv head), laid end to end (_sequence_tiles), G in all: program p of P
    # takes the equal share [p G / P, (p + 1) G / P), crossing from one (sequence, kv head) into the next
    # where its share does, and writes one partial per (sequence, kv head) it touched, in slot p - (the
    # owner of that one's first tile). Equal shares keep every SM busy to the end, which a split count per
    # (sequence, kv head) cannot when batch x kv heads x splits is no multiple of the SM count. One token
    # block (seqlen_q x GROUP_PAD <= BLOCK_T x GROUP_PAD), no left window: tile j is keys [j BLOCK_N, (j + 1)
    # BLOCK_N).
    program = tl.program_id(0).to(tl.int64)
    programs = tl.num_programs(0)
    lengths, seq_tiles, seq_first, total_tiles = _sequence_tiles(SEQLENS_K, batch, cache_len, heads_kv, BLOCK_N,
                                                                 BATCH_PAD, PER_SEQUENCE_LENGTHS)
    tile = program * total_tiles // programs
    share_end = (program + 1) * total_tiles // programs
    # One descriptor pair over (rows, kv heads, head_dim) for the whole share: a per-head 2-D descriptor
    # would be rebuilt inside the loop below.
    k_desc = tl.make_tensor_descriptor(K, shape=[k_rows, heads_kv, HEAD_DIM], strides=[stride_ks, stride_kh, 1],
                                       block_shape=[BLOCK_N, 1, HEAD_DIM_PAD])
    v_desc = tl.make_tensor_descriptor(V, shape=[v_rows, heads_kv, HEAD_DIM], strides=[stride_vs, stride_vh, 1],
                                       block_shape=[BLOCK_N, 1, HEAD_DIM_PAD])
    heads_q = heads_kv * GROUP
    dims = tl.arange(0, HEAD_DIM_PAD)
    while tile < share_end:
        # The sequence holding the tile: the last one starting at or before it (sequences without keys
        # start where the next one does).
        sequence = tl.sum((seq_first <= tile).to(tl.int32), 0) - 1
        tiles = _pick(seq_tiles, sequence, BATCH_PAD)
        kv_head = ((tile - _pick(seq_first, sequence, BATCH_PAD)) // tiles).to(tl.int32)
        head_first = _pick(seq_first, sequence, BATCH_PAD) + kv_head * tiles
        segment_end = tl.minimum(share_end, head_first + tiles)
        seqlen_k = _pick(lengths, sequence, BATCH_PAD)
        q, tokens, heads, row_ok, tile_ok = _query_rows(Q + sequence * stride_qb, 0, kv_head, seqlen_q, stride_qs,
                                                        stride_qh, GROUP, GROUP_PAD, BLOCK_T, HEAD_DIM, HEAD_DIM_PAD)
        start, un_lo, un_hi, end = key_range(0, seqlen_q, seqlen_k, -1, window_right, BLOCK_T, BLOCK_N, False,
                                             RIGHT_BOUNDED)
        lo = tl.minimum(((tile - head_first) * BLOCK_N).to(tl.int32), end)  # start is 0 without a left bound
        hi = tl.minimum(((segment_end - head_first) * BLOCK_N).to(tl.int32), end)
        acc, lse = _attend(q, k_desc, v_desc, BLOCK_TABLE, stride_bt, sequence, kv_head, tokens, lo, hi, un_lo,
                           un_hi, qk_scale, softcap_log2, seqlen_q, seqlen_k, -1, window_right, k_page_rows,
                           v_page_rows, BLOCK_N, PAGE_SIZE, HEAD_DIM_PAD, True, HAS_SOFTCAP, False, RIGHT_BOUNDED,
                           DOT_PRECISION, UPCAST_DOT)
        slot = program - _owner(head_first, programs, total_tiles)
        part_row = ((sequence * seqlen_q + tokens) * heads_q + heads).to(tl.int64) * slots + slot
        tl.store(O_PART + part_row[:, None] * HEAD_DIM + dims[None, :], acc, mask=tile_ok)
        tl.store(LSE_PART + part_row, lse, mask=row_ok)
        tile = segment_end


@triton.jit(do_not_specialize=["seqlen_q", "heads_q", "num_splits", "group", "batch", "programs", "cache_len"],
            do_not_specialize_on_alignment=["SEQLENS_K"])  # CompiledLaunch; other pointers: fresh buffers
def _combine_kernel(O_PART, LSE_PART, O, LSE, SEQLENS_K, seqlen_q, heads_q, num_splits, group, batch, programs,
                    cache_len, SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                    VARLEN_Q: tl.constexpr, STREAM_K: tl.constexpr, BLOCK_N: tl.constexpr, BATCH_PAD: tl.constexpr,
                    PER_SEQUENCE_LENGTHS: tl.constexpr):
    # One program per (batch, token, query head) row: out = sum_s exp(lse_s - lse) * out_s, over the row's
    # num_splits slots. Packed queries (VARLEN_Q) have rows (token, head) with seqlen_q = total_q, and lse
    # (heads_q, total_q). After the stream-K kernel a row's slots are the programs that shared its
    # (sequence, kv head): from the owner of its first tile to the owner of its last, none without keys.
    row = tl.program_id(0)
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    if STREAM_K:
        heads_kv = heads_q // group
        _, seq_tiles, seq_first, total_tiles = _sequence_tiles(SEQLENS_K, batch, cache_len, heads_kv, BLOCK_N,
                                                               BATCH_PAD, PER_SEQUENCE_LENGTHS)
        sequence = row // (seqlen_q * heads_q)
        tiles = _pick(seq_tiles, sequence, BATCH_PAD)
        head_first = _pick(seq_first, sequence, BATCH_PAD) + (row % heads_q) // group * tiles
        used = tl.where(tiles == 0, 0, _owner(head_first + tiles - 1, programs, total_tiles)
                        - _owner(head_first, programs, total_tiles) + 1)
    else:
        used = num_splits
    lse_s = tl.load(LSE_PART + row * num_splits + splits, mask=splits < used, other=float("-inf"))
    out_s = tl.load(O_PART + (row * num_splits + splits)[:, None] * HEAD_DIM + dims[None, :],
                    mask=(splits[:, None] < used) & (dims[None, :] < HEAD_DIM), other=0.0)
    lse_max = tl.max(lse_s, 0)
    # Every split empty: keep lse -inf and output 0 without computing inf - inf.
    lse_max_safe = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    weights = tl.exp(lse_s - lse_max_safe)
    total = tl.sum(weights, 0)
    out = tl.sum(out_s * weights[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    lse = tl.where(total == 0.0, float("-inf"), lse_max_safe + tl.log(tl.where(total == 0.0, 1.0, total)))
    tl.store(O + row * HEAD_DIM + dims, narrow(out, O.dtype.element_ty), mask=dims < HEAD_DIM)
    head = row % heads_q
    if VARLEN_Q:
        tl.store(LSE + head * seqlen_q + row // heads_q, lse)
    else:
        batch = row // (seqlen_q * heads_q)
        token = (row // heads_q) % seqlen_q
        tl.store(LSE + (batch * heads_q + head) * seqlen_q + token, lse)


def _page_pool(cache):
    """``cache`` (pages, page_size, heads_kv, head_dim) itself when the kernel can read it as a 2-D
    (rows, head_dim) view per head (see _page_rows), else a contiguous copy."""
    cache = as_descriptor_compatible(cache)
    return cache.contiguous() if cache.stride(0) % cache.stride(1) else cache


def _page_rows(cache):
    """(rows per page, rows) of a _page_pool cache seen as 2-D (rows, head_dim) per head: page p starts
    at row p * rows_per_page."""
    page_rows = cache.stride(0) // cache.stride(1)
    return page_rows, (cache.shape[0] - 1) * page_rows + cache.shape[1]


def _launch_config(device, head_dim_pad, page_size):
    """BLOCK_N, num_warps, num_stages. BLOCK_N must divide the page size so tiles stay in one page."""
    if device.type == "cuda":
        # Decoding is bandwidth-bound: 64-key tiles, 3 stages in flight (K + V = 96 KB at head_dim
        # 128) leave room for two programs per SM.
        block_n, warps, stages = (64, 4, 3) if head_dim_pad <= WIDE_HEAD_DIM else (32, 4, 3)
    else:
        block_n, warps, stages = 32, 4, 1  # interpreter: small tiles, several per test cache
    if page_size:
        block_n = min(block_n, page_size & -page_size)  # the largest power of two dividing page_size
    return block_n, warps, stages


def choose_num_splits(programs, keys, device):
    """Splits of the cache per program: as many programs as SMs where the keys allow (not more: a few
    SMs running two programs while the rest run one stretch the launch), then splits of up to
    TARGET_KEYS_PER_SPLIT keys, the most whose waves are >= 95% filled, both waves of one program per
    SM and of RESIDENT_PER_SM (the best-filled count when none is).

    Measured on the H200 (bench_decode.py --split-sweep, 2026-11-29; batch 1 at 64k): 128 programs read
    3.29 TB/s, 136 read 3.11, 264 (two per SM) 3.26, 320 2.71, 400 3.03. At batch 8 and 64, splits of
    4k keys gain 1-3% over fewer, and splits under ~1k keys lose at any batch.

    Args:
        programs: programs without splitting; keys: the most keys one of them reads.
    """
    sms = _sms(device)
    most = max(1, min(keys // MIN_KEYS_PER_SPLIT, MAX_SPLITS))
    fewest = max(1, min(most, sms // programs))
    candidates = range(fewest, max(fewest, min(keys // TARGET_KEYS_PER_SPLIT, most)) + 1)

    def fill(splits):
        total = programs * splits
        return 1.0 if total <= sms else min(_wave_fill(total, sms), _wave_fill(total, RESIDENT_PER_SM * sms))

    filled = [splits for splits in candidates if fill(splits) >= 0.95]
    return max(filled) if filled else max(candidates, key=fill)


def _sms(device):
    if device.type != "cuda":
        return DEFAULT_SMS
    return sm_count(device.index if device.index is not None else torch.cuda.current_device())


def _wave_fill(programs, slots):
    """Share of the launched waves' slots that ``programs`` occupy."""
    return programs / (cdiv(programs, slots) * slots)


class _Plan(NamedTuple):
    """What a decode call's launches take besides its tensors and cache length, fixed by the layouts,
    shapes and options (see _plan_key): computed once, since a batch-1 step is host-bound."""
    stream_k: bool  # _decode_stream_k_kernel, not _decode_kernel
    grid: tuple
    ints: tuple  # the decode kernel's int arguments before cache_len
    scalars: tuple  # and after it
    meta: dict
    partial_shapes: tuple  # () without splits
    combine_grid: tuple
    combine_ints: tuple  # the combine kernel's int arguments before cache_len
    combine_meta: dict


_PLANS = {}
MAX_PLANS = 256  # a model decodes with a handful; a long-lived server must not grow without bound


def _plan_key(q, k_cache, v_cache, block_table, per_sequence, max_seqlen_k, softmax_scale, window_left,
              window_right, softcap, num_splits, packed_q):
    # Automatic splits depend on the cache length only through keys // MIN_KEYS_PER_SPLIT (capped), so a
    # growing cache changes the plan every MIN_KEYS_PER_SPLIT steps at most.
    budget = min(max_seqlen_k // MIN_KEYS_PER_SPLIT, MAX_SPLITS) if num_splits == 0 else 0
    return (q.shape, q.stride(), q.dtype, k_cache.dtype, q.device, k_cache.shape, k_cache.stride(), v_cache.shape,
            v_cache.stride(), None if block_table is None else block_table.stride(), per_sequence, softmax_scale,
            window_left, window_right, softcap, num_splits, budget, packed_q, STREAM_K_PER_SM)


def _build_plan(q, k_cache, v_cache, block_table, per_sequence, max_seqlen_k, softmax_scale, window_left,
                window_right, softcap, num_splits, packed_q):
    """The _Plan of tensors the kernels can read as they are (see _readable); packed_q: (batch,
    max_seqlen_q) of packed queries (total_q, heads_q, head_dim), None for (batch, seqlen_q, ...)."""
    *rows, heads_q, head_dim = q.shape
    if packed_q is None:
        (batch, seqlen_q), q_strides, lse_head_stride = rows, q.stride()[:3], rows[1]
    else:
        (batch, seqlen_q), q_strides, lse_head_stride = packed_q, (0, *q.stride()[:2]), rows[0]
    heads_kv = k_cache.shape[2]
    group = heads_q // heads_kv
    page_size = k_cache.shape[1] if block_table is not None else 0
    k_page_rows, k_rows = _page_rows(k_cache)
    v_page_rows, v_rows = _page_rows(v_cache)
    head_dim_pad = pad_head_dim(head_dim)
    group_pad = next_power_of_2(group)
    block_t = min(max(next_power_of_2(seqlen_q), MIN_ROWS // group_pad), max(1, MAX_ROWS // group_pad))
    token_blocks = cdiv(seqlen_q, block_t)
    num_splits_asked = num_splits
    if num_splits == 0:
        keys = max_seqlen_k
        if window_left >= 0 and window_right >= 0:  # a two-sided window bounds the keys a program reads
            keys = min(keys, window_left + window_right + block_t)
        num_splits = choose_num_splits(batch * heads_kv * token_blocks, keys, q.device)
    block_n, num_warps, num_stages = _launch_config(q.device, head_dim_pad, page_size)
    split = num_splits > 1
    qk_scale, softcap_log2 = log2_scales(softmax_scale, softcap)
    common = dict(GROUP=group, GROUP_PAD=group_pad, BLOCK_T=block_t, BLOCK_N=block_n, PAGE_SIZE=page_size,
                  HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, RIGHT_BOUNDED=window_right >= 0,
                  HAS_SOFTCAP=softcap > 0.0, PER_SEQUENCE_LENGTHS=per_sequence, DOT_PRECISION=dot_precision(q.dtype),
                  UPCAST_DOT=upcast_dot(q.dtype), num_warps=num_warps, num_stages=num_stages)
    programs = _sms(q.device) * STREAM_K_PER_SM
    # A (sequence, kv head) holds at most 1 / heads_kv of all tiles, so at most cdiv(programs, heads_kv) + 1
    # programs share it: the merge's slots.
    slots = cdiv(programs, heads_kv) + 1
    # Where the automatic choice splits, within the stream-K kernel's shape limits.
    if (split and STREAM_K_PER_SM and num_splits_asked == 0 and packed_q is None and token_blocks == 1
            and window_left < 0 and slots <= MAX_SPLITS and batch <= STREAM_K_MAX_BATCH):
        batch_pad = next_power_of_2(batch)
        return _Plan(
            stream_k=True, grid=(programs,),
            ints=(*q_strides, *k_cache.stride()[1:3], *v_cache.stride()[1:3],
                  block_table.stride(0) if block_table is not None else 0,
                  seqlen_q, heads_kv, batch, slots, k_page_rows, v_page_rows, k_rows, v_rows),
            scalars=(qk_scale, softcap_log2, window_right), meta=dict(common, BATCH_PAD=batch_pad),
            partial_shapes=((*rows, heads_q, slots, head_dim), (*rows, heads_q, slots)),
            combine_grid=(math.prod(rows) * heads_q,),
            combine_ints=(seqlen_q, heads_q, slots, group, batch, programs),
            combine_meta=dict(SPLITS_PAD=max(2, next_power_of_2(slots)), HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
                              VARLEN_Q=False, STREAM_K=True, BLOCK_N=block_n, BATCH_PAD=batch_pad,
                              PER_SEQUENCE_LENGTHS=per_sequence, num_warps=4))
    return _Plan(
        stream_k=False, grid=(token_blocks * batch * heads_kv, num_splits),
        ints=(*q_strides, *k_cache.stride()[1:3], *v_cache.stride()[1:3],
              block_table.stride(0) if block_table is not None else 0, lse_head_stride,
              seqlen_q, heads_kv, num_splits, k_page_rows, v_page_rows, k_rows, v_rows),
        scalars=(qk_scale, softcap_log2, window_left, window_right),
        meta=dict(common, LEFT_BOUNDED=window_left >= 0, SPLIT=split, VARLEN_Q=packed_q is not None),
        partial_shapes=((*rows, heads_q, num_splits, head_dim), (*rows, heads_q, num_splits)) if split else (),
        combine_grid=(math.prod(rows) * heads_q,),
        combine_ints=(seqlen_q if packed_q is None else rows[0], heads_q, num_splits, 1, 1, 1),
        combine_meta=dict(SPLITS_PAD=max(2, next_power_of_2(num_splits)), HEAD_DIM=head_dim,
                          HEAD_DIM_PAD=head_dim_pad, VARLEN_Q=packed_q is not None, STREAM_K=False, BLOCK_N=block_n,
                          BATCH_PAD=1, PER_SEQUENCE_LENGTHS=False, num_warps=4),
    )


def _readable(q, k_cache, v_cache, block_table):
    """The tensors as the kernels read them: themselves, or a contiguous copy of one whose layout TMA
    or the kernels' pointer arithmetic cannot address (see as_descriptor_compatible, _page_rows)."""
    q = as_descriptor_compatible(q)  # unit last stride, which the kernel's pointer arithmetic assumes
    if block_table is not None and block_table.stride(1) != 1:
        block_table = block_table.contiguous()  # the kernel steps through a row with unit stride
    return q, _page_pool(k_cache), _page_pool(v_cache), block_table


def decode_attention(q, k_cache, v_cache, seqlens_k, block_table, max_seqlen_k, softmax_scale, window_left,
                     window_right, softcap, num_splits=0, return_lse=True, cu_seqlens_q=None, max_seqlen_q=0):
    """Attention of a few query tokens over KV caches, on validated inputs (k/v already appended).

    Args:
        q: (batch, seqlen_q, heads_q, head_dim), or packed (total_q, heads_q, head_dim) with
            cu_seqlens_q int32 (batch + 1,) and max_seqlen_q (flash_attn_varlen_func's paged form).
        k_cache, v_cache: (batch, max_cache, heads_kv, head_dim), or paged (num_blocks, block_size,
            heads_kv, head_dim) with block_table (batch, max_blocks) int32.
        seqlens_k: int32 (batch,): valid cache entries per sequence, or an int shared by every sequence;
            max_seqlen_k: their maximum.
        window_left, window_right: -1 = unbounded; causal is window_right = 0 (bottom-right aligned).
        num_splits: chunks of the cache per (sequence, kv head); 0 = choose_num_splits.
        return_lse: False returns None for lse, whose buffer is then reused between calls on CUDA.
    Returns:
        out like q (contiguous), lse fp32 (batch, heads_q, seqlen_q) or (heads_q, total_q), or None.
    """
    out = new_output(q)
    lse_shape = (q.shape[0], q.shape[2], q.shape[1]) if cu_seqlens_q is None else (q.shape[1], q.shape[0])
    if return_lse or q.device.type != "cuda":
        lse = new_output(q, lse_shape, torch.float32)
    else:
        (lse,) = reused_buffers(q.device.index, "decode lse", torch.float32, (lse_shape,))
    if out.numel() == 0:
        return out, lse if return_lse else None
    if max_seqlen_k == 0:  # nothing to attend to: every row is empty
        return out.zero_(), lse.fill_(-math.inf) if return_lse else None
    per_sequence = isinstance(seqlens_k, torch.Tensor)
    packed_q = None if cu_seqlens_q is None else (cu_seqlens_q.numel() - 1, max_seqlen_q)
    options = (per_sequence, max_seqlen_k, softmax_scale, window_left, window_right, softcap, num_splits, packed_q)
    key = _plan_key(q, k_cache, v_cache, block_table, *options)
    plan = _PLANS.get(key)
    # A plan exists only for layouts the kernels read as they are; the base addresses change per call.
    if plan is None or (q.data_ptr() | k_cache.data_ptr() | v_cache.data_ptr()) % 16:
        q, k_cache, v_cache, block_table = _readable(q, k_cache, v_cache, block_table)
        key = _plan_key(q, k_cache, v_cache, block_table, *options)
        plan = _PLANS.get(key)
        if plan is None:
            if len(_PLANS) >= MAX_PLANS:
                _PLANS.clear()
            plan = _PLANS[key] = _build_plan(q, k_cache, v_cache, block_table, *options)
    out_part = lse_part = None
    if plan.partial_shapes:  # reused on CUDA: two allocations are a tenth of a batch-1 step's host time
        out_part, lse_part = (reused_buffers(q.device.index, "decode partials", torch.float32, plan.partial_shapes)
                              if q.device.type == "cuda"
                              else [new_output(q, shape, torch.float32) for shape in plan.partial_shapes])
    ensure_allocator(q.device)
    # The plan's key fixes every argument type (the caches' dtype is q's, checked by the API; a lengths
    # tensor and a block table are int32; a cache length fits int32) and every constexpr.
    lengths, cache_len = (seqlens_k, 0) if per_sequence else (None, seqlens_k)
    if plan.stream_k:
        _stream_k_launch.launch_keyed(("decode stream-k", key), plan.grid, q, k_cache, v_cache, out_part, lse_part,
                                      lengths, block_table, *plan.ints, cache_len, *plan.scalars, **plan.meta)
    else:
        _decode_launch.launch_keyed(
            ("decode", key), plan.grid, q, k_cache, v_cache, out, lse, out_part, lse_part,
            lengths, block_table, cu_seqlens_q, *plan.ints, cache_len, *plan.scalars, **plan.meta)
    if plan.partial_shapes:
        _combine_launch.launch_keyed(("combine", key), plan.combine_grid, out_part, lse_part, out, lse,
                                     lengths if plan.stream_k else None, *plan.combine_ints, cache_len,
                                     **plan.combine_meta)
    return out, lse if return_lse else None


_decode_launch = CompiledLaunch(_decode_kernel)
_stream_k_launch = CompiledLaunch(_decode_stream_k_kernel)
_combine_launch = CompiledLaunch(_combine_kernel)
