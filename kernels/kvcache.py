"""``flash_attn_with_kvcache``: decoding attention against a KV cache, flash-attn's API.

Argument checks, the append of new keys/values into the cache (torch index_put, one implementation
for both paths and both cache layouts), and the path choice of interface.kernel_impl: the split-KV
Triton kernel of decode.py, or a PyTorch loop over sequences on the tiled reference.
"""

from __future__ import annotations

from typing import Optional

import torch

from .interface import autocast_inputs, check_attention_args, kernel_impl
from .masking import normalize_window
from .reference import attention_tiled

PAGE_MULTIPLE = 16  # a page must hold whole 16-key tiles (tl.dot's smallest K dimension)


def _kvcache_impl(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seqlens_k: torch.Tensor,
                  block_table: Optional[torch.Tensor], max_seqlen_k: int, softmax_scale: float, window_left: int,
                  window_right: int, softcap: float, num_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    from .decode import decode_attention

    return decode_attention(q, k_cache, v_cache, seqlens_k, block_table, max_seqlen_k, softmax_scale,
                            window_left, window_right, softcap, num_splits)


# Eagerly the launcher is called directly; torch.compile sees the op (see interface.py for why).
_kvcache_fwd = torch.library.custom_op("flashformer::flash_attn_kvcache_fwd", _kvcache_impl, mutates_args=())


@_kvcache_fwd.register_fake
def _(q, k_cache, v_cache, seqlens_k, block_table, max_seqlen_k, softmax_scale, window_left, window_right, softcap,
      num_splits):
    batch, seqlen_q, heads_q, _ = q.shape
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty(
        (batch, heads_q, seqlen_q), dtype=torch.float32)


def _kvcache_torch(q, k_cache, v_cache, lengths, block_table, softmax_scale, window_left, window_right, softcap):
    """The PyTorch path: per sequence, gather its valid cache prefix and run the tiled reference.

    Args:
        lengths: valid cache entries per sequence (host ints). Other args as flash_attn_with_kvcache.
    Returns:
        out like q, lse fp32 (batch, heads_q, seqlen_q).
    """
    batch, seqlen_q, heads_q, _ = q.shape
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = q.new_empty((batch, heads_q, seqlen_q), dtype=torch.float32)
    for b, length in enumerate(lengths):
        if block_table is None:
            k, v = k_cache[b, :length], v_cache[b, :length]
        else:
            pages = block_table[b, :-(-length // k_cache.shape[1])]
            k, v = k_cache[pages].flatten(0, 1)[:length], v_cache[pages].flatten(0, 1)[:length]
        out[b:b + 1], lse[b:b + 1] = attention_tiled(q[b:b + 1], k[None], v[None], softmax_scale, window_left,
                                                     window_right, softcap)
    return out, lse


def _append(k_cache, v_cache, k, v, cache_seqlens, block_table):
    """Write k, v (batch, seqlen_new, heads_kv, head_dim) into the caches at positions
    cache_seqlens[b] + i, through block_table (batch, max_blocks) for a paged cache."""
    if isinstance(cache_seqlens, int):  # one position for every sequence of a contiguous cache
        k_cache[:, cache_seqlens:cache_seqlens + k.shape[1]] = k
        v_cache[:, cache_seqlens:cache_seqlens + v.shape[1]] = v
        return
    positions = cache_seqlens[:, None].long() + torch.arange(k.shape[1], device=k.device)
    if block_table is None:
        index = (torch.arange(k.shape[0], device=k.device)[:, None].expand_as(positions), positions)
    else:
        page_size = k_cache.shape[1]
        index = (block_table.long().gather(1, positions // page_size), positions % page_size)
    k_cache.index_put_(index, k)
    v_cache.index_put_(index, v)


def _check_kvcache_args(q, k_cache, v_cache, k, v, cache_seqlens, block_table, num_splits):
    """Validate everything that needs no device values; return (cache_seqlens as the kernels and the
    append take it: an int for a contiguous cache, else int32 (batch,) on q's device; the length shared
    by every sequence when the host knows it, else None)."""
    batch = q.shape[0]
    if block_table is None:
        if k_cache.shape[0] != batch:
            raise ValueError(f"k_cache holds {k_cache.shape[0]} sequences but q has batch {batch}; a paged cache "
                             "(num_blocks, block_size, heads_kv, head_dim) needs block_table")
    else:
        if not isinstance(block_table, torch.Tensor) or block_table.dtype != torch.int32 or block_table.dim() != 2:
            raise ValueError(f"block_table must be an int32 tensor (batch, max_blocks), got {_describe(block_table)}")
        if block_table.shape[0] != batch or block_table.device != q.device:
            raise ValueError(f"block_table must be (batch={batch}, max_blocks) on {q.device}, got "
                             f"{_describe(block_table)}")
        if k_cache.shape[1] % PAGE_MULTIPLE:
            raise ValueError(f"k_cache block_size={k_cache.shape[1]} (dim 1 of a paged cache) must be a multiple "
                             f"of {PAGE_MULTIPLE}")
    if k is not None and k.shape[2:] != k_cache.shape[2:]:
        raise ValueError(f"k has (heads_kv, head_dim) = {tuple(k.shape[2:])} but k_cache has {tuple(k_cache.shape[2:])}")
    if not isinstance(num_splits, int) or isinstance(num_splits, bool) or num_splits < 0:
        raise ValueError(f"num_splits must be an int >= 0 (0 = automatic), got {num_splits!r}")
    if cache_seqlens is None:  # as flash-attn: the whole cache is valid
        cache_seqlens = _capacity(k_cache, block_table)
    if isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        if block_table is None:  # kept on the host: the kernel takes it as an int, the append slices
            return cache_seqlens, cache_seqlens
        return torch.full((batch,), cache_seqlens, dtype=torch.int32, device=q.device), cache_seqlens
    if (not isinstance(cache_seqlens, torch.Tensor) or cache_seqlens.dtype != torch.int32
            or cache_seqlens.shape != (batch,) or cache_seqlens.device != q.device):
        raise ValueError(f"cache_seqlens must be an int or an int32 tensor of shape (batch={batch},) on {q.device}, "
                         f"got {_describe(cache_seqlens)}")
    return cache_seqlens, None


def _check_lengths(k_cache, cache_seqlens, shared_length, seqlen_new, block_table, batch, read_device):
    """Validate the lengths and, with read_device, a paged cache's pages in use; return the valid entries
    per sequence after the append as host ints, or None for lengths only the device holds when
    read_device is False. Only read_device reads the device (one host sync for everything)."""
    if shared_length is not None:  # the host knows every length: no read for them
        lengths = [shared_length + seqlen_new] * batch
        _check_length_values(k_cache, lengths, seqlen_new, block_table)
        if read_device and block_table is not None:
            _raise_for_bad_pages(_bad_pages(k_cache, block_table, cache_seqlens + seqlen_new).item(), k_cache)
        return lengths
    if not read_device:
        return None
    lengths_t = cache_seqlens + seqlen_new
    bad_pages = torch.zeros((), dtype=torch.int32, device=cache_seqlens.device)
    if block_table is not None:
        bad_pages = _bad_pages(k_cache, block_table, lengths_t)
    bad, *lengths = torch.cat([bad_pages.view(1).int(), lengths_t]).tolist()
    _check_length_values(k_cache, lengths, seqlen_new, block_table)
    _raise_for_bad_pages(bad, k_cache)
    return lengths


def _bad_pages(k_cache, block_table, lengths_t):
    """How many block_table entries among the pages in use lie outside the pool (a 0-d device tensor).
    Only the pages in use must be valid: the rest of a row may hold anything (as in flash-attn)."""
    pages_used = (lengths_t.clamp(min=0)[:, None] + k_cache.shape[1] - 1) // k_cache.shape[1]
    in_use = torch.arange(block_table.shape[1], device=block_table.device) < pages_used
    return (((block_table < 0) | (block_table >= k_cache.shape[0])) & in_use).sum()


def _raise_for_bad_pages(bad, k_cache):
    if bad:
        raise ValueError(f"block_table has {bad} entries outside [0, num_blocks={k_cache.shape[0]}) among the pages "
                         "in use")


def _check_length_values(k_cache, lengths, seqlen_new, block_table):
    capacity = _capacity(k_cache, block_table)
    for b, length in enumerate(lengths):
        if length < seqlen_new:
            raise ValueError(f"cache_seqlens[{b}] = {length - seqlen_new} is negative")
        if length > capacity:
            raise ValueError(f"k_cache is too small: sequence {b} needs {length} entries ({length - seqlen_new} "
                             f"cached + {seqlen_new} new) but holds {capacity}")


def _capacity(k_cache, block_table):
    """Entries one sequence's cache can hold."""
    return k_cache.shape[1] if block_table is None else block_table.shape[1] * k_cache.shape[1]


def _describe(x):
    if isinstance(x, torch.Tensor):
        return f"{x.dtype} tensor of shape {tuple(x.shape)} on {x.device}"
    return repr(x)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, block_table=None, causal=True,
                            softmax_scale=None, window_size=(-1, -1), softcap=0.0, return_lse=False, num_splits=0,
                            check_lengths=None, alibi_slopes=None):
    """Attention of new query tokens over a KV cache, appending new keys/values first (flash-attn's API).

    Inference only: raises if an input requires grad while grad mode is on.

    Args:
        q: (batch, seqlen_q, heads_q, head_dim); fp16, bf16 or fp32, the caches' dtype.
        k_cache, v_cache: (batch, max_cache, heads_kv, head_dim), or paged (num_blocks, block_size,
            heads_kv, head_dim) with block_size a multiple of 16, addressed through block_table.
        k, v: optional (batch, seqlen_new, heads_kv, head_dim), written in place into the caches at
            positions cache_seqlens[b] ... cache_seqlens[b] + seqlen_new - 1 before attending.
        cache_seqlens: int32 (batch,) or an int: entries already in each cache (before the append);
            None = the whole cache.
        block_table: int32 (batch, max_blocks): page j of sequence b is k_cache[block_table[b, j]].
        causal: bottom-right aligned: query i sees cache positions j <= i + total_len - seqlen_q,
            where total_len = cache_seqlens[b] + seqlen_new.
        softmax_scale, window_size, softcap, return_lse: as flash_attn_func.
        num_splits: chunks of the cache per (sequence, kv head) on the Triton path; 0 = automatic.
        check_lengths: which values are checked against the cache (lengths in [0, capacity - seqlen_new],
            a paged cache's pages in use inside the pool). Shapes, dtypes and devices always are.
            None (the default): on the Triton path only what the host holds (an int or None
            cache_seqlens); a tensor cache_seqlens and block_table's entries are trusted, unread: no
            host sync, as a decoding loop (and CUDA-graph capture) wants, and automatic splits sized
            for the whole cache. The PyTorch path, which reads the lengths anyway, checks them all.
            True: everything, at one host sync per call. False: as None, and an error on the PyTorch
            path rather than a read of device values.
        alibi_slopes: flash-attn's argument, accepted as None only: the decoding kernel has no ALiBi
            (flash_attn_func and flash_attn_varlen_func do).
    Returns:
        out (batch, seqlen_q, heads_q, head_dim), or (out, lse) with lse (batch, heads_q, seqlen_q)
        fp32, -inf for a row that sees no cache entry (its output is 0).
    """
    tensors = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "k": k, "v": v}
    if alibi_slopes is not None:
        raise ValueError("alibi_slopes: flash_attn_with_kvcache has no ALiBi (flash_attn_func and "
                         "flash_attn_varlen_func do); pass None")
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together (new keys and values to append) or both left None")
    if torch.is_grad_enabled() and any(getattr(t, "requires_grad", False) for t in tensors.values()):
        raise ValueError("flash_attn_with_kvcache is inference-only (no backward): an input requires grad; "
                         "call it under torch.no_grad() or torch.inference_mode()")
    for name, t in tensors.items():
        if t is not None and (not isinstance(t, torch.Tensor) or t.dim() != 4):
            raise ValueError(f"{name} must be a 4-D tensor, got {_describe(t)}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must have the same shape, got {tuple(k_cache.shape)} and "
                         f"{tuple(v_cache.shape)}")
    if k is None:
        (q,) = autocast_inputs(q)
    else:
        q, k, v = autocast_inputs(q, k, v)
        check_attention_args(q, k, v, 1, softmax_scale, window_size, softcap)
    # The dense checks (dtypes, device, head_dim, GQA heads, options) on one-sequence views: a paged
    # cache's first dim is not the batch, and a slice costs no copy.
    softmax_scale, window_size = check_attention_args(q[:1], k_cache[:1], v_cache[:1], 1, softmax_scale,
                                                      window_size, softcap)
    cache_seqlens, shared_length = _check_kvcache_args(q, k_cache, v_cache, k, v, cache_seqlens, block_table,
                                                       num_splits)
    seqlen_new = 0 if k is None else k.shape[1]
    if check_lengths is not None and not isinstance(check_lengths, bool):
        raise ValueError(f"check_lengths must be a bool or None, got {check_lengths!r}")
    triton_path = kernel_impl(q.device) != "torch"
    if not triton_path and shared_length is None and check_lengths is False:
        raise ValueError("check_lengths=False needs the Triton path (the PyTorch path reads the lengths on the host)")
    lengths = _check_lengths(k_cache, cache_seqlens, shared_length, seqlen_new, block_table, q.shape[0],
                             read_device=check_lengths or (check_lengths is None and not triton_path))
    max_seqlen_k = _capacity(k_cache, block_table) if lengths is None else max(lengths, default=0)
    if seqlen_new:
        _append(k_cache, v_cache, k, v, cache_seqlens, block_table)
    window_left, window_right = normalize_window(causal, window_size)
    if triton_path:
        compiling = torch.compiler.is_compiling()
        if isinstance(cache_seqlens, int):  # eagerly the launcher takes the shared length as an int
            seqlens_k = cache_seqlens + seqlen_new
            if compiling:  # the op's schema wants a tensor
                seqlens_k = torch.full((q.shape[0],), seqlens_k, dtype=torch.int32, device=q.device)
        else:
            seqlens_k = cache_seqlens + seqlen_new if seqlen_new else cache_seqlens
        args = (q, k_cache, v_cache, seqlens_k, block_table, max_seqlen_k, softmax_scale, window_left, window_right,
                float(softcap), num_splits)
        if compiling:
            out, lse = _kvcache_fwd(*args)
        else:  # eagerly straight to the launcher, which then needs no lse buffer unless one is asked for
            from .decode import decode_attention

            out, lse = decode_attention(*args, return_lse=return_lse)
    else:
        out, lse = _kvcache_torch(q, k_cache, v_cache, lengths, block_table, softmax_scale, window_left,
                                  window_right, float(softcap))
    return (out, lse) if return_lse else out
