"""The append of flash_attn_with_kvcache: new keys and values written into the cache at each sequence's
cache length, before attention reads them.

With per-sequence (tensor) lengths the positions live on the device. PyTorch's form (``append_reference``: one
add and two index_put_ calls, ~30 µs of host time per call) is what a traced graph and the PyTorch path run; the
Triton path launches ``append_kernel`` once for both caches instead, so that a decoding step in eager mode is not
held up by its host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .kvcache_packed import arange, size_index
from .launch import launcher
from .sizes import cdiv, next_power_of_2

APPEND_ROWS = 32  # (token, kv head) rows per program: 32 x head_dim 128 is 8 KB of each of k and v


# Launched through launch.CompiledLaunch. The strides stay specialised: a row stride divisible by 16 lets each
# thread move 16 bytes at once. The sizes need no specialisation, and the index tensors may be unaligned.
@triton.jit(do_not_specialize=["stride_bt", "seqlen_new", "heads_kv", "capacity", "page_size"],
            do_not_specialize_on_alignment=["CACHE_SEQLENS", "BLOCK_TABLE", "CACHE_BATCH_IDX"])
def append_kernel(K, V, K_CACHE, V_CACHE, CACHE_SEQLENS, BLOCK_TABLE, CACHE_BATCH_IDX,
                  stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                  stride_kcp, stride_kcs, stride_kch, stride_vcp, stride_vcs, stride_vch, stride_bt,
                  seqlen_new, heads_kv, capacity, page_size,
                  ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, PAGED: tl.constexpr,
                  HAS_BATCH_IDX: tl.constexpr):
    # Program (r, b): sequence b's (token, kv head) rows [r * ROWS, (r + 1) * ROWS), token t at cache
    # position CACHE_SEQLENS[b] + t. A position past the cache's capacity (a length the caller did not have
    # checked) is skipped rather than written past the cache.
    batch = tl.program_id(1)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    token = rows // heads_kv
    head = rows % heads_kv
    position = tl.load(CACHE_SEQLENS + batch).to(tl.int64) + token
    row_ok = (token < seqlen_new) & (position < capacity)
    if PAGED:  # a page pool: the page from block_table, the entry within it
        page = tl.load(BLOCK_TABLE + batch * stride_bt + position // page_size, mask=row_ok, other=0).to(tl.int64)
        entry = position % page_size
    else:  # a contiguous cache: row b, or cache_batch_idx[b]
        page = tl.load(CACHE_BATCH_IDX + batch).to(tl.int64) if HAS_BATCH_IDX else batch.to(tl.int64)
        entry = position
    dims = tl.arange(0, HEAD_DIM_PAD)
    mask = row_ok[:, None] & (dims[None, :] < HEAD_DIM)
    batch = batch.to(tl.int64)
    token = token.to(tl.int64)
    k = tl.load(K + (batch * stride_kb + token * stride_ks + head * stride_kh)[:, None] + dims[None, :], mask=mask)
    v = tl.load(V + (batch * stride_vb + token * stride_vs + head * stride_vh)[:, None] + dims[None, :], mask=mask)
    tl.store(K_CACHE + (page * stride_kcp + entry * stride_kcs + head * stride_kch)[:, None] + dims[None, :], k,
             mask=mask)
    tl.store(V_CACHE + (page * stride_vcp + entry * stride_vcs + head * stride_vch)[:, None] + dims[None, :], v,
             mask=mask)


def append_reference(k_cache, v_cache, k, v, cache_seqlens, block_table, cache_batch_idx):
    """PyTorch's append of k, v (batch, seqlen_new, heads_kv, head_dim) at positions cache_seqlens[b] + i (an int32
    tensor), of cache row cache_batch_idx[b] (b if None) for a contiguous cache, through block_table
    (batch, max_blocks) for a paged one."""
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


def append(k_cache, v_cache, k, v, cache_seqlens, block_table, cache_batch_idx, triton_path):
    """Write k, v (batch, seqlen_new, heads_kv, head_dim) into the caches at positions cache_seqlens[b] + i.

    Args:
        cache_seqlens: an int (one position for every sequence of a contiguous cache) or int32 (batch,).
        block_table: int32 (batch, max_blocks) for a paged cache (num_pages, page_size, heads_kv, head_dim), or None.
        cache_batch_idx: int32 (batch,), the cache row of each sequence (a contiguous cache), or None.
        triton_path: whether the Triton kernels serve the call; otherwise, and in a traced graph or where a
            tensor's last dim is strided, PyTorch's form runs.
    """
    if isinstance(cache_seqlens, int):
        k_cache[:, cache_seqlens:cache_seqlens + k.shape[1]] = k
        v_cache[:, cache_seqlens:cache_seqlens + v.shape[1]] = v
        return
    if (not triton_path or torch.compiler.is_compiling()
            or any(t.stride(-1) != 1 for t in (k_cache, v_cache, k, v))):
        append_reference(k_cache, v_cache, k, v, cache_seqlens, block_table, cache_batch_idx)
        return
    batch, seqlen_new, heads_kv, head_dim = k.shape
    paged = block_table is not None
    capacity = block_table.shape[1] * k_cache.shape[1] if paged else k_cache.shape[1]
    grid = (cdiv(seqlen_new * heads_kv, APPEND_ROWS), batch)
    # Unused pointer arguments take cache_seqlens, which the kernel never reads through them.
    launcher(append_kernel, grid)(
        k, v, k_cache, v_cache, cache_seqlens, block_table if paged else cache_seqlens,
        cache_batch_idx if cache_batch_idx is not None else cache_seqlens,
        *k.stride()[:3], *v.stride()[:3], *k_cache.stride()[:3], *v_cache.stride()[:3],
        block_table.stride(0) if paged else 0, seqlen_new, heads_kv, capacity, k_cache.shape[1] if paged else 1,
        ROWS=APPEND_ROWS, HEAD_DIM=head_dim, HEAD_DIM_PAD=next_power_of_2(head_dim), PAGED=paged,
        HAS_BATCH_IDX=cache_batch_idx is not None, num_warps=4)
