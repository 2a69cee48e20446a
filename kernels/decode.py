"""Split-KV decoding ("flash-decoding") in Triton, against contiguous or paged KV caches.

A decode step has few query tokens and a long cache, so the dense forward's grid (query tiles x
heads) would leave most SMs idle and read each kv head's cache once per query head. Here one program
owns one kv head of one sequence: every query head of its GQA group and every query token become
the rows (M) of its tiles, so K and V are read once per kv head. To fill the GPU when
batch x kv_heads is small, the cache is cut into ``num_splits`` chunks, each program writes a
partial (out, lse) in fp32, and a second small kernel merges the splits through log-sum-exp.
The kernels' bodies are in decode_kernels.py; this module plans and launches them.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .decode_kernels import combine_kernel, decode_kernel
from .flash_fwd import log2_scales
from .launch import (CompiledLaunch, as_descriptor_compatible, dot_precision, ensure_allocator, new_output,
                     reused_buffers, sm_count, upcast_dot)
from .sizes import WIDE_HEAD_DIM, cdiv, next_power_of_2, pad_head_dim
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
# Query rows of one head per program of the dense forward (flash_fwd.py, the Hopper forward).
DENSE_QUERY_TILE = 128


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
    sms = device_sms(device)
    most = max(1, min(keys // MIN_KEYS_PER_SPLIT, MAX_SPLITS))
    fewest = max(1, min(most, sms // programs))
    candidates = range(fewest, max(fewest, min(keys // TARGET_KEYS_PER_SPLIT, most)) + 1)

    def fill(splits):
        total = programs * splits
        return 1.0 if total <= sms else min(_wave_fill(total, sms), _wave_fill(total, RESIDENT_PER_SM * sms))

    filled = [splits for splits in candidates if fill(splits) >= 0.95]
    return max(filled) if filled else max(candidates, key=fill)


def device_sms(device):
    """SMs of ``device`` (a torch.device); the interpreter takes DEFAULT_SMS."""
    return (sm_count(device.index if device.index is not None else torch.cuda.current_device())
            if device.type == "cuda" else DEFAULT_SMS)


def dense_forward_pays(batch, heads_q, seqlen_q, device):
    """Whether ``seqlen_q`` new queries per sequence (on average, where packed) run better on a dense forward than
    here: this kernel reads every key tile once per MAX_ROWS query rows (a GQA group's heads times a few tokens),
    the dense forward once per DENSE_QUERY_TILE rows of one head (with its Hopper overlap where the cache is
    contiguous), but it splits no cache: its programs (batch x heads_q x query tiles) must fill the SMs, where
    this kernel's splits would."""
    return (seqlen_q >= DENSE_QUERY_TILE
            and batch * heads_q * cdiv(seqlen_q, DENSE_QUERY_TILE) >= device_sms(device))


def _wave_fill(programs, slots):
    """Share of the launched waves' slots that ``programs`` occupy."""
    return programs / (cdiv(programs, slots) * slots)


class _Plan(NamedTuple):
    """What a decode call's launches take besides its tensors and cache length, fixed by the layouts,
    shapes and options (see _plan_key): computed once, since a batch-1 step is host-bound."""
    grid: tuple
    ints: tuple  # the decode kernel's int arguments before cache_len
    scalars: tuple  # and after it
    meta: dict
    partial_shapes: tuple  # () without splits
    combine_grid: tuple
    combine_ints: tuple
    combine_meta: dict


_PLANS = {}
MAX_PLANS = 256  # a model decodes with a handful; a long-lived server must not grow without bound


def _plan_key(q, k_cache, v_cache, block_table, per_sequence, max_seqlen_k, softmax_scale, window_left,
              window_right, softcap, num_splits, packed_q, alibi_dims):
    # Automatic splits depend on the cache length only through keys // MIN_KEYS_PER_SPLIT (capped), so a
    # growing cache changes the plan every MIN_KEYS_PER_SPLIT steps at most.
    budget = min(max_seqlen_k // MIN_KEYS_PER_SPLIT, MAX_SPLITS) if num_splits == 0 else 0
    return (q.shape, q.stride(), q.dtype, k_cache.dtype, q.device, k_cache.shape, k_cache.stride(), v_cache.shape,
            v_cache.stride(), None if block_table is None else block_table.stride(), per_sequence, softmax_scale,
            window_left, window_right, softcap, num_splits, budget, packed_q, alibi_dims)


def _build_plan(q, k_cache, v_cache, block_table, per_sequence, max_seqlen_k, softmax_scale, window_left,
                window_right, softcap, num_splits, packed_q, alibi_dims):
    """The _Plan of tensors the kernels can read as they are (see _readable); packed_q: (batch,
    max_seqlen_q) of packed queries (total_q, heads_q, head_dim), None for (batch, seqlen_q, ...); alibi_dims:
    None, or 1 / 2 for ALiBi slopes (heads_q,) / (batch, heads_q)."""
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
    if num_splits == 0:
        keys = max_seqlen_k
        if window_left >= 0 and window_right >= 0:  # a two-sided window bounds the keys a program reads
            keys = min(keys, window_left + window_right + block_t)
        num_splits = choose_num_splits(batch * heads_kv * token_blocks, keys, q.device)
    block_n, num_warps, num_stages = _launch_config(q.device, head_dim_pad, page_size)
    split = num_splits > 1
    qk_scale, softcap_log2 = log2_scales(softmax_scale, softcap)
    return _Plan(
        grid=(token_blocks * batch * heads_kv, num_splits),
        ints=(*q_strides, *k_cache.stride()[1:3], *v_cache.stride()[1:3],
              block_table.stride(0) if block_table is not None else 0, lse_head_stride,
              heads_q if alibi_dims == 2 else 0, seqlen_q, heads_kv, num_splits, k_page_rows, v_page_rows, k_rows,
              v_rows),
        scalars=(qk_scale, softcap_log2, window_left, window_right),
        meta=dict(GROUP=group, GROUP_PAD=group_pad, BLOCK_T=block_t, BLOCK_N=block_n, PAGE_SIZE=page_size,
                  HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, LEFT_BOUNDED=window_left >= 0,
                  RIGHT_BOUNDED=window_right >= 0, HAS_SOFTCAP=softcap > 0.0, HAS_ALIBI=alibi_dims is not None,
                  SPLIT=split,
                  PER_SEQUENCE_LENGTHS=per_sequence, VARLEN_Q=packed_q is not None,
                  DOT_PRECISION=dot_precision(q.dtype), UPCAST_DOT=upcast_dot(q.dtype), num_warps=num_warps,
                  num_stages=num_stages),
        partial_shapes=((*rows, heads_q, num_splits, head_dim), (*rows, heads_q, num_splits)) if split else (),
        combine_grid=(math.prod(rows) * heads_q,),
        combine_ints=(seqlen_q if packed_q is None else rows[0], heads_q, num_splits),
        combine_meta=dict(SPLITS_PAD=max(2, next_power_of_2(num_splits)), HEAD_DIM=head_dim,
                          HEAD_DIM_PAD=head_dim_pad, VARLEN_Q=packed_q is not None, num_warps=4),
    )


def _readable(q, k_cache, v_cache, block_table):
    """The tensors as the kernels read them: themselves, or a contiguous copy of one whose layout TMA
    or the kernels' pointer arithmetic cannot address (see as_descriptor_compatible, _page_rows)."""
    q = as_descriptor_compatible(q)  # unit last stride, which the kernel's pointer arithmetic assumes
    if block_table is not None and block_table.stride(1) != 1:
        block_table = block_table.contiguous()  # the kernel steps through a row with unit stride
    return q, _page_pool(k_cache), _page_pool(v_cache), block_table


def decode_attention(q, k_cache, v_cache, seqlens_k, block_table, max_seqlen_k, softmax_scale, window_left,
                     window_right, softcap, num_splits=0, return_lse=True, cu_seqlens_q=None, max_seqlen_q=0,
                     keys_appended=0, alibi_slopes=None):
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
        keys_appended: added to each of seqlens_k's entries (a tensor) in the kernel: the keys an append just
            wrote, without a launch of their own to add them.
        alibi_slopes: None, or fp32 contiguous (heads_q,) / (batch, heads_q): ALiBi's bias, bottom-right aligned.
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
    options = (per_sequence, max_seqlen_k, softmax_scale, window_left, window_right, softcap, num_splits, packed_q,
               None if alibi_slopes is None else alibi_slopes.dim())
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
    # tensor and a block table are int32, ALiBi's slopes fp32; a cache length fits int32) and every constexpr.
    _decode_launch.launch_keyed(
        ("decode", key), plan.grid, q, k_cache, v_cache, out, lse, out_part, lse_part,
        seqlens_k if per_sequence else None, block_table, cu_seqlens_q, alibi_slopes, *plan.ints,
        keys_appended if per_sequence else seqlens_k,
        *plan.scalars, **plan.meta)
    if plan.partial_shapes:
        _combine_launch.launch_keyed(("combine", key), plan.combine_grid, out_part, lse_part, out, lse,
                                     *plan.combine_ints, **plan.combine_meta)
    return out, lse if return_lse else None


_decode_launch = CompiledLaunch(decode_kernel)
_combine_launch = CompiledLaunch(combine_kernel)
