"""What flash_attn_with_kvcache and flash_attn_varlen_func's paged form share: the page rules of a paged
cache, rotary embeddings at each new token's cache position (PyTorch ops, before the append), and the index
tensors fixed by sizes alone that their host-bound calls keep (size_index)."""

from __future__ import annotations

import torch

from .checks import describe

PAGE_MULTIPLE = 16  # a page must hold whole 16-key tiles (tl.dot's smallest K dimension)


def count_bad_pages(k_cache, block_table, lengths_t):
    """How many block_table entries among the pages in use lie outside the pool (a 0-d device tensor).
    Only the pages in use must be valid: the rest of a row may hold anything (as in flash-attn)."""
    pages_used = (lengths_t.clamp(min=0)[:, None] + k_cache.shape[1] - 1) // k_cache.shape[1]
    in_use = torch.arange(block_table.shape[1], device=block_table.device) < pages_used
    return (((block_table < 0) | (block_table >= k_cache.shape[0])) & in_use).sum()


def raise_for_bad_pages(bad, k_cache):
    if bad:
        raise ValueError(f"block_table has {bad} entries outside [0, num_blocks={k_cache.shape[0]}) among the pages "
                         "in use")


def rotate(x, cos, sin, positions, interleaved):
    """x (batch, seqlen, heads, head_dim) with its first 2 * cos.shape[1] dims rotated by the rows
    ``positions`` (broadcastable to (batch, seqlen)) of cos / sin, computed in fp32."""
    rotary_dim = 2 * cos.shape[1]
    cos, sin = cos[positions][:, :, None].float(), sin[positions][:, :, None].float()
    x_rotary = x[..., :rotary_dim].float()
    if interleaved:  # pairs (0, 1), (2, 3), ...
        x1, x2 = x_rotary[..., 0::2], x_rotary[..., 1::2]
        rotated = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    else:  # pairs (i, i + rotary_dim / 2), GPT-NeoX style
        x1, x2 = x_rotary.chunk(2, dim=-1)
        rotated = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return torch.cat((rotated.to(x.dtype), x[..., rotary_dim:]), dim=-1)


def check_rotary(rotary_cos, rotary_sin, rotary_interleaved, q, k, capacity):
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("rotary_cos and rotary_sin must be given together or both left None")
    if not isinstance(rotary_interleaved, bool):
        raise ValueError(f"rotary_interleaved must be a bool, got {rotary_interleaved!r}")
    if rotary_cos is None:
        return
    if k is None:
        raise ValueError("rotary_cos / rotary_sin rotate the new keys before the append: they need k and v")
    for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        if (not isinstance(t, torch.Tensor) or t.dim() != 2 or not t.dtype.is_floating_point
                or t.device != q.device):
            raise ValueError(f"{name} must be a 2-D float tensor (seqlen_ro, rotary_dim / 2) on {q.device}, got "
                             f"{describe(t)}")
    if rotary_cos.shape != rotary_sin.shape:
        raise ValueError(f"rotary_cos and rotary_sin must have the same shape, got {tuple(rotary_cos.shape)} and "
                         f"{tuple(rotary_sin.shape)}")
    rotary_dim = 2 * rotary_cos.shape[1]
    if not 0 < rotary_dim <= q.shape[-1]:
        raise ValueError(f"rotary_cos: rotary_dim = 2 * {rotary_cos.shape[1]} must be in [2, head_dim={q.shape[-1]}]")
    if rotary_cos.shape[0] < capacity:
        raise ValueError(f"rotary_cos has {rotary_cos.shape[0]} positions but the cache holds {capacity} entries per "
                         "sequence (flash-attn's rule: seqlen_ro >= the cache's length)")


# Index tensors fixed by sizes alone, kept per device and stream and never written: a short prompt's time is host
# time, and each tensor built per call is a launch or more. Per stream, because a tensor is built on the stream that
# first asks for it: read from another stream it could still be unwritten, and evicted it returns to its stream's
# pool while another stream's kernels may still read it.
_SIZE_INDICES: dict[tuple, torch.Tensor] = {}
MAX_SIZE_INDICES = 256


def size_index(build, *sizes, device):
    """``build(*sizes, device)``, built once per (build, sizes, device, current stream); read it, never write it."""
    # A traced or captured graph makes its own: a kept tensor could be evicted (freed) while a CUDA graph still
    # reads it, and one made while tracing could be a graph output whose memory a replay reuses.
    if torch.compiler.is_compiling() or (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        return build(*sizes, device)
    stream = torch.cuda.current_stream(device).stream_id if device.type == "cuda" else None
    key = (build, device, stream, *sizes)
    index = _SIZE_INDICES.get(key)
    if index is None:
        if len(_SIZE_INDICES) >= MAX_SIZE_INDICES:
            _SIZE_INDICES.clear()
        index = _SIZE_INDICES[key] = build(*sizes, device)
    return index


def arange(n, device):
    """0 .. n - 1, int64."""
    return torch.arange(n, device=device)
