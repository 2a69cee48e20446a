"""What flash_attn_with_kvcache does before attention: rotary embeddings on q and the new keys at their cache
positions, and the append of the new keys and values into the cache.

With per-sequence (tensor) lengths, or with rotary, PyTorch's form (``rotate_and_append_reference``: a gather of
cos / sin rows and about ten elementwise ops per rotated tensor, an add and two index_put_ calls per append) costs
one dispatcher trip per op, ~30 µs of host time for the append alone. The Triton path launches ``rows_kernel``
instead: once for the keys and values (rotated and written into the cache), once for the queries where rotary
applies, so that a decoding step in eager mode is not held up by its host. A traced graph, the PyTorch path and
strided inputs keep PyTorch's form.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .cache_pages import arange, rotate, size_index
from .launch import launcher
from .sizes import cdiv, next_power_of_2

ROWS = 32  # (token, head) rows per program: 32 x head_dim 128 is 8 KB of each tensor
NO_ROTARY, INTERLEAVED, HALVES = 0, 1, 2  # ROTARY: pairs (0, 1), (2, 3), ... or (i, i + rotary_dim / 2)


class Rotary(NamedTuple):
    """flash_attn_with_kvcache's rotary arguments: cos, sin (seqlen_ro, rotary_dim / 2); whether pairs are
    interleaved; whether each query token turns by its own position (causal or windowed) or all by the first."""
    cos: torch.Tensor
    sin: torch.Tensor
    interleaved: bool
    per_query_token: bool


@triton.jit
def _copy_rows(src_rows, dst_rows, row_ok, COS, SIN, angle_rows, rotate_ok, HEAD_DIM: tl.constexpr,
               HEAD_DIM_PAD: tl.constexpr, ROTARY: tl.constexpr, ROTARY_HALF: tl.constexpr,
               ROTARY_HALF_PAD: tl.constexpr):
    """Each row's HEAD_DIM elements from src_rows to dst_rows (offsets), its first 2 * ROTARY_HALF dims turned by
    the cos / sin row at angle_rows (offsets) where rotate_ok (ROTARY), in fp32 as cache_pages.rotate computes it.
    Every access moves contiguous runs of a row, so that a thread moves 16 bytes at once."""
    dims = tl.arange(0, HEAD_DIM_PAD)
    mask = row_ok[:, None] & (dims < HEAD_DIM)[None, :]
    if ROTARY == 1:  # pairs (2j, 2j + 1): the row split into its even and odd elements
        x = tl.load(src_rows[:, None] + dims[None, :], mask=mask).to(tl.float32)
        even, odd = tl.split(tl.reshape(x, (x.shape[0], HEAD_DIM_PAD // 2, 2)))
        pair = tl.arange(0, HEAD_DIM_PAD // 2)
        turn = rotate_ok[:, None] & (pair < ROTARY_HALF)[None, :]
        cos = tl.load(COS + angle_rows[:, None] + pair[None, :], mask=turn, other=1.0).to(tl.float32)
        sin = tl.load(SIN + angle_rows[:, None] + pair[None, :], mask=turn, other=0.0).to(tl.float32)
        x = tl.reshape(tl.join(even * cos - odd * sin, odd * cos + even * sin), (x.shape[0], HEAD_DIM_PAD))
        tl.store(dst_rows[:, None] + dims[None, :], x.to(dst_rows.dtype.element_ty), mask=mask)
    elif ROTARY == 2:  # pairs (j, j + ROTARY_HALF): the two halves loaded apart, the dims past them as they are
        half = tl.arange(0, ROTARY_HALF_PAD)
        in_half = row_ok[:, None] & (half < ROTARY_HALF)[None, :]
        first = src_rows[:, None] + half[None, :]
        x1 = tl.load(first, mask=in_half).to(tl.float32)
        x2 = tl.load(first + ROTARY_HALF, mask=in_half).to(tl.float32)
        turn = in_half & rotate_ok[:, None]
        cos = tl.load(COS + angle_rows[:, None] + half[None, :], mask=turn, other=1.0).to(tl.float32)
        sin = tl.load(SIN + angle_rows[:, None] + half[None, :], mask=turn, other=0.0).to(tl.float32)
        out = dst_rows[:, None] + half[None, :]
        tl.store(out, (x1 * cos - x2 * sin).to(dst_rows.dtype.element_ty), mask=in_half)
        tl.store(out + ROTARY_HALF, (x2 * cos + x1 * sin).to(dst_rows.dtype.element_ty), mask=in_half)
        if 2 * ROTARY_HALF < HEAD_DIM:
            tail = mask & (dims >= 2 * ROTARY_HALF)[None, :]
            tl.store(dst_rows[:, None] + dims[None, :], tl.load(src_rows[:, None] + dims[None, :], mask=tail),
                     mask=tail)
    else:
        tl.store(dst_rows[:, None] + dims[None, :], tl.load(src_rows[:, None] + dims[None, :], mask=mask), mask=mask)


@triton.jit
def _sequence_of(CU_SEQLENS, token, sequences, search_steps):
    """The sequence each packed token belongs to: the last b < sequences with CU_SEQLENS[b] <= token (so an empty
    sequence never owns one), found in search_steps halvings (2 ** search_steps >= sequences)."""
    sequence = token * 0
    for i in range(search_steps):
        candidate = sequence + (1 << (search_steps - 1 - i))
        first = tl.load(CU_SEQLENS + tl.minimum(candidate, sequences - 1))
        sequence = tl.where((candidate < sequences) & (first <= token), candidate, sequence)
    return sequence


# Launched through launch.CompiledLaunch. The strides stay specialised, cos / sin's too: a row stride divisible by
# 16 lets each thread move 16 bytes at once. The sizes need no specialisation, and the index tensors may be
# unaligned.
@triton.jit(do_not_specialize=["stride_bt", "start", "seqlen", "heads", "capacity", "page_size", "seqlen_ro",
                               "sequences", "search_steps"],
            do_not_specialize_on_alignment=["STARTS", "BLOCK_TABLE", "CACHE_BATCH_IDX", "CU_SEQLENS", "SEQLENS_OUT"])
def rows_kernel(SRC, DST, SRC2, DST2, STARTS, BLOCK_TABLE, CACHE_BATCH_IDX, CU_SEQLENS, SEQLENS_OUT, COS, SIN,
                stride_sb, stride_ss, stride_sh, stride_s2b, stride_s2s, stride_s2h,
                stride_dp, stride_ds, stride_dh, stride_d2p, stride_d2s, stride_d2h, stride_bt, stride_ro,
                start, seqlen, heads, capacity, page_size, seqlen_ro, sequences, search_steps,
                ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, PAGED: tl.constexpr,
                HAS_BATCH_IDX: tl.constexpr, PER_SEQUENCE_START: tl.constexpr, HAS_SECOND: tl.constexpr,
                ROTARY: tl.constexpr, ROTARY_HALF: tl.constexpr, ROTARY_HALF_PAD: tl.constexpr,
                AT_CACHE_POSITION: tl.constexpr, ROTATE_PER_TOKEN: tl.constexpr, PACKED: tl.constexpr,
                WRITE_SEQLENS: tl.constexpr):
    # Program (r, b): sequence b's (token, head) rows [r * ROWS, (r + 1) * ROWS) of SRC (batch, seqlen, heads,
    # head_dim), token t at cache position STARTS[b] (or start) + t. Written to DST at that position
    # (AT_CACHE_POSITION: a cache, through block_table where PAGED) or at t (a tensor like SRC); SRC2 likewise
    # into DST2, unrotated (the values beside the keys). Rows whose entry passes capacity (a length the caller
    # did not have checked) are skipped rather than written past the cache; so are rotations past cos's rows.
    # PACKED: SRC holds every sequence's tokens along one dim (seqlen of them in all; batch strides 0), sequence
    # b's from CU_SEQLENS[b]; program (r, 0) takes rows [r * ROWS, (r + 1) * ROWS) of them all, each row finding
    # its sequence, and a DST like SRC is written at the packed token. WRITE_SEQLENS (PACKED): program 0 also
    # writes each sequence's length after the append to SEQLENS_OUT, which attention then reads: no extra launch.
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    src_token = (rows // heads).to(tl.int64)
    head = rows % heads
    if PACKED:
        batch = _sequence_of(CU_SEQLENS, src_token, sequences, search_steps)
        token = src_token - tl.load(CU_SEQLENS + batch)
    else:
        batch = tl.program_id(1)
        token = src_token
    if PER_SEQUENCE_START:
        first = tl.load(STARTS + batch).to(tl.int64)
    else:
        first = start.to(tl.int64)
    position = first + token
    entry = position if AT_CACHE_POSITION else src_token
    row_ok = (src_token < seqlen) & (entry < capacity)
    if PAGED:
        page = tl.load(BLOCK_TABLE + batch * stride_bt + entry // page_size, mask=row_ok, other=0).to(tl.int64)
        entry = entry % page_size
    elif HAS_BATCH_IDX:
        page = tl.load(CACHE_BATCH_IDX + batch).to(tl.int64)
    else:
        page = batch.to(tl.int64)
    batch = batch.to(tl.int64)
    angle_position = position if ROTATE_PER_TOKEN else first + token * 0
    src_rows = SRC + batch * stride_sb + src_token * stride_ss + head * stride_sh
    dst_rows = DST + page * stride_dp + entry * stride_ds + head * stride_dh
    _copy_rows(src_rows, dst_rows, row_ok, COS, SIN, angle_position * stride_ro, angle_position < seqlen_ro, HEAD_DIM,
               HEAD_DIM_PAD, ROTARY, ROTARY_HALF, ROTARY_HALF_PAD)
    if HAS_SECOND:
        _copy_rows(SRC2 + batch * stride_s2b + src_token * stride_s2s + head * stride_s2h,
                   DST2 + page * stride_d2p + entry * stride_d2s + head * stride_d2h, row_ok, COS, SIN, 0, row_ok,
                   HEAD_DIM, HEAD_DIM_PAD, 0, 0, 1)
    if WRITE_SEQLENS and tl.program_id(0) == 0:
        for first_sequence in range(0, sequences, ROWS):
            sequence = first_sequence + tl.arange(0, ROWS)
            in_batch = sequence < sequences
            appended = tl.load(CU_SEQLENS + sequence + 1, mask=in_batch) - tl.load(CU_SEQLENS + sequence, mask=in_batch)
            before = tl.load(STARTS + sequence, mask=in_batch) if PER_SEQUENCE_START else start
            tl.store(SEQLENS_OUT + sequence, before + appended, mask=in_batch)


def rotate_and_append_reference(q, k_cache, v_cache, k, v, cache_seqlens, block_table, cache_batch_idx, rotary):
    """PyTorch's form of rotate_and_append (same arguments and result)."""
    if rotary is not None:
        first = (torch.full((1, 1), cache_seqlens, device=q.device) if isinstance(cache_seqlens, int)
                 else cache_seqlens[:, None].long())  # (batch or 1, 1)
        k = rotate(k, rotary.cos, rotary.sin, first + torch.arange(k.shape[1], device=q.device), rotary.interleaved)
        q_positions = first + torch.arange(q.shape[1], device=q.device) if rotary.per_query_token else first
        q = rotate(q, rotary.cos, rotary.sin, q_positions, rotary.interleaved)
    if k is None or not k.shape[1]:
        return q
    if isinstance(cache_seqlens, int):  # one position for every sequence of a contiguous cache
        k_cache[:, cache_seqlens:cache_seqlens + k.shape[1]] = k
        v_cache[:, cache_seqlens:cache_seqlens + v.shape[1]] = v
        return q
    positions = cache_seqlens[:, None] + size_index(arange, k.shape[1], device=k.device)  # int64
    if block_table is None:
        rows = cache_batch_idx.long() if cache_batch_idx is not None else size_index(arange, k.shape[0],
                                                                                     device=k.device)
        index = (rows[:, None], positions)  # broadcast against each other
    else:
        page_size = k_cache.shape[1]
        index = (block_table.long().gather(1, positions // page_size), positions % page_size)
    k_cache.index_put_(index, k)
    v_cache.index_put_(index, v)
    return q


def rotate_and_append(q, k_cache, v_cache, k, v, cache_seqlens, block_table, cache_batch_idx, rotary, triton_path):
    """Rotate q and k (rotary) and write k, v into the caches at positions cache_seqlens[b] + i.

    Args:
        q: (batch, seqlen_q, heads_q, head_dim); k, v: (batch, seqlen_new, heads_kv, head_dim) or None.
        cache_seqlens: an int (one position for every sequence of a contiguous cache) or int32 (batch,).
        block_table: int32 (batch, max_blocks) for a paged cache (num_pages, page_size, heads_kv, head_dim), or None.
        cache_batch_idx: int32 (batch,), the cache row of each sequence (a contiguous cache), or None.
        rotary: a Rotary, or None.
        triton_path: whether the Triton kernels serve the call; otherwise, in a traced graph and where a tensor's
            last dim is strided, PyTorch's form runs.
    Returns:
        q, rotated where rotary applies (a new tensor), else q itself.
    """
    if k is None and rotary is None:
        return q
    if not _kernel_serves(triton_path, rotary, q, k_cache, v_cache, k, v) or rotary is None and isinstance(
            cache_seqlens, int):  # then the append is two slice copies
        return rotate_and_append_reference(q, k_cache, v_cache, k, v, cache_seqlens, block_table, cache_batch_idx,
                                           rotary)
    if k is not None and k.shape[1]:
        paged = block_table is not None
        _launch_rows(k, k_cache, v, v_cache, cache_seqlens, rotary, True,
                     block_table.shape[1] * k_cache.shape[1] if paged else k_cache.shape[1],
                     k_cache.shape[1] if paged else 1, block_table=block_table, cache_batch_idx=cache_batch_idx)
    if rotary is None:
        return q
    rotated = torch.empty_like(q, memory_format=torch.contiguous_format)
    _launch_rows(q, rotated, None, None, cache_seqlens, rotary, rotary.per_query_token, q.shape[1],
                 at_cache_position=False)
    return rotated


def packed_positions(starts, cu_seqlens, total, within=True):
    """(sequence, cache position) of each of ``total`` packed tokens, int64: sequence b's token i at
    starts[b] + i, or at starts[b] itself where not ``within``."""
    token = torch.arange(total, device=starts.device)
    seq = torch.searchsorted(cu_seqlens[1:], token.to(torch.int32), right=True)
    return seq, starts[seq].long() + (token - cu_seqlens[seq].long() if within else 0)


def rotate_and_append_packed_reference(q, k_cache, v_cache, k, v, cache_seqlens, block_table, cu_seqlens_q,
                                       cu_seqlens_k_new, rotary):
    """PyTorch's form of rotate_and_append_packed (same arguments and results)."""
    starts = (cache_seqlens if isinstance(cache_seqlens, torch.Tensor)
              else torch.full((cu_seqlens_q.numel() - 1,), cache_seqlens, dtype=torch.int32, device=q.device))
    seqlens = starts + cu_seqlens_k_new.diff()
    seq, positions = packed_positions(starts, cu_seqlens_k_new, k.shape[0])
    if rotary is not None:
        k = rotate(k[None], rotary.cos, rotary.sin, positions[None], rotary.interleaved)[0]
        q_positions = packed_positions(starts, cu_seqlens_q, q.shape[0], within=rotary.per_query_token)[1]
        q = rotate(q[None], rotary.cos, rotary.sin, q_positions[None], rotary.interleaved)[0]
    index = (block_table.long()[seq, positions // k_cache.shape[1]], positions % k_cache.shape[1])
    k_cache.index_put_(index, k)
    v_cache.index_put_(index, v)
    return q, seqlens


def rotate_and_append_packed(q, k_cache, v_cache, k, v, cache_seqlens, block_table, cu_seqlens_q, cu_seqlens_k_new,
                             rotary, triton_path):
    """rotate_and_append for flash-attn 3's packed tokens: sequence b's new keys and values, rows
    cu_seqlens_k_new[b]:cu_seqlens_k_new[b + 1], written at its cache positions cache_seqlens[b] + i (rotated
    there first), its queries (from cu_seqlens_q[b]) rotated from cache_seqlens[b] on.

    Args:
        q: (total_q, heads_q, head_dim); k, v: (total_new, heads_kv, head_dim).
        k_cache, v_cache: page pools (num_pages, page_size, heads_kv, head_dim) read through block_table (batch,
            pages per sequence); a contiguous cache is one page per sequence.
        cache_seqlens: an int (one start for all) or int32 (batch,).
        rotary, triton_path: as rotate_and_append's.
    Returns:
        q, rotated where rotary applies (a new tensor), else q itself; each sequence's entries after the append,
        int32 (batch,) (cache_seqlens itself where nothing is appended).
    """
    if not _kernel_serves(triton_path, rotary, q, k_cache, v_cache, k, v):
        return rotate_and_append_packed_reference(q, k_cache, v_cache, k, v, cache_seqlens, block_table, cu_seqlens_q,
                                                  cu_seqlens_k_new, rotary)
    seqlens = cache_seqlens
    if k.shape[0]:
        seqlens = torch.empty(cu_seqlens_k_new.numel() - 1, dtype=torch.int32, device=k.device)
        _launch_rows(k, k_cache, v, v_cache, cache_seqlens, rotary, True, block_table.shape[1] * k_cache.shape[1],
                     k_cache.shape[1], block_table=block_table, cu_seqlens=cu_seqlens_k_new, seqlens_out=seqlens)
    if rotary is None or not q.shape[0]:
        return q, seqlens
    rotated = torch.empty_like(q, memory_format=torch.contiguous_format)
    _launch_rows(q, rotated, None, None, cache_seqlens, rotary, rotary.per_query_token, q.shape[0],
                 at_cache_position=False, cu_seqlens=cu_seqlens_q)
    return rotated, seqlens


def _kernel_serves(triton_path, rotary, *tensors):
    """Whether rows_kernel serves a call: on the Triton path, outside a traced graph, every last dim dense."""
    tensors += () if rotary is None else (rotary.cos, rotary.sin)
    return (triton_path and not torch.compiler.is_compiling()
            and all(t.stride(-1) == 1 for t in tensors if t is not None))


def _row_strides(t):
    """(batch, token, head) strides of a (batch, tokens, heads, head_dim) tensor or of packed (tokens, heads,
    head_dim) rows (batch stride 0)."""
    return t.stride()[:3] if t.dim() == 4 else (0, *t.stride()[:2])


def _launch_rows(src, dst, src2, dst2, cache_seqlens, rotary, rotate_per_token, capacity, page_size=1,
                 block_table=None, cache_batch_idx=None, cu_seqlens=None, at_cache_position=True, seqlens_out=None):
    """One rows_kernel launch over src's rows (and src2's, unrotated, into dst2); None leaves an option out.

    Args:
        src: (batch, seqlen, heads, head_dim), or packed (total, heads, head_dim) with cu_seqlens (batch + 1,).
        dst: a cache (num_pages or rows, entries, heads, head_dim) where at_cache_position, else shaped like src.
        cache_seqlens: each sequence's first cache position, an int or int32 (batch,).
        capacity, page_size: entries per sequence (those past it are not written), per block_table page.
        seqlens_out: int32 (batch,) to receive each sequence's first position plus its tokens (packed src only).
    """
    packed = cu_seqlens is not None
    seqlen, heads, head_dim = src.shape[-3:]
    batch = cu_seqlens.numel() - 1 if packed else src.shape[0]
    per_sequence = isinstance(cache_seqlens, torch.Tensor)
    unread = src  # pointer arguments the variant leaves unread
    cos, sin, rotary_args = (unread, unread, (0, 0, 0)) if rotary is None else (
        rotary.cos, rotary.sin, (rotary.cos.stride(0), rotary.cos.shape[0], rotary.cos.shape[1]))
    src2, dst2 = (src2, dst2) if src2 is not None else (src, dst)
    launcher(rows_kernel, (cdiv(seqlen * heads, ROWS), 1 if packed else batch))(
        src, dst, src2, dst2, cache_seqlens if per_sequence else unread,
        *(t if t is not None else unread for t in (block_table, cache_batch_idx, cu_seqlens, seqlens_out)), cos, sin,
        *_row_strides(src), *_row_strides(src2), *_row_strides(dst), *_row_strides(dst2),
        block_table.stride(0) if block_table is not None else 0, rotary_args[0], 0 if per_sequence else cache_seqlens,
        seqlen, heads, capacity, page_size, rotary_args[1], batch, (batch - 1).bit_length() if packed else 0,
        ROWS=ROWS, HEAD_DIM=head_dim, HEAD_DIM_PAD=next_power_of_2(head_dim), PAGED=block_table is not None,
        HAS_BATCH_IDX=cache_batch_idx is not None, PER_SEQUENCE_START=per_sequence, HAS_SECOND=src2 is not src,
        ROTARY=NO_ROTARY if rotary is None else INTERLEAVED if rotary.interleaved else HALVES,
        ROTARY_HALF=rotary_args[2], ROTARY_HALF_PAD=next_power_of_2(max(1, rotary_args[2])),
        AT_CACHE_POSITION=at_cache_position, ROTATE_PER_TOKEN=rotate_per_token, PACKED=packed,
        WRITE_SEQLENS=seqlens_out is not None, num_warps=4)
