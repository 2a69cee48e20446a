"""The decode kernels' bodies (their launches and plans: decode.py).

Row r of a program's tile is query token ``t0 + r // GROUP_PAD`` and query head
``kv_head * GROUP + r % GROUP_PAD``: whole tokens per program, so the dense kernel's causal /
window tile ranges (tile_ops.key_range) apply with tokens as rows.

Both cache layouts are read through tensor descriptors: cache row ``page * page_rows + offset``, where a
contiguous cache is a pool with one page per sequence (page = batch index) and a paged cache looks its page
up in block_table. Key tiles never straddle a page (BLOCK_N divides the page size). Each program makes one
2-D (rows, head_dim) descriptor pair for its kv head.
"""

import math

import triton
import triton.language as tl

from .tile_ops import alibi_bias, attention_logits, key_range, logit_scale, narrow, online_softmax_step

LN2 = tl.constexpr(math.log(2.0))
LOG2E = tl.constexpr(1.0 / math.log(2.0))


@triton.jit
def _decode_tiles(acc, row_max, row_sum, q, k_desc, v_desc, BLOCK_TABLE, stride_bt, batch, tokens, start, end,
                  qk_scale, softcap_log2, seqlen_q, seqlen_k, window_left, window_right, k_page_rows, v_page_rows,
                  slopes_log2, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                  HAS_SOFTCAP: tl.constexpr, MASKED: tl.constexpr, LEFT_BOUNDED: tl.constexpr,
                  RIGHT_BOUNDED: tl.constexpr, HAS_ALIBI: tl.constexpr, DOT_PRECISION: tl.constexpr,
                  UPCAST_DOT: tl.constexpr):
    for n0 in tl.range(start, end, BLOCK_N):
        if PAGE_SIZE > 0:
            page = tl.load(BLOCK_TABLE + batch * stride_bt + n0 // PAGE_SIZE)
            offset = n0 % PAGE_SIZE
        else:
            page = batch
            offset = n0
        k = k_desc.load([page * k_page_rows + offset, 0])
        v = v_desc.load([page * v_page_rows + offset, 0])
        cols = n0 + tl.arange(0, BLOCK_N)
        s = attention_logits(q, k, tokens, cols, qk_scale, softcap_log2, seqlen_q, seqlen_k, window_left, window_right,
                             HAS_SOFTCAP, MASKED, LEFT_BOUNDED, RIGHT_BOUNDED, DOT_PRECISION, UPCAST_DOT)
        scale = logit_scale(qk_scale, HAS_SOFTCAP)
        if HAS_ALIBI:  # each row's slope (its query head's) in log2 units, where the logits go first
            s = s * scale + alibi_bias(tokens[:, None], cols[None, :], slopes_log2[:, None], seqlen_q, seqlen_k)
            scale = 1.0
        if MASKED:
            # Past the sequence's end a cache holds stale entries (NaN in a fresh torch.empty cache):
            # p = 0 there, but 0 * NaN would still poison the product, so zero those rows of V.
            v = tl.where((cols < seqlen_k)[:, None], v, 0.0)
        acc, row_max, row_sum = online_softmax_step(acc, row_max, row_sum, s, scale, v, MASKED, DOT_PRECISION,
                                                    UPCAST_DOT)
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
def _attend(q, k_desc, v_desc, BLOCK_TABLE, stride_bt, batch, tokens, lo, hi, un_lo, un_hi,
            qk_scale, softcap_log2, seqlen_q, seqlen_k, window_left, window_right, k_page_rows, v_page_rows,
            slopes_log2, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
            HAS_SOFTCAP: tl.constexpr, LEFT_BOUNDED: tl.constexpr, RIGHT_BOUNDED: tl.constexpr,
            HAS_ALIBI: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """Attention of the rows to keys [lo, hi) (tile aligned, inside key_range's span, whose [un_lo, un_hi)
    needs no mask): the normalised output and lse per row; a row that sees no key gets 0 and -inf."""
    un_lo = tl.minimum(tl.maximum(un_lo, lo), hi)
    un_hi = tl.minimum(tl.maximum(un_hi, un_lo), hi)
    row_max = tl.full([q.shape[0]], float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros([q.shape[0]], dtype=tl.float32)
    acc = tl.zeros([q.shape[0], HEAD_DIM_PAD], dtype=tl.float32)
    acc, row_max, row_sum = _decode_tiles(acc, row_max, row_sum, q, k_desc, v_desc, BLOCK_TABLE, stride_bt, batch,
                                          tokens, lo, un_lo, qk_scale, softcap_log2, seqlen_q, seqlen_k,
                                          window_left, window_right, k_page_rows, v_page_rows, slopes_log2,
                                          BLOCK_N, PAGE_SIZE, HEAD_DIM_PAD, HAS_SOFTCAP, True, LEFT_BOUNDED,
                                          RIGHT_BOUNDED, HAS_ALIBI, DOT_PRECISION, UPCAST_DOT)
    acc, row_max, row_sum = _decode_tiles(acc, row_max, row_sum, q, k_desc, v_desc, BLOCK_TABLE, stride_bt, batch,
                                          tokens, un_lo, un_hi, qk_scale, softcap_log2, seqlen_q, seqlen_k,
                                          window_left, window_right, k_page_rows, v_page_rows, slopes_log2,
                                          BLOCK_N, PAGE_SIZE, HEAD_DIM_PAD, HAS_SOFTCAP, False, LEFT_BOUNDED,
                                          RIGHT_BOUNDED, HAS_ALIBI, DOT_PRECISION, UPCAST_DOT)
    acc, row_max, row_sum = _decode_tiles(acc, row_max, row_sum, q, k_desc, v_desc, BLOCK_TABLE, stride_bt, batch,
                                          tokens, un_hi, hi, qk_scale, softcap_log2, seqlen_q, seqlen_k,
                                          window_left, window_right, k_page_rows, v_page_rows, slopes_log2,
                                          BLOCK_N, PAGE_SIZE, HEAD_DIM_PAD, HAS_SOFTCAP, True, LEFT_BOUNDED,
                                          RIGHT_BOUNDED, HAS_ALIBI, DOT_PRECISION, UPCAST_DOT)
    # A row that saw no key: output 0 and lse = -inf (log of an empty sum).
    empty = row_sum == 0.0
    acc = acc / tl.where(empty, 1.0, row_sum)[:, None]
    lse = tl.where(empty, float("-inf"), (row_max + tl.log2(tl.where(empty, 1.0, row_sum))) * LN2)
    return acc, lse


# Launched through launch.CompiledLaunch: no int is specialised, and of the pointers only the caller's
# SEQLENS_K, BLOCK_TABLE, CU_SEQLENS_Q and ALIBI_SLOPES may be unaligned (q and the caches pass
# as_descriptor_compatible; the outputs and partials are fresh allocations).
@triton.jit(do_not_specialize=["stride_qb", "stride_qs", "stride_qh", "stride_ks", "stride_kh", "stride_vs",
                               "stride_vh", "stride_bt", "stride_lse_h", "seqlen_q", "heads_kv", "num_splits",
                               "k_page_rows", "v_page_rows", "k_rows", "v_rows", "cache_len", "window_left",
                               "window_right", "stride_alibi_b"],
            do_not_specialize_on_alignment=["SEQLENS_K", "BLOCK_TABLE", "CU_SEQLENS_Q", "ALIBI_SLOPES"])
def decode_kernel(
    Q, K, V, O, LSE, O_PART, LSE_PART, SEQLENS_K, BLOCK_TABLE, CU_SEQLENS_Q, ALIBI_SLOPES,
    stride_qb, stride_qs, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_bt, stride_lse_h,
    stride_alibi_b,
    seqlen_q, heads_kv, num_splits, k_page_rows, v_page_rows, k_rows, v_rows, cache_len,
    qk_scale, softcap_log2, window_left, window_right,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    LEFT_BOUNDED: tl.constexpr, RIGHT_BOUNDED: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    SPLIT: tl.constexpr,
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
    if PER_SEQUENCE_LENGTHS:  # cache_len: the keys an append just wrote past each length (no launch to add them)
        seqlen_k = tl.load(SEQLENS_K + batch) + cache_len
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
    slopes_log2 = tl.zeros([q.shape[0]], dtype=tl.float32)
    if HAS_ALIBI:  # ALiBi's slope of each row's query head, (heads_q,) or per sequence (batch, heads_q)
        slopes_log2 = tl.load(ALIBI_SLOPES + batch * stride_alibi_b + heads, mask=row_ok, other=0.0) * LOG2E
    acc, lse = _attend(q, k_desc, v_desc, BLOCK_TABLE, stride_bt, batch, tokens, lo, hi, un_lo, un_hi,
                       qk_scale, softcap_log2, seqlen_q, seqlen_k, window_left, window_right, k_page_rows,
                       v_page_rows, slopes_log2, BLOCK_N, PAGE_SIZE, HEAD_DIM_PAD, HAS_SOFTCAP, LEFT_BOUNDED,
                       RIGHT_BOUNDED, HAS_ALIBI, DOT_PRECISION, UPCAST_DOT)
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


@triton.jit(do_not_specialize=["seqlen_q", "heads_q", "num_splits"])  # CompiledLaunch; pointers: fresh buffers
def combine_kernel(O_PART, LSE_PART, O, LSE, seqlen_q, heads_q, num_splits,
                   SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                   VARLEN_Q: tl.constexpr):
    # One program per (batch, token, query head) row: out = sum_s exp(lse_s - lse) * out_s. Packed
    # queries (VARLEN_Q) have rows (token, head) with seqlen_q = total_q, and lse (heads_q, total_q).
    row = tl.program_id(0)
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    lse_s = tl.load(LSE_PART + row * num_splits + splits, mask=splits < num_splits, other=float("-inf"))
    out_s = tl.load(O_PART + (row * num_splits + splits)[:, None] * HEAD_DIM + dims[None, :],
                    mask=(splits[:, None] < num_splits) & (dims[None, :] < HEAD_DIM), other=0.0)
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
