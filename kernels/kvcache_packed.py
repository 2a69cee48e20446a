"""flash_attn_with_kvcache's routes through the varlen forwards, no kernel of their own:

* the packed form (flash-attn 3's cu_seqlens_q, cu_seqlens_k_new, max_seqlen_q), as continuous-batching
  servers call it: each sequence's new tokens appended at its own cache positions, then its packed queries
  attend through the paged forward of varlen_kv.py (a contiguous cache read in place as one page per
  sequence);
* a prompt or long chunk over per-sequence (tensor) lengths: the dense varlen forward over a contiguous
  cache's rows flattened in place, each sequence's unused entries left out on the device, or the tl forward
  reading a paged cache through its block table.
"""

from __future__ import annotations

import torch

from .cache_append import Rotary, rotate_and_append_packed
from .cache_pages import PAGE_MULTIPLE, check_rotary, size_index
from .checks import check_cu_seqlens, describe
from .interface import kernel_impl, triton_attention
from .varlen_kv import check_block_table, check_seqused_k, paged_attention, paged_varlen_attention


def kvcache_packed_queries(q, k_cache, v_cache, k, v, cache_seqlens, block_table, cu_seqlens_q, cu_seqlens_k_new,
                           max_seqlen_q, softmax_scale, causal, window_size, softcap, alibi_slopes, check_lengths,
                           rotary_cos, rotary_sin, rotary_interleaved, unsupported):
    """flash_attn_with_kvcache with flash-attn 3's packed queries (cu_seqlens_q): k, v (total_new, heads_kv,
    head_dim) appended first, sequence b's rows cu_seqlens_k_new[b]:cu_seqlens_k_new[b + 1] at its cache
    positions cache_seqlens[b] + i (rotated there first, as are the queries by flash_attn_with_kvcache's
    rule); then the paged forward above, a contiguous cache read in place as one page per sequence. Returns
    (out, lse (heads_q, total_q)).

    Args:
        unsupported: {argument name: value} of flash_attn_with_kvcache's options this form does not take;
            any that is set (not None) raises, naming it.
    """
    for name, value in unsupported.items():
        if value is not None:
            raise ValueError(f"{name}: flash_attn_with_kvcache with cu_seqlens_q (packed queries) does not take "
                             f"{name}; pass {name}=None")
    for name, t, rank in (("q", q, 3), ("k_cache", k_cache, 4), ("v_cache", v_cache, 4), ("k", k, 3), ("v", v, 3)):
        if t is not None and (not isinstance(t, torch.Tensor) or t.dim() != rank):
            packed = " (packed along dim 0 with cu_seqlens_q / cu_seqlens_k_new)" if rank == 3 else ""
            raise ValueError(f"{name} must be a {rank}-D tensor{packed}, got {describe(t)}")
    if (k is None) != (v is None) or (k is None) != (cu_seqlens_k_new is None):
        raise ValueError("k, v and cu_seqlens_k_new go together (new tokens to append, packed) or are all None")
    if not isinstance(cu_seqlens_q, torch.Tensor) or cu_seqlens_q.dim() != 1 or cu_seqlens_q.numel() < 2:
        raise ValueError(f"cu_seqlens_q must be a 1-d int32 tensor of batch + 1 offsets, got {describe(cu_seqlens_q)}")
    if check_lengths is not None and not isinstance(check_lengths, bool):
        raise ValueError(f"check_lengths must be a bool or None, got {check_lengths!r}")
    batch, device = cu_seqlens_q.numel() - 1, q.device
    triton_path = kernel_impl(device) != "torch"
    read = check_lengths or (check_lengths is None and not triton_path)
    if block_table is not None:
        check_block_table(block_table, batch, device)
    else:  # each cache row is its sequence's one page
        if k_cache.shape[0] != batch:
            raise ValueError(f"k_cache holds {k_cache.shape[0]} sequences, cu_seqlens_q describes {batch}")
        if k_cache.shape[1] % PAGE_MULTIPLE:
            raise ValueError(f"k_cache: max_cache={k_cache.shape[1]} must be a multiple of {PAGE_MULTIPLE} with "
                             "cu_seqlens_q (the packed-query kernel reads a contiguous cache as one page per sequence)")
        block_table = size_index(one_page_per_row, batch, device=device)
    capacity = block_table.shape[1] * k_cache.shape[1]
    if isinstance(cache_seqlens, torch.Tensor):
        check_seqused_k(cache_seqlens, batch, device)
    elif not (cache_seqlens is None and k is None or isinstance(cache_seqlens, int) and 0 <= cache_seqlens <= capacity):
        raise ValueError(f"cache_seqlens={cache_seqlens!r} must be an int in [0, {capacity}] or an int32 tensor "
                         "(batch,) (None: the whole cache, without k/v)")
    keys = capacity if cache_seqlens is None else cache_seqlens  # per sequence after the append
    if k is not None:
        if k.shape != v.shape or k.shape[1:] != k_cache.shape[2:] or k.dtype != k_cache.dtype or k.device != device:
            raise ValueError(f"k and v must both be (total_new, {', '.join(map(str, k_cache.shape[2:]))}) "
                             f"{k_cache.dtype} on {device}, got {describe(k)} and {describe(v)}")
        check_cu_seqlens("cu_seqlens_k_new", cu_seqlens_k_new, k.shape[0], device, read)
        if cu_seqlens_k_new.numel() != batch + 1:
            raise ValueError(f"cu_seqlens_k_new describes {cu_seqlens_k_new.numel() - 1} sequences, cu_seqlens_q "
                             f"{batch}")
        if read and bool((cache_seqlens + cu_seqlens_k_new.diff() > capacity).any()):  # before anything is written
            raise ValueError(f"cache_seqlens + the new tokens of cu_seqlens_k_new pass the cache's {capacity} entries")
        check_rotary(rotary_cos, rotary_sin, rotary_interleaved, q, k, capacity)
        rotary = None if rotary_cos is None else Rotary(rotary_cos, rotary_sin, rotary_interleaved,
                                                        causal or tuple(window_size) != (-1, -1))
        q, keys = rotate_and_append_packed(q, k_cache, v_cache, k, v, cache_seqlens, block_table, cu_seqlens_q,
                                           cu_seqlens_k_new, rotary, triton_path)
    else:
        check_rotary(rotary_cos, rotary_sin, rotary_interleaved, q, k, capacity)
    seqused_k = keys if isinstance(keys, torch.Tensor) else None
    bound = capacity if seqused_k is not None else keys
    cu_seqlens_k = size_index(multiples, batch + 1, bound, device=device)  # keys per sequence: the bound
    return paged_varlen_attention(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, bound, 0.0,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes, False, block_table,
                                  seqused_k, check_lengths, triton_path)


def one_page_per_row(batch, device):
    """The block table (batch, 1) int32 that reads a contiguous cache's row b as sequence b's one page."""
    return torch.arange(batch, dtype=torch.int32, device=device)[:, None]


def multiples(n, step, device):
    """0, step, .. (n - 1) step, int32: the offsets of n - 1 sequences of ``step`` rows."""
    return torch.arange(n, dtype=torch.int32, device=device) * step


def _row_pair_offsets(batch, seqlen_q, capacity, device):
    """(2, 2 batch + 1) int32: cu_seqlens_q of 2 batch sequences (sequence 2b row b's seqlen_q queries, 2b + 1
    none), then each sequence's first key in a (batch, capacity) cache flattened, before the used keys are
    counted in (sequence 2b starts row b, 2b + 1 starts where its used keys end): varlen_kv.without_unused_keys'
    layout for rows of equal length."""
    pair = torch.arange(2 * batch + 1, dtype=torch.int32, device=device)
    return torch.stack(((pair + 1) // 2 * seqlen_q, pair // 2 * capacity))


def rows_flatten(cache):
    """Whether a contiguous cache's (batch, max_cache) dims merge into one without a copy."""
    return cache.shape[0] < 2 or cache.stride(0) == cache.shape[1] * cache.stride(1)


def prefill_over_cache(q, k_cache, v_cache, block_table, seqlens_k, max_seqlen_k, softmax_scale, window_left,
                       window_right, softcap, alibi_slopes):
    """Sequence b's queries over the first seqlens_k[b] entries of its cache on a dense forward, without a host
    read of the lengths: a contiguous cache's rows flattened in place (rows_flatten), each row's other entries
    left out by offsets computed on the device, on the varlen forward; a paged cache through its block_table on
    the tl forward (varlen_kv.paged_attention).

    Args:
        q: (batch, seqlen_q, heads_q, head_dim); k_cache, v_cache: (batch, max_cache, heads_kv, head_dim), or
            page pools (num_pages, page_size, heads_kv, head_dim) with block_table (batch, pages per sequence).
        seqlens_k: int32 (batch,), each sequence's entries in use (after the append); max_seqlen_k: a bound.
        alibi_slopes: None, or checked fp32 (heads_q,) / (batch, heads_q).
    Returns:
        out like q, lse (batch, heads_q, seqlen_q) (a transposed view).
    """
    batch, seqlen_q, heads_q, _ = q.shape
    if block_table is None:
        capacity = k_cache.shape[1]
        cu_seqlens_q, first_keys = size_index(_row_pair_offsets, batch, seqlen_q, capacity, device=q.device)
        cu_seqlens_k = first_keys.clone()
        cu_seqlens_k[1::2].add_(seqlens_k)  # row b's used keys end sequence 2b (in place: no copy back)
        if alibi_slopes is not None and alibi_slopes.dim() == 2:  # one row per sequence of the 2 * batch
            alibi_slopes = alibi_slopes.repeat_interleave(2, dim=0)
        out, lse = triton_attention(q.flatten(0, 1), k_cache.flatten(0, 1), v_cache.flatten(0, 1), cu_seqlens_q,
                                    cu_seqlens_k, alibi_slopes, None, seqlen_q, capacity, softmax_scale, window_left,
                                    window_right, softcap, 0.0, True)
    else:
        cu_seqlens_q = size_index(multiples, batch + 1, seqlen_q, device=q.device)
        out, lse = paged_attention(q.flatten(0, 1), k_cache, v_cache, cu_seqlens_q, seqlens_k, block_table,
                                   seqlen_q, max_seqlen_k, softmax_scale, window_left, window_right, softcap, True,
                                   alibi_slopes)
    return out.view(q.shape), lse.view(heads_q, batch, seqlen_q).transpose(0, 1)
