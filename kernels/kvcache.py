"""``flash_attn_with_kvcache``: decoding attention against a KV cache, flash-attn's API.

The checks (kvcache_checks.py), rotary and the append of new keys/values into the cache (cache_append.py), and the
path choice of interface.kernel_impl: the split-KV Triton kernel of decode.py, or a PyTorch loop over sequences on the tiled
reference.
"""

from __future__ import annotations

from typing import Optional

import torch

from .cache_append import Rotary, rotate_and_append
from .cache_pages import PAGE_MULTIPLE, check_rotary
from .checks import autocast_inputs, check_alibi, check_attention_args, describe, kernel_head_dim
from .decode import decode_attention, dense_forward_pays
from .interface import kernel_impl, triton_attention
from .kvcache_checks import (CHECKED_CALLS, CheckedCall, cache_capacity, call_signature, check_cache_lengths,
                             check_kvcache_args, keep_checked_call)
from .kvcache_packed import kvcache_packed_queries, prefill_over_cache, rows_flatten
from .masking import normalize_window
from .reference import attention_tiled
from .sizes import HEAD_DIM_MULTIPLE, MAX_HEAD_DIM, MIN_HEAD_DIM


def _kvcache_impl(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seqlens_k: torch.Tensor,
                  block_table: Optional[torch.Tensor], max_seqlen_k: int, softmax_scale: float, window_left: int,
                  window_right: int, softcap: float, num_splits: int,
                  alibi_slopes: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return decode_attention(q, k_cache, v_cache, seqlens_k, block_table, max_seqlen_k, softmax_scale,
                            window_left, window_right, softcap, num_splits, alibi_slopes=alibi_slopes)


# Eagerly the launcher is called directly; torch.compile sees the op (see interface.py for why).
_kvcache_fwd = torch.library.custom_op("flashformer::flash_attn_kvcache_fwd", _kvcache_impl, mutates_args=())


@_kvcache_fwd.register_fake
def _(q, k_cache, v_cache, seqlens_k, block_table, max_seqlen_k, softmax_scale, window_left, window_right, softcap,
      num_splits, alibi_slopes):
    batch, seqlen_q, heads_q, _ = q.shape
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty(
        (batch, heads_q, seqlen_q), dtype=torch.float32)


def _kvcache_torch(q, k_cache, v_cache, spans, block_table, softmax_scale, window_left, window_right, softcap,
                   alibi_slopes):
    """The PyTorch path: per sequence, gather its valid cache entries and run the tiled reference.

    Args:
        spans: per sequence (cache row, first valid entry, end after the append), host ints; the
            row and first entry are 0-based indices into a contiguous cache (0 for a paged one).
            Other args as flash_attn_with_kvcache.
    Returns:
        out like q, lse fp32 (batch, heads_q, seqlen_q).
    """
    batch, seqlen_q, heads_q, _ = q.shape
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = q.new_empty((batch, heads_q, seqlen_q), dtype=torch.float32)
    slopes = None if alibi_slopes is None else alibi_slopes.expand(batch, heads_q)
    for b, (row, start, end) in enumerate(spans):
        if block_table is None:
            k, v = k_cache[row, start:end], v_cache[row, start:end]
        else:
            pages = block_table[b, :-(-end // k_cache.shape[1])]
            k, v = k_cache[pages].flatten(0, 1)[:end], v_cache[pages].flatten(0, 1)[:end]
        out[b:b + 1], lse[b:b + 1] = attention_tiled(q[b:b + 1], k[None], v[None], softmax_scale, window_left,
                                                     window_right, softcap, None if slopes is None else slopes[b:b + 1])
    return out, lse


# Pages of the decode kernel's paged view onto a contiguous cache (_rows_as_pages): the widest tile the
# kernel would read from a contiguous cache anyway, or less for a cache with fewer rows.
ROW_PAGE_SIZE = 64


def _rows_as_pages(k_cache, v_cache, cache_batch_idx, cache_leftpad, batch):
    """A contiguous cache whose sequence b lives in cache row cache_batch_idx[b] from entry
    cache_leftpad[b] on, as the paged cache (pool, block_table) that the decode kernel reads with no
    kernel of its own and no copy: the pool's page p is the ROW_PAGE_SIZE cache entries that start at
    flat entry p (pages overlap, one entry apart), and sequence b's page j starts at its first valid
    entry + j * ROW_PAGE_SIZE. Entries a page holds past the sequence's end are masked by its length.

    Returns:
        k_pool, v_pool (pages, page_size, heads_kv, head_dim) and block_table int32 (batch, pages per
        sequence), all on the caches' device.
    """
    def entry_stride(cache):  # cache entries from one sequence to the next, or None if not a whole number
        return cache.stride(0) // cache.stride(1) if cache.stride(0) % cache.stride(1) == 0 else None

    def addressable(cache):
        # What the launcher's tensor descriptors need (launch.as_descriptor_compatible), else it would copy
        # the pool: page_size times the cache. torch.compile traces strides but not the base address (a
        # compiled caller's cache is taken as allocated, 16-byte aligned).
        *outer, last = cache.stride()
        aligned = torch.compiler.is_compiling() or cache.data_ptr() % 16 == 0
        return last == 1 and aligned and all(s * cache.element_size() % 16 == 0 for s in outer)

    if not (addressable(k_cache) and addressable(v_cache)) or entry_stride(k_cache) is None \
            or entry_stride(k_cache) != entry_stride(v_cache):  # one block_table must address both
        k_cache, v_cache = (cache.clone(memory_format=torch.contiguous_format) for cache in (k_cache, v_cache))
    sequence_entries, capacity = entry_stride(k_cache), k_cache.shape[1]
    entries = (k_cache.shape[0] - 1) * sequence_entries + capacity
    page_size = min(ROW_PAGE_SIZE, entries // PAGE_MULTIPLE * PAGE_MULTIPLE)  # entries >= PAGE_MULTIPLE: checked

    def pool(cache):
        return cache.as_strided((entries - page_size + 1, page_size, *cache.shape[2:]),
                                (cache.stride(1), *cache.stride()[1:]))

    rows = (cache_batch_idx.long() if cache_batch_idx is not None
            else torch.arange(batch, device=k_cache.device))
    first = rows * sequence_entries + (cache_leftpad.long() if cache_leftpad is not None else 0)
    pages = torch.arange(0, capacity, page_size, device=k_cache.device)
    return pool(k_cache), pool(v_cache), (first[:, None] + pages).int()


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
                            cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0, rotary_interleaved=True, alibi_slopes=None,
                            num_splits=0, return_softmax_lse=False, *, return_lse=False, check_lengths=None,
                            cu_seqlens_q=None, cu_seqlens_k_new=None, max_seqlen_q=None):
    """Attention of new query tokens over a KV cache, appending new keys/values first (flash-attn's API,
    its arguments, order and defaults).

    Inference only: raises if an input requires grad while grad mode is on.

    Args:
        q: (batch, seqlen_q, heads_q, head_dim); fp16, bf16 or fp32, the caches' dtype (under
            torch.autocast q, k, v are cast and the caches must hold the autocast dtype). seqlen_q may
            exceed 1 (speculative tokens, a prefill chunk), usually with k/v of as many tokens.
        k_cache, v_cache: (batch_cache, max_cache, heads_kv, head_dim), or paged (num_blocks,
            block_size, heads_kv, head_dim) with block_size a multiple of 16, addressed through
            block_table. The caches are read in place, so head_dim must be one the kernels take (a
            multiple of 8 in [16, 256]); for another, allocate them at the next such width with zeros
            beyond head_dim, pad q and k/v alike and pass softmax_scale = head_dim ** -0.5.
        k, v: optional (batch, seqlen_new, heads_kv, head_dim), written in place into the caches at
            positions cache_seqlens[b] ... cache_seqlens[b] + seqlen_new - 1 before attending.
        rotary_cos, rotary_sin: optional (seqlen_ro, rotary_dim / 2) with seqlen_ro >= max_cache
            (a paged cache: max_blocks * block_size) and rotary_dim <= head_dim; need k and v. The
            first rotary_dim dims of k are rotated at positions cache_seqlens[b] + i before the append;
            those of q likewise when causal or windowed, else every query token at cache_seqlens[b]
            (flash-attn's rule). Computed in fp32, in the append's kernel on the Triton path.
        cache_seqlens: int32 (batch,) or an int: the end of the entries already in each cache (before
            the append), counted from the cache's first entry even with cache_leftpad; None = the
            whole cache.
        cache_batch_idx: int32 (batch,): sequence b reads and appends cache row cache_batch_idx[b]
            (contiguous caches only); None = row b. Duplicate rows with k/v given append in no set order.
        cache_leftpad: int32 (batch,): sequence b's cache starts at entry cache_leftpad[b] (contiguous
            caches only): entries before it are never read, and causal / window alignment counts from
            it (its length is cache_seqlens[b] + seqlen_new - cache_leftpad[b]). Rotary positions do
            not: they stay cache_seqlens[b] + i, as in flash-attn.
        block_table: int32 (batch, max_blocks): page j of sequence b is k_cache[block_table[b, j]].
        causal: bottom-right aligned: query i sees cache positions j <= i + total_len - seqlen_q,
            where total_len = cache_seqlens[b] + seqlen_new. False (flash-attn's default): every query
            token sees every entry in use, which for one token per sequence is the same attention.
        softmax_scale, window_size, softcap, return_lse: as flash_attn_func.
        rotary_interleaved: True (flash-attn's default) rotates dims (0, 1), (2, 3), ...; False rotates
            (i, i + rotary_dim / 2), GPT-NeoX style.
        num_splits: chunks of the cache per (sequence, kv head) on the Triton path; 0 = automatic.
        return_softmax_lse: flash-attn's name for return_lse; either returns lse.
        check_lengths: which values are checked against the cache (lengths in [0, capacity - seqlen_new],
            a paged cache's pages in use inside the pool, cache_batch_idx's rows inside the cache,
            cache_leftpad in [0, cache_seqlens]). Shapes, dtypes and devices always are.
            None (the default): on the Triton path only what the host holds (an int or None
            cache_seqlens); tensors' values are trusted, unread: no host sync, as a decoding loop (and
            CUDA-graph capture) wants, and automatic splits sized for the whole cache. The PyTorch
            path, which reads the lengths anyway, checks them all. True: everything, at one host sync
            per call. False: as None, and an error on the PyTorch path rather than a read of device
            values.
        alibi_slopes: fp32 (heads_q,) or (batch, heads_q): ALiBi's bias -slope * |i + total_len - seqlen_q - j|
            for query i and cache position j (from cache_leftpad[b] where given), as flash-attn's.
        cu_seqlens_q, cu_seqlens_k_new, max_seqlen_q: flash-attn 3's packed form (continuous batching): q
            (total_q, heads_q, head_dim), sequence b's rows cu_seqlens_q[b]:cu_seqlens_q[b + 1] (int32, batch + 1),
            k / v (total_new, ...) by cu_seqlens_k_new; no cache_batch_idx, cache_leftpad or num_splits.
            out is then like q, lse (heads_q, total_q).
    Returns:
        out (batch, seqlen_q, heads_q, head_dim), or (out, lse) with lse (batch, heads_q, seqlen_q)
        fp32, -inf for a row that sees no cache entry (its output is 0).
    """
    return_lse = return_lse or return_softmax_lse
    if cu_seqlens_q is not None or cu_seqlens_k_new is not None or max_seqlen_q is not None:
        unsupported = dict(cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad, num_splits=num_splits or None)
        out, lse = kvcache_packed_queries(q, k_cache, v_cache, k, v, cache_seqlens, block_table, cu_seqlens_q,
                                          cu_seqlens_k_new, max_seqlen_q, softmax_scale, causal, window_size, softcap,
                                          alibi_slopes, check_lengths, rotary_cos, rotary_sin, rotary_interleaved,
                                          unsupported)
        return (out, lse) if return_lse else out
    signature = call_signature(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                                cache_leftpad, block_table, softmax_scale, causal, window_size, softcap,
                                rotary_interleaved, alibi_slopes, num_splits, check_lengths)
    checked = CHECKED_CALLS.get(signature) if signature is not None else None
    if checked is not None and (type(cache_seqlens) is not int or 0 <= cache_seqlens <= checked.max_cached):
        rotary = None if rotary_cos is None else Rotary(rotary_cos, rotary_sin, rotary_interleaved,
                                                        per_query_token=causal or window_size != (-1, -1))
        q = rotate_and_append(q, k_cache, v_cache, k, v, cache_seqlens, block_table, None, rotary, True)
        # a tensor's lengths are trusted unread (check_lengths): the kernel reads up to the capacity
        max_seqlen_k = (cache_seqlens if type(cache_seqlens) is int else checked.max_cached) + checked.seqlen_new
        out, lse = _decode_route(q, k_cache, v_cache, cache_seqlens, checked.seqlen_new, block_table, None, None,
                                 max_seqlen_k, checked.softmax_scale, checked.window_left, checked.window_right,
                                 checked.softcap, num_splits,
                                 None if alibi_slopes is None else alibi_slopes.contiguous(), return_lse)
    else:
        out, lse = _checked_call(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                                 cache_leftpad, block_table, softmax_scale, causal, window_size, softcap,
                                 rotary_interleaved, alibi_slopes, num_splits, return_lse, check_lengths, signature)
    return (out, lse) if return_lse else out


def _checked_call(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
                  block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes,
                  num_splits, return_lse, check_lengths, signature):
    """flash_attn_with_kvcache with every check; a call that reaches the decode kernel keeps what they derived
    under its signature (None: keeps nothing). Returns (out, lse), lse None where return_lse is False on CUDA."""
    tensors = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "k": k, "v": v}
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together (new keys and values to append) or both left None")
    if torch.is_grad_enabled() and any(getattr(t, "requires_grad", False) for t in tensors.values()):
        raise ValueError("flash_attn_with_kvcache is inference-only (no backward): an input requires grad; "
                         "call it under torch.no_grad() or torch.inference_mode()")
    for name, t in tensors.items():
        if t is not None and (not isinstance(t, torch.Tensor) or t.dim() != 4):
            raise ValueError(f"{name} must be a 4-D tensor, got {describe(t)}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must have the same shape, got {tuple(k_cache.shape)} and "
                         f"{tuple(v_cache.shape)}")
    if k is None:
        (q,) = autocast_inputs(q)
    else:
        q, k, v = autocast_inputs(q, k, v)
    # The dense checks (dtypes, device, head_dim, GQA heads, options); a paged cache's first dim is not the batch.
    softmax_scale, window_size = check_attention_args(q, k_cache, v_cache, 1, softmax_scale, window_size, softcap,
                                                      same_batch=False)
    alibi_slopes = check_alibi(q, q.shape[0], alibi_slopes)
    if k_cache.dtype != q.dtype:  # torch.autocast cast q (and k, v); the caches, written in place, stay as they are
        raise ValueError(f"k_cache and v_cache hold {k_cache.dtype} but q runs in {q.dtype} under torch.autocast: "
                         f"allocate the caches in {q.dtype} (they are read and appended to in place)")
    head_dim = k_cache.shape[-1]
    if kernel_head_dim(head_dim) != head_dim:
        raise ValueError(f"head_dim={head_dim}: flash_attn_with_kvcache reads the caches in place, so head_dim must "
                         f"be a multiple of {HEAD_DIM_MULTIPLE} in [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}] (flash_attn_func "
                         "pads other sizes; see the docstring for caches of another head_dim)")
    cache_seqlens, shared_length = check_kvcache_args(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx,
                                                       cache_leftpad, block_table, num_splits)
    check_rotary(rotary_cos, rotary_sin, rotary_interleaved, q, k, cache_capacity(k_cache, block_table))
    seqlen_new = 0 if k is None else k.shape[1]
    if check_lengths is not None and not isinstance(check_lengths, bool):
        raise ValueError(f"check_lengths must be a bool or None, got {check_lengths!r}")
    triton_path = kernel_impl(q.device) != "torch"
    device_values = shared_length is None or cache_batch_idx is not None or cache_leftpad is not None
    if not triton_path and device_values and check_lengths is False:
        raise ValueError("check_lengths=False needs the Triton path (the PyTorch path reads the lengths, "
                         "cache_batch_idx and cache_leftpad on the host)")
    ends, spans = check_cache_lengths(k_cache, cache_seqlens, shared_length, seqlen_new, block_table, cache_batch_idx,
                                 cache_leftpad, q.shape[0],
                                 read_device=check_lengths or (check_lengths is None and not triton_path))
    max_seqlen_k = cache_capacity(k_cache, block_table) if ends is None else max(ends, default=0)
    rotary = None if rotary_cos is None else Rotary(rotary_cos, rotary_sin, rotary_interleaved,
                                                    per_query_token=causal or window_size != (-1, -1))
    q = rotate_and_append(q, k_cache, v_cache, k, v, cache_seqlens, block_table, cache_batch_idx, rotary, triton_path)
    window_left, window_right = normalize_window(causal, window_size)
    if not triton_path:
        out, lse = _kvcache_torch(q, k_cache, v_cache, spans, block_table, softmax_scale, window_left,
                                  window_right, float(softcap), alibi_slopes)
        return out, lse
    # A prompt, or a long chunk of one, runs on a dense forward over the cache's entries in use where that pays:
    # an int is one length shared by all rows of a contiguous cache (check_kvcache_args), a tensor one per row
    # (or per sequence of a paged cache).
    dense = num_splits == 0 and dense_forward_pays(q.shape[0], q.shape[2], q.shape[1], q.device)
    if dense and isinstance(cache_seqlens, int) and cache_seqlens + seqlen_new:
        end = cache_seqlens + seqlen_new
        out, lse = triton_attention(q, k_cache[:, :end], v_cache[:, :end], None, None, alibi_slopes, None, 0, 0,
                                    softmax_scale, window_left, window_right, float(softcap), 0.0, True)
        return out, lse
    if dense and isinstance(cache_seqlens, torch.Tensor) and cache_batch_idx is None and cache_leftpad is None and (
            block_table is not None or rows_flatten(k_cache) and rows_flatten(v_cache)):
        out, lse = prefill_over_cache(q, k_cache, v_cache, block_table, cache_seqlens + seqlen_new, max_seqlen_k,
                                      softmax_scale, window_left, window_right, float(softcap), alibi_slopes)
        return out, lse.contiguous()
    if signature is not None and not dense:
        keep_checked_call(signature, CheckedCall(softmax_scale, window_left, window_right, float(softcap),
                                                 cache_capacity(k_cache, block_table) - seqlen_new, seqlen_new))
    return _decode_route(q, k_cache, v_cache, cache_seqlens, seqlen_new, block_table, cache_batch_idx, cache_leftpad,
                         max_seqlen_k, softmax_scale, window_left, window_right, float(softcap), num_splits,
                         alibi_slopes, return_lse)


def _decode_route(q, k_cache, v_cache, cache_seqlens, seqlen_new, block_table, cache_batch_idx, cache_leftpad,
                  max_seqlen_k, softmax_scale, window_left, window_right, softcap, num_splits, alibi_slopes,
                  return_lse):
    """The decode kernel over the caches, their new entries already appended (arguments as checked)."""
    compiling, keys_appended = torch.compiler.is_compiling(), 0
    if isinstance(cache_seqlens, int):  # eagerly the launcher takes the shared length as an int
        seqlens_k = cache_seqlens + seqlen_new
        if compiling:  # the op's schema wants a tensor
            seqlens_k = torch.full((q.shape[0],), seqlens_k, dtype=torch.int32, device=q.device)
    elif compiling or cache_leftpad is not None:
        seqlens_k = cache_seqlens + seqlen_new if seqlen_new else cache_seqlens
    else:  # eagerly the kernel adds the new keys to each length
        seqlens_k, keys_appended = cache_seqlens, seqlen_new
    if cache_batch_idx is not None or cache_leftpad is not None:
        k_cache, v_cache, block_table = _rows_as_pages(k_cache, v_cache, cache_batch_idx, cache_leftpad, q.shape[0])
        if cache_leftpad is not None:
            seqlens_k = seqlens_k - cache_leftpad
    args = (q, k_cache, v_cache, seqlens_k, block_table, max_seqlen_k, softmax_scale, window_left, window_right,
            softcap, num_splits)
    if compiling:
        out, lse = _kvcache_fwd(*args, alibi_slopes)
    else:  # eagerly straight to the launcher, which then needs no lse buffer unless one is asked for
        out, lse = decode_attention(*args, return_lse=return_lse, keys_appended=keys_appended,
                                    alibi_slopes=alibi_slopes)
    return out, lse
