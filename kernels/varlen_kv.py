"""flash_attn_varlen_func with keys in a paged pool (block_table), forward only, and with seqused_k (only
the first seqused_k[b] keys of each sequence).

Paged keys run on decode.py's split-KV kernel, which reads paged caches with per-sequence key counts and
takes packed queries, or, where the queries fill the GPU's SMs in tiles of their own (a prompt, a long chunk:
decode.dense_forward_pays), on the tl forward kernel reading each key row through the block table
(``paged_attention``, a torch.library op under torch.compile). Packed keys with seqused_k need no kernel
change at all: the offsets are rewritten on the device (without_unused_keys) so that the dense varlen kernels,
forward and backward, skip the unused keys. The PyTorch path gathers each paged sequence's keys and runs
the tiled varlen reference.
"""

from __future__ import annotations

from typing import Optional

import torch

from .checks import (autocast_inputs, check_alibi, check_attention_args, check_cu_seqlens, check_index_layout,
                     describe, kernel_inputs, max_seqlen_arg)
from .interface import varlen_tiled
from .cache_pages import PAGE_MULTIPLE, count_bad_pages, raise_for_bad_pages
from .flash_fwd import attention_forward
from .masking import normalize_window
from .sizes import cdiv


def _check_pools(k, v):
    """Validate paged k/v pools; return one page of each, (tokens, heads, head_dim) as check_attention_args
    takes packed keys."""
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4 or t.shape[0] == 0:
            raise ValueError(f"{name} must be a paged pool (num_blocks >= 1, page_block_size, heads_kv, head_dim) "
                             f"with block_table, got {describe(t)}")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k and v pools must agree but for head_dim, got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape[1] % PAGE_MULTIPLE:
        raise ValueError(f"k: page_block_size={k.shape[1]} (dim 1 of a paged pool) must be a multiple of "
                         f"{PAGE_MULTIPLE} (a page holds whole key tiles; flash-attn asks for a multiple of 256)")
    return k[0], v[0]


def check_block_table(block_table, batch, device):
    if (not isinstance(block_table, torch.Tensor) or block_table.dtype != torch.int32 or block_table.dim() != 2
            or block_table.shape[0] != batch or block_table.device != device):
        raise ValueError(f"block_table must be an int32 tensor (batch={batch}, max_blocks_per_seq) on {device}, "
                         f"got {describe(block_table)}")


def check_seqused_k(seqused_k, batch, device):
    if (not isinstance(seqused_k, torch.Tensor) or seqused_k.dtype != torch.int32
            or seqused_k.shape != (batch,) or seqused_k.device != device):
        raise ValueError(f"seqused_k must be an int32 tensor of shape (batch={batch},) on {device}, got "
                         f"{describe(seqused_k)}")
    check_index_layout("seqused_k", seqused_k)


def _check_key_counts(k, cu_seqlens_k, block_table, seqused_k, lengths):
    """Raise for seqused_k outside [0, the sequence's length] and, paged, for lengths past the pages a
    row of block_table holds or pages in use outside the pool: one device read for all."""
    counts = torch.zeros(3, dtype=torch.int32, device=lengths.device)
    if seqused_k is not None:
        counts[0] = ((seqused_k < 0) | (seqused_k > cu_seqlens_k.diff())).sum()
    if block_table is not None:
        counts[1] = (lengths > block_table.shape[1] * k.shape[1]).sum()
        counts[2] = count_bad_pages(k, block_table, lengths)
    bad_used, too_long, bad_page_count = counts.tolist()
    if bad_used:
        raise ValueError(f"seqused_k has {bad_used} entries outside [0, the sequence's length in cu_seqlens_k]")
    if too_long:
        raise ValueError(f"{too_long} sequences hold more keys than their block_table row's "
                         f"{block_table.shape[1]} pages of {k.shape[1]}")
    raise_for_bad_pages(bad_page_count, k)


def without_unused_keys(k, cu_seqlens_q, cu_seqlens_k, seqused_k, alibi_slopes, return_attn_probs, read_values):
    """Offsets of 2 * batch sequences that leave out each sequence's keys past seqused_k[b]: sequence 2b
    holds b's queries and first seqused_k[b] keys, sequence 2b + 1 no query and b's other keys (their
    gradient is 0). Computed on the device: no host sync unless ``read_values`` checks seqused_k.

    Args:
        k: packed keys (total_k, heads_kv, head_dim); cu_seqlens_q, cu_seqlens_k: checked offsets.
        alibi_slopes: checked slopes, (heads_q,) or (batch, heads_q).
    Returns:
        (cu_seqlens_q, cu_seqlens_k, alibi_slopes) for 2 * batch sequences.
    """
    if return_attn_probs:
        raise ValueError("seqused_k: return_attn_probs is not supported with it; pass False")
    check_seqused_k(seqused_k, cu_seqlens_q.numel() - 1, cu_seqlens_q.device)
    if read_values:
        _check_key_counts(k, cu_seqlens_k, None, seqused_k, seqused_k)
    starts_k = cu_seqlens_k[:-1]
    cu_k = torch.cat((torch.stack((starts_k, starts_k + seqused_k), 1).flatten(), cu_seqlens_k[-1:]))
    cu_q = torch.cat((torch.stack((cu_seqlens_q[:-1], cu_seqlens_q[1:]), 1).flatten(), cu_seqlens_q[-1:]))
    if alibi_slopes is not None and alibi_slopes.dim() == 2:
        alibi_slopes = alibi_slopes.repeat_interleave(2, dim=0)
    return cu_q, cu_k, alibi_slopes


def _gathered_keys(k, v, block_table, lengths):
    """The PyTorch path's packed keys and values: each sequence's keys gathered from its pages (a host
    read of the lengths); returns (k, v, cu_seqlens_k of the gathered tensors)."""
    ks, vs = [], []
    for b, length in enumerate(lengths.tolist()):
        pages = block_table[b, :cdiv(length, k.shape[1])].long()
        ks.append(k[pages].flatten(0, 1)[:length])
        vs.append(v[pages].flatten(0, 1)[:length])
    offsets = torch.tensor([0] + [t.shape[0] for t in ks], device=k.device).cumsum(0).int()
    return torch.cat(ks), torch.cat(vs), offsets


def paged_varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                           softmax_scale, causal, window_size, softcap, alibi_slopes, return_attn_probs, block_table,
                           seqused_k, check_lengths, triton_path):
    """flash_attn_varlen_func with block_table (arguments as it takes them, checked here); returns (out,
    lse), out at the kernels' head_dim (the caller slices head_dim_v)."""
    if dropout_p != 0.0 or return_attn_probs:
        raise ValueError("block_table: the paged forward has no dropout_p or return_attn_probs (pass 0.0, False)")
    if torch.is_grad_enabled() and any(getattr(t, "requires_grad", False) for t in (q, k, v)):
        raise ValueError("block_table: flash_attn_varlen_func is forward-only with paged keys (as flash-attn): an "
                         "input requires grad; call it under torch.no_grad() or torch.inference_mode()")
    k_rows, v_rows = _check_pools(k, v)
    softmax_scale, window_size = check_attention_args(q, k_rows, v_rows, 0, softmax_scale, window_size, softcap)
    if check_lengths is not None and not isinstance(check_lengths, bool):
        raise ValueError(f"check_lengths must be a bool or None, got {check_lengths!r}")
    if check_lengths is False and not triton_path:
        raise ValueError("check_lengths=False needs the Triton path (the PyTorch path reads the lengths on the host)")
    read = check_lengths or (check_lengths is None and not triton_path)
    longest_q = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0], q.device, read or max_seqlen_q is None)
    longest_k = check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, None, q.device, read)
    batch = cu_seqlens_q.numel() - 1
    if cu_seqlens_k.numel() != cu_seqlens_q.numel():
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k describe {batch} and {cu_seqlens_k.numel() - 1} sequences")
    check_block_table(block_table, batch, q.device)
    alibi_slopes = check_alibi(q, batch, alibi_slopes)
    if seqused_k is not None:
        check_seqused_k(seqused_k, batch, q.device)
    lengths = seqused_k if seqused_k is not None else cu_seqlens_k.diff()
    if read:
        _check_key_counts(k, cu_seqlens_k, block_table, seqused_k, lengths)
    max_seqlen_q = max_seqlen_arg("max_seqlen_q", max_seqlen_q, longest_q)
    # The kernel sizes its split count by max_seqlen_k: without one, the block_table's shape bounds it.
    bound_k = block_table.shape[1] * k.shape[1]
    max_seqlen_k = max_seqlen_arg("max_seqlen_k", bound_k if max_seqlen_k is None else max_seqlen_k, longest_k)
    device_type = q.device.type
    if torch.is_autocast_enabled(device_type) and k.dtype != torch.get_autocast_dtype(device_type):
        # A cast would copy both whole pools on every call, a cost the caller would not see.
        raise ValueError(f"k and v are paged pools of {k.dtype} but q runs in {torch.get_autocast_dtype(device_type)} "
                         "under torch.autocast: allocate the pools in that dtype (they are read in place)")
    q, k, v = kernel_inputs(*autocast_inputs(q, k, v))
    window_left, window_right = normalize_window(causal, window_size)
    if not triton_path:
        k, v, cu_seqlens_k = _gathered_keys(k, v, block_table, lengths)
        return varlen_tiled(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, window_left, window_right,
                            float(softcap), alibi_slopes, 0.0, None)
    from .decode import dense_forward_pays

    dense = dense_forward_pays(batch, q.shape[1], q.shape[0] // max(batch, 1), q.device)
    return paged_attention(q, k, v, cu_seqlens_q, lengths, block_table, max_seqlen_q, max_seqlen_k, softmax_scale,
                           window_left, window_right, float(softcap), dense, alibi_slopes)


def _paged_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor, lengths: torch.Tensor,
                block_table: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float,
                window_left: int, window_right: int, softcap: float, dense: bool,
                alibi_slopes: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    if dense:
        cu_seqlens_k = torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
        return attention_forward(q, k, v, softmax_scale, window_left, window_right, softcap, cu_seqlens_q,
                                 cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes=alibi_slopes,
                                 block_table=block_table)
    from .decode import decode_attention

    return decode_attention(q, k, v, lengths, block_table, max_seqlen_k, softmax_scale, window_left, window_right,
                            softcap, cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_seqlen_q, alibi_slopes=alibi_slopes)


# Eagerly the launchers are called directly; torch.compile sees the op (see interface.py for why).
_paged_op = torch.library.custom_op("flashformer::paged_attention", _paged_impl, mutates_args=())


@_paged_op.register_fake
def _(q, k, v, cu_seqlens_q, lengths, block_table, max_seqlen_q, max_seqlen_k, softmax_scale, window_left,
      window_right, softcap, dense, alibi_slopes):
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty(
        (q.shape[1], q.shape[0]), dtype=torch.float32)


def paged_attention(q, k, v, cu_seqlens_q, lengths, block_table, max_seqlen_q, max_seqlen_k, softmax_scale,
                    window_left, window_right, softcap, dense, alibi_slopes=None):
    """Packed queries against paged keys, forward only: sequence b's queries over its first lengths[b] keys, each
    read through row b of block_table, with no host read. ``dense``: on the tl forward kernel (offsets built on
    the device), else on decode.py's split kernel.

    Args:
        q: (total_q, heads_q, head_dim); k, v: page pools (num_pages, page_size, heads_kv, head_dim).
        lengths: int32 (batch,), each sequence's keys; max_seqlen_k: a bound on them.
        alibi_slopes: None, or checked fp32 (heads_q,) / (batch, heads_q).
    Returns:
        out like q, lse (heads_q, total_q).
    """
    run = _paged_op if torch.compiler.is_compiling() else _paged_impl
    return run(q, k, v, cu_seqlens_q, lengths, block_table, max_seqlen_q, max_seqlen_k, softmax_scale, window_left,
               window_right, softcap, dense, alibi_slopes)
