"""flash_attn_with_kvcache's argument checks, and the signature by which a decoding loop's repeated calls skip them.

Raises ValueError naming the argument; reads device values only where check_lengths (or the PyTorch path) asks.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .cache_pages import PAGE_MULTIPLE, count_bad_pages, raise_for_bad_pages
from .checks import check_index_layout, describe
from .interface import forced_impl


def check_kvcache_args(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
                        num_splits):
    """Validate everything that needs no device values; return (cache_seqlens as the kernels and the
    append take it: an int for a contiguous cache read in place, else int32 (batch,) on q's device; the
    length shared by every sequence when the host knows it, else None)."""
    batch = q.shape[0]
    for name, t in (("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad)):
        if t is None:
            continue
        if block_table is not None:
            raise ValueError(f"{name} applies to a contiguous cache; a paged cache (block_table) names its pages "
                             "per sequence instead (flash-attn has the same rule)")
        if (not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.shape != (batch,)
                or t.device != q.device):
            raise ValueError(f"{name} must be an int32 tensor of shape (batch={batch},) on {q.device}, got "
                             f"{describe(t)}")
        check_index_layout(name, t)
    entries = k_cache.shape[0] * k_cache.shape[1]
    if (cache_batch_idx is not None or cache_leftpad is not None) and entries < PAGE_MULTIPLE:
        raise ValueError(f"cache_batch_idx / cache_leftpad need a cache of at least {PAGE_MULTIPLE} entries in all "
                         f"(the Triton path reads it as pages of whole key tiles), got {entries}")
    if block_table is None:
        if cache_batch_idx is None and k_cache.shape[0] != batch:
            raise ValueError(f"k_cache holds {k_cache.shape[0]} sequences but q has batch {batch}; a paged cache "
                             "(num_blocks, block_size, heads_kv, head_dim) needs block_table, a cache with other "
                             "rows cache_batch_idx")
    else:
        if not isinstance(block_table, torch.Tensor) or block_table.dtype != torch.int32 or block_table.dim() != 2:
            raise ValueError(f"block_table must be an int32 tensor (batch, max_blocks), got {describe(block_table)}")
        if block_table.shape[0] != batch or block_table.device != q.device:
            raise ValueError(f"block_table must be (batch={batch}, max_blocks) on {q.device}, got "
                             f"{describe(block_table)}")
        if k_cache.shape[1] % PAGE_MULTIPLE:
            raise ValueError(f"k_cache block_size={k_cache.shape[1]} (dim 1 of a paged cache) must be a multiple "
                             f"of {PAGE_MULTIPLE}")
    if k is not None:
        for name, t in (("k", k), ("v", v)):
            if t.shape[2:] != k_cache.shape[2:]:
                raise ValueError(f"{name} has (heads_kv, head_dim) = {tuple(t.shape[2:])} but the caches have "
                                 f"{tuple(k_cache.shape[2:])}")
        if k.shape != v.shape or k.shape[0] != batch:
            raise ValueError(f"k and v must have the same shape (batch={batch}, seqlen_new, heads_kv, head_dim), got "
                             f"{tuple(k.shape)} and {tuple(v.shape)}")
        if not k.dtype == v.dtype == q.dtype or not k.device == v.device == q.device:
            raise ValueError(f"k and v must share q's dtype and device ({q.dtype} on {q.device}), got {describe(k)} "
                             f"and {describe(v)}")
    if not isinstance(num_splits, int) or isinstance(num_splits, bool) or num_splits < 0:
        raise ValueError(f"num_splits must be an int >= 0 (0 = automatic), got {num_splits!r}")
    if cache_seqlens is None:  # as flash-attn: the whole cache is valid
        cache_seqlens = cache_capacity(k_cache, block_table)
    if isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        if block_table is None and cache_batch_idx is None and cache_leftpad is None:
            return cache_seqlens, cache_seqlens  # kept on the host: the kernel takes it as an int, the append slices
        return torch.full((batch,), cache_seqlens, dtype=torch.int32, device=q.device), cache_seqlens
    if (not isinstance(cache_seqlens, torch.Tensor) or cache_seqlens.dtype != torch.int32
            or cache_seqlens.shape != (batch,) or cache_seqlens.device != q.device):
        raise ValueError(f"cache_seqlens must be an int or an int32 tensor of shape (batch={batch},) on {q.device}, "
                         f"got {describe(cache_seqlens)}")
    check_index_layout("cache_seqlens", cache_seqlens)
    return cache_seqlens, None


def check_cache_lengths(k_cache, cache_seqlens, shared_length, seqlen_new, block_table, cache_batch_idx, cache_leftpad,
                   batch, read_device):
    """Validate the lengths, and with read_device what else only the device holds (a paged cache's pages
    in use, cache_batch_idx's rows, cache_leftpad's starts); only read_device reads the device (one
    host sync for everything).

    Returns:
        (ends, spans): ends, the valid entries per sequence after the append (host ints), or None when
        only the device holds them; spans, per sequence (cache row, first valid entry, end) when the
        host knows them all (see _kvcache_torch), else None.
    """
    ends = None
    if shared_length is not None:  # the host knows every length: no read for them
        ends = [shared_length + seqlen_new] * batch
        check_length_values(k_cache, ends, seqlen_new, block_table)
        if cache_batch_idx is None and cache_leftpad is None and (block_table is None or not read_device):
            return ends, [(b, 0, end) for b, end in enumerate(ends)]
    if not read_device:
        return ends, None
    ends_t = cache_seqlens + seqlen_new
    no_tensor = ends_t.new_empty(0)
    counts = torch.zeros(3, dtype=torch.int32, device=ends_t.device)
    if block_table is not None:
        counts[0] = count_bad_pages(k_cache, block_table, ends_t)
    if cache_batch_idx is not None:
        counts[1] = ((cache_batch_idx < 0) | (cache_batch_idx >= k_cache.shape[0])).sum()
    if cache_leftpad is not None:
        counts[2] = ((cache_leftpad < 0) | (cache_leftpad > cache_seqlens)).sum()
    values = torch.cat([counts, ends_t, no_tensor if cache_batch_idx is None else cache_batch_idx,
                        no_tensor if cache_leftpad is None else cache_leftpad]).tolist()
    (bad_pages, bad_rows, bad_starts), values = values[:3], values[3:]
    ends, values = values[:batch], values[batch:]
    rows, starts = list(range(batch)), [0] * batch
    if cache_batch_idx is not None:
        rows, values = values[:batch], values[batch:]
    if cache_leftpad is not None:
        starts = values
    check_length_values(k_cache, ends, seqlen_new, block_table)
    raise_for_bad_pages(bad_pages, k_cache)
    if bad_rows:
        raise ValueError(f"cache_batch_idx has {bad_rows} entries outside [0, k_cache rows={k_cache.shape[0]})")
    if bad_starts:
        raise ValueError(f"cache_leftpad has {bad_starts} entries outside [0, cache_seqlens[b]] (the first valid "
                         "entry must come at or before the cached length)")
    return ends, list(zip(rows, starts, ends))


def check_length_values(k_cache, lengths, seqlen_new, block_table):
    capacity = cache_capacity(k_cache, block_table)
    for b, length in enumerate(lengths):
        if length < seqlen_new:
            raise ValueError(f"cache_seqlens[{b}] = {length - seqlen_new} is negative")
        if length > capacity:
            raise ValueError(f"k_cache is too small: sequence {b} needs {length} entries ({length - seqlen_new} "
                             f"cached + {seqlen_new} new) but holds {capacity}")


def cache_capacity(k_cache, block_table):
    """Entries one sequence's cache can hold."""
    return k_cache.shape[1] if block_table is None else block_table.shape[1] * k_cache.shape[1]


class CheckedCall(NamedTuple):
    """What the checks of a call on the decode kernel's route derived, the same for every call of its signature."""
    softmax_scale: float
    window_left: int
    window_right: int
    softcap: float
    max_cached: int  # the most entries a sequence may hold before the append: its capacity - seqlen_new
    seqlen_new: int


# A decoding step's host time is most of it at batch 1 and much of it at batch 8 on the H200: a loop's later steps
# skip the checks (about as long as the launches) by their signature.
CHECKED_CALLS: dict[tuple, CheckedCall] = {}
MAX_CHECKED_CALLS = 256  # a model decodes with a handful; a long-lived server must not grow without bound
_NUMBERS = (int, float)


def keep_checked_call(signature, checked):
    """Keep what a call's checks derived (a CheckedCall) for the later calls of its signature (call_signature)."""
    if len(CHECKED_CALLS) >= MAX_CHECKED_CALLS:
        CHECKED_CALLS.clear()
    CHECKED_CALLS[signature] = checked


def call_signature(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
                    block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes,
                    num_splits, check_lengths):
    """Everything flash_attn_with_kvcache's checks and route choice read of a call, as a dict key: its tensors'
    layouts, its options' values, whether it needs grad and the forced implementation; a call's int cache_seqlens
    is checked apart (CheckedCall.max_cached). None for a call checked every time: one whose checks read device values
    (check_lengths=True, cache_batch_idx, cache_leftpad), that autocast casts, that is traced, or with an argument
    of another type than the checks accept (whose error the checks name)."""
    if (cache_batch_idx is not None or cache_leftpad is not None
            or not (check_lengths is None or check_lengths is False) or type(num_splits) is not int
            or type(causal) is not bool or type(rotary_interleaved) is not bool or type(softcap) not in _NUMBERS
            or softmax_scale is not None and type(softmax_scale) not in _NUMBERS
            or type(window_size) is not tuple or len(window_size) != 2
            or type(window_size[0]) is not int or type(window_size[1]) is not int):
        return None
    if type(cache_seqlens) is int and block_table is None:  # (with a block table the checks make it a tensor)
        lengths = int
    elif type(cache_seqlens) is torch.Tensor:
        lengths = (cache_seqlens.shape, cache_seqlens.stride(), cache_seqlens.dtype, cache_seqlens.device)
    else:
        return None
    grad = torch.is_grad_enabled()  # then an input that requires grad is an error
    signature = [lengths, softmax_scale, causal, window_size, softcap, rotary_interleaved, num_splits, check_lengths,
                 forced_impl()]
    for t in (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, block_table, alibi_slopes):
        if t is None:
            signature.append(None)
        elif type(t) is torch.Tensor:
            signature.append((t.shape, t.stride(), t.dtype, t.device, grad and t.requires_grad))
        else:
            return None
    if torch.compiler.is_compiling() or torch.is_autocast_enabled(q.device.type):
        return None
    return tuple(signature)
