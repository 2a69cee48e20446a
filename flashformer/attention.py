"""The one place that maps ``attn_backend`` to an attention implementation.

``attn_backend`` is a runtime choice (``Transformer(config, attn_backend=...)``,
``from_pretrained(..., attn_backend=...)``, a training recipe's top-level ``attn_backend``), never part
of a checkpoint:

* ``"flash"``: ``flashformer.kernels``' API, whose ``kernel_impl`` picks the implementation for the
  device (Gluon or Triton on CUDA, Triton's interpreter under TRITON_INTERPRET=1, PyTorch otherwise;
  FLASHFORMER_KERNEL forces one).
* ``"sdpa"``: ``torch.nn.functional.scaled_dot_product_attention``, with an explicit boolean mask
  when the window or the bottom-right causal alignment needs one.
* ``"naive"``: the materialized score matrix in the input precision (what flash saves us from).
* ``"auto"`` (the default) is ``"flash"``: the only device-dependent choice is ``kernel_impl``'s.

``deterministic`` (a training option) reaches the flash backward: False gives a faster backward whose dQ
sums arrive in varying order (flash-attn's default), so gradients differ in the last bits run to run.

All of them share flash-attn's semantics: (batch, seqlen, heads, head_dim) tensors, GQA by
heads_q a multiple of heads_kv, causal masks aligned bottom-right, ``window_size=(left, right)``.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from .kernels import attention_materialized, flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
from .kernels.checks import check_cu_seqlens
from .kernels.masking import normalize_window, visible_mask

ATTN_BACKENDS = ("auto", "flash", "sdpa", "naive")
# Names that once were backends, and how to ask for what they did.
RETIRED_BACKENDS = {"flash-nondeterministic": "attn_backend='flash' with deterministic=False (a training option)",
                    "reference": "attn_backend='flash' with FLASHFORMER_KERNEL=torch (the kernels' PyTorch path)"}


def resolve_backend(backend: str) -> str:
    """The concrete backend of ``backend`` ("auto" is "flash"); reject unknown names."""
    if backend in RETIRED_BACKENDS:
        raise ValueError(f"attn_backend={backend!r} is no longer a backend: use {RETIRED_BACKENDS[backend]}")
    if backend not in ATTN_BACKENDS:
        raise ValueError(f"attn_backend={backend!r}: expected one of {', '.join(map(repr, ATTN_BACKENDS))}")
    return "flash" if backend == "auto" else backend


def _sdpa(q, k, v, causal, window_size, softcap, softmax_scale):
    if softcap:
        raise ValueError("attn_backend='sdpa' cannot apply softcap; use 'flash' or 'naive'")
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    window_left, window_right = normalize_window(causal, window_size)
    is_causal, mask = False, None
    if causal and window_left < 0 and seqlen_q == seqlen_k:
        is_causal = True  # SDPA's top-left causal mask equals ours only for square scores
    elif window_left >= 0 or window_right >= 0:
        mask = visible_mask(0, seqlen_q, 0, seqlen_k, seqlen_q, seqlen_k, window_left, window_right, q.device)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                         is_causal=is_causal, scale=softmax_scale, enable_gqa=True)
    return out.transpose(1, 2)


def _naive(q, k, v, causal, window_size, softcap, softmax_scale):
    out, _ = attention_materialized(q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                                    softcap=softcap, upcast=False)
    return out


_MATH = {"sdpa": _sdpa, "naive": _naive}  # the backends without a kernel of ours

# While set (route_attention), full-sequence calls go here instead of the backend. Context parallelism
# needs this from outside the model: its ring attention is bound to a process group, which a backend
# name cannot carry, and the model stays single-device. A module global, as force_kernel_impl.
_ROUTED = None


@contextlib.contextmanager
def route_attention(fn):
    """Inside, full-sequence ``attention`` calls run ``fn(q, k, v, causal, window_size, softcap, softmax_scale,
    cu_seqlens)`` whatever the backend (flashformer.context_parallel uses it for ring attention; there q, k, v
    are this rank's slice of the rows, and cu_seqlens, if any, bounds the documents of the whole rows)."""
    global _ROUTED
    previous, _ROUTED = _ROUTED, fn
    try:
        yield
    finally:
        _ROUTED = previous


def _varlen_loop(dense_fn, q, k, v, cu_seqlens, causal, window_size, softcap, softmax_scale):
    """sdpa / naive on packed documents: one dense call per document (they have no varlen kernel)."""
    boundaries = cu_seqlens.tolist()
    outputs = [dense_fn(q[None, start:end], k[None, start:end], v[None, start:end], causal, window_size, softcap,
                        softmax_scale)[0]
               for start, end in zip(boundaries[:-1], boundaries[1:]) if end > start]
    return torch.cat(outputs, dim=0)


def attention(q, k, v, *, backend, causal=True, window_size=(-1, -1), softcap=0.0, softmax_scale=None,
              cu_seqlens=None, max_seqlen=None, deterministic=True):
    """Exact attention through the chosen backend.

    Args:
        q: (batch, seqlen_q, heads_q, head_dim); k, v: (batch, seqlen_k, heads_kv, head_dim).
        backend: one of ATTN_BACKENDS.
        causal: bottom-right aligned causal mask.
        window_size: (left, right) sliding window, -1 = unbounded.
        softcap: if > 0, scores become softcap * tanh(scores / softcap).
        softmax_scale: defaults to head_dim ** -0.5.
        cu_seqlens: int32 (num_docs + 1,) document boundaries over the batch * seqlen flattened
            tokens; no token attends across a boundary. Requires seqlen_q == seqlen_k.
        max_seqlen: longest document (used by the varlen kernel; optional here).
        deterministic: the flash backward's (see the module docstring); the other backends are
            deterministic anyway.
    Returns:
        (batch, seqlen_q, heads_q, head_dim), like q.
    """
    backend = resolve_backend(backend)
    if _ROUTED is not None:
        return _ROUTED(q, k, v, causal, window_size, softcap, softmax_scale, cu_seqlens)
    if cu_seqlens is None:
        if backend == "flash":
            return flash_attn_func(q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                                   softcap=softcap, deterministic=deterministic)
        return _MATH[backend](q, k, v, causal, window_size, softcap, softmax_scale)
    batch, seqlen = q.shape[:2]
    if k.shape[:2] != (batch, seqlen):
        raise ValueError(f"cu_seqlens needs q and k of equal (batch, seqlen), "
                         f"got {tuple(q.shape)} and {tuple(k.shape)}")
    q, k, v = q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1)
    if backend == "flash":
        out = flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, causal=causal,
                                     softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
                                     deterministic=deterministic)
    else:
        check_cu_seqlens("cu_seqlens", cu_seqlens, batch * seqlen, q.device)
        out = _varlen_loop(_MATH[backend], q, k, v, cu_seqlens, causal, window_size, softcap, softmax_scale)
    return out.view(batch, seqlen, *out.shape[1:])


def cached_attention(q, k, v, k_cache, v_cache, cache_length, *, backend, window_size=(-1, -1), softcap=0.0,
                     softmax_scale=None):
    """Decoding step: write k, v into the caches at ``cache_length`` and attend q to everything cached.

    Args:
        q: (batch, new, heads_q, head_dim); k, v: (batch, new, heads_kv, head_dim).
        k_cache, v_cache: (batch, max_len, heads_kv, head_dim), updated in place.
        cache_length: tokens already cached: an int (the same for every sequence), or for "flash"
            an int32 (batch,) tensor on the device, trusted unchecked so that the step reads no host
            value (it can be captured in a CUDA graph).
    Returns:
        (batch, new, heads_q, head_dim), causal (bottom-right) over cache_length + new keys.
    """
    backend = resolve_backend(backend)
    if backend == "flash":
        return flash_attn_with_kvcache(q, k_cache, v_cache, k=k, v=v, cache_seqlens=cache_length, causal=True,
                                       softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
                                       check_lengths=False if isinstance(cache_length, torch.Tensor) else None)
    if isinstance(cache_length, torch.Tensor):
        raise ValueError(f"a cache length held on the device needs attn_backend='flash', got {backend!r}")
    end = cache_length + k.shape[1]
    k_cache[:, cache_length:end] = k
    v_cache[:, cache_length:end] = v
    return _MATH[backend](q, k_cache[:, :end], v_cache[:, :end], True, window_size, softcap, softmax_scale)
