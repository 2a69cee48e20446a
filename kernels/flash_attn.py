"""flash-attn's public functions: dense, varlen and their packed forms, in flash-attn's argument order.

Each checks its arguments (checks.py), pads head_dim to what the kernels take, and hands the call to
interface.py, which chooses the path (Gluon, Triton or PyTorch) and owns autograd.
"""

from __future__ import annotations

import torch

from .checks import (autocast_inputs, check_attention_args, check_cu_seqlens, check_deterministic,
                     check_dropout_and_alibi, draw_dropout_seed, kernel_head_dim, kernel_inputs, max_seqlen_arg,
                     reads_offsets)
from .interface import (attention_probs_dmask, attention_with_lse, kernel_impl, triton_attention, varlen_backward,
                        varlen_tiled)
from .masking import normalize_window
from .varlen_kv import paged_varlen_attention, without_unused_keys


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=True, return_attn_probs=False, block_table=None, *, seqused_k=None,
                           return_lse=False, check_lengths=None):
    """Exact attention over sequences packed along the token dim, flash-attn's varlen API.

    No attention crosses a sequence boundary; every option of flash_attn_func applies per sequence
    (causal aligned bottom-right within each). Zero-length sequences are allowed.

    Args:
        q: (total_q, heads_q, head_dim); k: (total_k, heads_kv, head_dim); v: (total_k, heads_kv,
            head_dim_v). head_dim and head_dim_v as flash_attn_func.
        cu_seqlens_q, cu_seqlens_k: int32 (batch + 1,) offsets: sequence b is rows
            [cu[b], cu[b + 1]). Same batch for q and k.
        max_seqlen_q, max_seqlen_k: longest sequence lengths; None reads them from the offsets (a
            host sync on CUDA). The Triton kernels take them for tuning only.
        causal, softmax_scale, window_size, softcap, return_lse, deterministic, dropout_p,
            alibi_slopes, return_attn_probs: as flash_attn_func; ALiBi's distance and dropout's mask
            coordinates are per sequence.
        check_lengths: whether the offsets' values are checked (start 0, end at the token count,
            non-decreasing, max_seqlen_q/_k at least the longest); their type, shape and device
            always are. None (the default): when they are read anyway (a max_seqlen left None, or
            the PyTorch path); with both max_seqlen given the Triton path reads no device value (no
            host sync) and trusts the offsets, as flash-attn does. True: always (one device read per
            offsets tensor and version). False: never; needs both max_seqlen and the Triton path.
        block_table: int32 (batch, max_blocks_per_seq): k and v are then paged pools (num_blocks,
            page_block_size, heads_kv, head_dim / head_dim_v), page_block_size a multiple of 16
            (flash-attn's: of 256), and sequence b's keys are pages block_table[b, :ceil(len_b /
            page_block_size)], len_b from cu_seqlens_k (whose last entry is then no token count).
            Forward only (an error if an input requires grad under grad mode), as in flash-attn; no
            dropout_p or return_attn_probs (alibi_slopes apply). Entries past a sequence's pages are never read.
            max_seqlen_k None is bounded by block_table's shape (no host read); check_lengths also
            checks the pages in use (inside the pool and the row). Under torch.autocast the pools must
            already be in its dtype (only q is cast).
        seqused_k: int32 (batch,): only the first seqused_k[b] <= len_b keys of sequence b are used
            (causal aligns to seqused_k[b]), packed or paged; check_lengths (or reading the offsets)
            checks it. Packed keys take every other option and the backward (the unused keys' gradient
            is 0); no return_attn_probs.
    Returns:
        out (total_q, heads_q, head_dim_v), or (out, lse) with lse (heads_q, total_q) fp32, or with
        return_attn_probs (out, lse, S_dmask), S_dmask (batch, heads_q, max_seqlen_q, max_seqlen_k).
    """
    if block_table is not None:
        out, lse = paged_varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                          softmax_scale, causal, window_size, softcap, alibi_slopes,
                                          return_attn_probs, block_table, seqused_k, check_lengths,
                                          kernel_impl(q.device) != "torch")
        out = out[..., :v.shape[-1]]
        return (out, lse) if return_lse else out
    softmax_scale, window_size = check_attention_args(q, k, v, 0, softmax_scale, window_size, softcap)
    deterministic = check_deterministic(deterministic)
    if check_lengths is not None and not isinstance(check_lengths, bool):
        raise ValueError(f"check_lengths must be a bool or None, got {check_lengths!r}")
    triton_path = kernel_impl(q.device) != "torch"
    if check_lengths is False and (max_seqlen_q is None or max_seqlen_k is None or not triton_path):
        raise ValueError("check_lengths=False needs max_seqlen_q and max_seqlen_k and the Triton path (otherwise "
                         "the offsets are read on the host)")
    longest_q = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0], q.device,
                                 reads_offsets(check_lengths, max_seqlen_q, triton_path))
    reads_k = reads_offsets(check_lengths, max_seqlen_k, triton_path)
    longest_k = check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0], q.device, reads_k)
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k describe {cu_seqlens_q.numel() - 1} and "
                         f"{cu_seqlens_k.numel() - 1} sequences")
    max_seqlen_q = max_seqlen_arg("max_seqlen_q", max_seqlen_q, longest_q)
    max_seqlen_k = max_seqlen_arg("max_seqlen_k", max_seqlen_k, longest_k)
    dropout_p, alibi_slopes = check_dropout_and_alibi(q, cu_seqlens_q.numel() - 1, dropout_p, alibi_slopes, softcap,
                                                      return_attn_probs)
    if seqused_k is not None:
        cu_seqlens_q, cu_seqlens_k, alibi_slopes = without_unused_keys(k, cu_seqlens_q, cu_seqlens_k, seqused_k,
                                                                       alibi_slopes, return_attn_probs, reads_k)
    head_dim_v = v.shape[-1]
    q, k, v = kernel_inputs(*autocast_inputs(q, k, v))
    window_left, window_right = normalize_window(causal, window_size)
    dropout_seed = draw_dropout_seed(q.device) if dropout_p > 0.0 else None
    if triton_path:
        out, lse = triton_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, dropout_seed, max_seqlen_q,
                                     max_seqlen_k, softmax_scale, window_left, window_right, float(softcap), dropout_p,
                                     deterministic)
    else:
        out, lse = varlen_tiled(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, window_left, window_right,
                                 float(softcap), alibi_slopes, dropout_p, dropout_seed)
    out = out[..., :head_dim_v]
    if return_attn_probs:
        return out, lse, attention_probs_dmask(q, k, softmax_scale, window_left, window_right, float(softcap),
                                               alibi_slopes, dropout_p, dropout_seed, cu_seqlens_q, cu_seqlens_k,
                                               max_seqlen_q, max_seqlen_k)
    return (out, lse) if return_lse else out


def flash_attn_varlen_backward(grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, deterministic=True):
    """The gradients of flash_attn_varlen_func for a given (out, lse), without autograd (flash-attn's
    _flash_attn_varlen_backward).

    Each score's probability is exp(score - lse), so (out, lse) of a softmax over more keys than k
    holds (the merged partial attentions of a ring) give k's exact share of that softmax's gradient.

    Args:
        grad_out, out: (total_q, heads_q, head_dim_v); lse: (heads_q, total_q) fp32.
        q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, window_size, softcap,
            deterministic: as flash_attn_varlen_func (no dropout or ALiBi).
        max_seqlen_q, max_seqlen_k: ints at least the longest sequences (trusted, not read back).
    Returns:
        (dq, dk, dv) shaped like q, k, v.
    """
    softmax_scale, window_size = check_attention_args(q, k, v, 0, softmax_scale, window_size, softcap)
    expected = (*q.shape[:2], v.shape[-1])
    for name, t in (("grad_out", grad_out), ("out", out)):
        if tuple(t.shape) != expected:
            raise ValueError(f"{name} must be (total_q, heads_q, head_dim_v) = {expected}, got {tuple(t.shape)}")
    if lse.dtype != torch.float32 or tuple(lse.shape) != (q.shape[1], q.shape[0]):
        raise ValueError(f"lse must be fp32 (heads_q, total_q) = {(q.shape[1], q.shape[0])}, got {lse.dtype} "
                         f"{tuple(lse.shape)}")
    for name, cu_seqlens, total in (("cu_seqlens_q", cu_seqlens_q, q.shape[0]), ("cu_seqlens_k", cu_seqlens_k,
                                                                                 k.shape[0])):
        check_cu_seqlens(name, cu_seqlens, total, q.device, read_values=False)
    head_dim, head_dim_v = q.shape[-1], v.shape[-1]
    q, k, v = kernel_inputs(q, k, v)
    width = kernel_head_dim(max(head_dim, head_dim_v))
    grad_out, out = (torch.nn.functional.pad(t.to(q.dtype), (0, width - head_dim_v)) for t in (grad_out, out))
    window_left, window_right = normalize_window(causal, window_size)
    dq, dk, dv = varlen_backward(grad_out, q, k, v, out, lse.contiguous(), cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                 max_seqlen_k, softmax_scale, window_left, window_right, float(softcap),
                                 check_deterministic(deterministic))
    return dq[..., :head_dim], dk[..., :head_dim], dv[..., :head_dim_v]


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=True, return_attn_probs=False, *, return_lse=False):
    """Exact attention, flash-attn's dense API, its arguments in its order (return_lse, ours, by keyword).

    Args:
        q, k: (batch, seqlen_q / seqlen_k, heads_q / heads_kv, head_dim); v: (batch, seqlen_k, heads_kv,
            head_dim_v), with heads_q a multiple of heads_kv (MQA / GQA); fp16, bf16 or fp32; any
            strides whose last dim is contiguous. head_dim and head_dim_v in [1, 256]: the kernels run
            q . k and p . v both at kernel_head_dim(max(head_dim, head_dim_v)) (the next multiple of 8,
            at least 16), so inputs below that width are zero-padded (a copy each, as flash-attn
            does) and a head_dim_v below head_dim costs head_dim / head_dim_v times the p . v
            FLOPs of its own width (e.g. 192 / 128 = 1.5x for DeepSeek's MLA).
        causal: mask aligned bottom-right: query i sees key j iff j <= i + seqlen_k - seqlen_q.
        softmax_scale: defaults to head_dim ** -0.5 (q's head_dim before any padding).
        window_size: (left, right) sliding window, -1 = unbounded on that side.
        softcap: if > 0, scores become softcap * tanh(scores / softcap) before masking (and before
            ALiBi's bias). Not with dropout_p > 0 (flash-attn forbids it too).
        return_lse: also return lse (batch, heads_q, seqlen_q), fp32, natural log; -inf for a row
            that sees no key (its output is 0). return_attn_probs returns it too.
        deterministic: True (the default): the backward gives bit-identical gradients run after run.
            False: a faster backward (5 tile matmuls instead of 7) that adds dQ in whatever order the
            GPU's reductions arrive, as flash-attn does by default. The PyTorch path ignores it.
        dropout_p: probability of dropping each attention probability (the kept ones are scaled by
            1 / (1 - dropout_p)); pass 0.0 in eval. The mask comes from Philox keyed by a seed drawn
            from torch's generator on q's device (torch.manual_seed reproduces it) and is regenerated
            in the backward; the Triton and PyTorch paths drop the same elements.
        alibi_slopes: None, or fp32 (heads_q,) or (batch, heads_q): adds -slope * |i + seqlen_k -
            seqlen_q - j| to the score of query i and key j. No gradient flows into the slopes.
        return_attn_probs: return (out, lse, S_dmask) as flash-attn does: S_dmask (batch, heads_q,
            seqlen_q, seqlen_k) fp32 holds the softmax probabilities, the dropped ones negated. It
            materialises seqlen_q x seqlen_k: for testing and debugging.
    Returns:
        out (batch, seqlen_q, heads_q, head_dim_v), or (out, lse), or (out, lse, S_dmask).
    """
    softmax_scale, window_size = check_attention_args(q, k, v, 1, softmax_scale, window_size, softcap)
    dropout_p, alibi_slopes = check_dropout_and_alibi(q, q.shape[0], dropout_p, alibi_slopes, softcap,
                                                      return_attn_probs)
    head_dim_v = v.shape[-1]
    q, k, v = kernel_inputs(*autocast_inputs(q, k, v))
    window_left, window_right = normalize_window(causal, window_size)
    dropout_seed = draw_dropout_seed(q.device) if dropout_p > 0.0 else None
    out, lse = attention_with_lse(q, k, v, softmax_scale, window_left, window_right, float(softcap),
                                  check_deterministic(deterministic), alibi_slopes, dropout_p, dropout_seed)
    out = out[..., :head_dim_v]
    if return_attn_probs:
        return out, lse, attention_probs_dmask(q, k, softmax_scale, window_left, window_right, float(softcap),
                                               alibi_slopes, dropout_p, dropout_seed)
    return (out, lse) if return_lse else out


def _unpack(name, packed, rank, parts):
    """The ``parts`` views of ``packed`` along its dim rank - 3 (no copy); ValueError naming ``name``."""
    if not isinstance(packed, torch.Tensor) or packed.dim() != rank or packed.shape[-3] != parts:
        shape = tuple(packed.shape) if isinstance(packed, torch.Tensor) else type(packed).__name__
        layout = {5: "(batch, seqlen", 4: "(total"}[rank] + f", {parts}, heads, head_dim)"
        raise ValueError(f"{name} must be a {rank}-D tensor {layout}, got {shape}")
    return packed.unbind(-3)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                              alibi_slopes=None, deterministic=True, return_attn_probs=False, *, return_lse=False):
    """flash_attn_func on q, k, v stacked in one tensor (flash-attn's qkvpacked API).

    q, k and v are views of ``qkv`` (the kernels take its strides as they are); the gradient lands in
    ``qkv``.

    Args:
        qkv: (batch, seqlen, 3, heads, head_dim).
        dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
            return_attn_probs, return_lse: as flash_attn_func.
    Returns:
        as flash_attn_func.
    """
    q, k, v = _unpack("qkv", qkv, 5, 3)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs, return_lse=return_lse)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                             alibi_slopes=None, deterministic=True, return_attn_probs=False, *, return_lse=False):
    """flash_attn_func with k and v stacked in one tensor (flash-attn's kvpacked API; MQA / GQA allowed).

    Args:
        q: (batch, seqlen_q, heads_q, head_dim).
        kv: (batch, seqlen_k, 2, heads_kv, head_dim); k and v are views of it, and their gradient
            lands in it.
        dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
            return_attn_probs, return_lse: as flash_attn_func.
    Returns:
        as flash_attn_func.
    """
    k, v = _unpack("kv", kv, 5, 2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs, return_lse=return_lse)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen=None, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=True,
                                     return_attn_probs=False, *, return_lse=False, check_lengths=None):
    """flash_attn_varlen_func on packed sequences whose q, k, v share one tensor (and one cu_seqlens).

    Args:
        qkv: (total, 3, heads, head_dim); q, k, v are views of it, and their gradient lands in it.
        cu_seqlens: int32 (batch + 1,) offsets of the sequences, for q and k alike.
        max_seqlen: the longest sequence; None reads it from cu_seqlens (a host sync on CUDA).
        dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
            return_attn_probs, return_lse, check_lengths: as flash_attn_varlen_func.
    Returns:
        as flash_attn_varlen_func.
    """
    q, k, v = _unpack("qkv", qkv, 4, 3)
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale,
                                  causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
                                  return_lse=return_lse, check_lengths=check_lengths)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None,
                                    dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=True, return_attn_probs=False, *,
                                    return_lse=False, check_lengths=None):
    """flash_attn_varlen_func with k and v stacked in one tensor.

    Args:
        q: (total_q, heads_q, head_dim).
        kv: (total_k, 2, heads_kv, head_dim); k and v are views of it, and their gradient lands in it.
        cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
            window_size, softcap, alibi_slopes, deterministic, return_attn_probs, return_lse,
            check_lengths: as flash_attn_varlen_func.
    Returns:
        as flash_attn_varlen_func.
    """
    k, v = _unpack("kv", kv, 4, 2)
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs, return_lse=return_lse, check_lengths=check_lengths)
