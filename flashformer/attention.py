"""The one place that maps ``attn_backend`` to an attention implementation.

* ``"flash"``: ``flashformer.kernels.flash_attn_func`` (Triton on CUDA, or on CPU under
  TRITON_INTERPRET=1; the kernels' own tiled PyTorch path otherwise).
* ``"flash-nondeterministic"``: the same kernels with ``deterministic=False``: a faster backward
  whose dQ sums arrive in varying order (flash-attn's default), so gradients differ in the last bits
  from run to run.
* ``"reference"``: the kernels' tiled PyTorch path (O(seqlen) memory), whatever the device.
* ``"sdpa"``: ``torch.nn.functional.scaled_dot_product_attention``, with an explicit boolean mask
  when the window or the bottom-right causal alignment needs one.
* ``"naive"``: the materialized score matrix in the input precision (what flash saves us from).
* ``"auto"``: flash on CUDA, reference elsewhere.

All of them share flash-attn's semantics: (batch, seqlen, heads, head_dim) tensors, GQA by
heads_q a multiple of heads_kv, causal masks aligned bottom-right, ``window_size=(left, right)``.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from .kernels import attention_materialized, flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
from .kernels.checks import check_cu_seqlens
from .kernels.interface import force_kernel_impl
from .kernels.masking import normalize_window, visible_mask

ATTN_BACKENDS = ("auto", "flash", "flash-nondeterministic", "reference", "sdpa", "naive")
FLASH_BACKENDS = ("flash", "flash-nondeterministic", "reference")  # the kernels' API, on some path


def resolve_backend(backend: str, device: torch.device) -> str:
    """Map ``"auto"`` to the concrete backend for ``device``; reject unknown names."""
    if backend not in ATTN_BACKENDS:
        raise ValueError(f"attn_backend={backend!r}: expected one of {', '.join(map(repr, ATTN_BACKENDS))}")
    if backend == "auto":
        return "flash" if device.type == "cuda" else "reference"
    return backend


def _flash(q, k, v, causal, window_size, softcap, softmax_scale, deterministic=True):
    return flash_attn_func(q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                           softcap=softcap, deterministic=deterministic)


def _flash_nondeterministic(q, k, v, causal, window_size, softcap, softmax_scale):
    return _flash(q, k, v, causal, window_size, softcap, softmax_scale, deterministic=False)


def _reference(q, k, v, causal, window_size, softcap, softmax_scale):
    with _kernel_path("reference"):
        return _flash(q, k, v, causal, window_size, softcap, softmax_scale)


def _sdpa(q, k, v, causal, window_size, softcap, softmax_scale):
    if softcap:
        raise ValueError("attn_backend='sdpa' cannot apply softcap; use 'flash', 'reference' or 'naive'")
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


_DENSE = {"flash": _flash, "flash-nondeterministic": _flash_nondeterministic, "reference": _reference,
          "sdpa": _sdpa, "naive": _naive}

# While set (route_attention), full-sequence calls go here instead of the backend: how context
# parallelism swaps in ring attention from outside the model. A module global, as force_kernel_impl.
_ROUTED = None


@contextlib.contextmanager
def route_attention(fn):
    """Inside, ``attention`` calls without cu_seqlens run ``fn(q, k, v, causal, window_size, softcap,
    softmax_scale)`` whatever the backend (flashformer.context_parallel uses it for ring attention)."""
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


def _kernel_path(backend):
    """"reference" is the kernels' API forced onto its PyTorch path."""
    return force_kernel_impl("torch") if backend == "reference" else contextlib.nullcontext()


def _varlen_kernel(backend, q, k, v, cu_seqlens, max_seqlen, causal, window_size, softcap, softmax_scale):
    """flash / reference on packed documents: the kernels' varlen path."""
    with _kernel_path(backend):
        return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, causal=causal,
                                      softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
                                      deterministic=backend != "flash-nondeterministic")


def attention(q, k, v, *, backend, causal=True, window_size=(-1, -1), softcap=0.0, softmax_scale=None,
              cu_seqlens=None, max_seqlen=None):
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
    Returns:
        (batch, seqlen_q, heads_q, head_dim), like q.
    """
    backend = resolve_backend(backend, q.device)
    if _ROUTED is not None:
        if cu_seqlens is not None:
            raise ValueError("cu_seqlens (packed documents) cannot be used under context parallelism: "
                             "its ring attends over whole sequences")
        return _ROUTED(q, k, v, causal, window_size, softcap, softmax_scale)
    dense_fn = _DENSE[backend]
    if cu_seqlens is None:
        return dense_fn(q, k, v, causal, window_size, softcap, softmax_scale)
    batch, seqlen = q.shape[:2]
    if k.shape[:2] != (batch, seqlen):
        raise ValueError(f"cu_seqlens needs q and k of equal (batch, seqlen), "
                         f"got {tuple(q.shape)} and {tuple(k.shape)}")
    q, k, v = q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1)
    if backend in FLASH_BACKENDS:
        out = _varlen_kernel(backend, q, k, v, cu_seqlens, max_seqlen, causal, window_size, softcap, softmax_scale)
    else:
        check_cu_seqlens("cu_seqlens", cu_seqlens, batch * seqlen, q.device)
        out = _varlen_loop(dense_fn, q, k, v, cu_seqlens, causal, window_size, softcap, softmax_scale)
    return out.view(batch, seqlen, *out.shape[1:])


def cached_attention(q, k, v, k_cache, v_cache, cache_length, *, backend, window_size=(-1, -1), softcap=0.0,
                     softmax_scale=None):
    """Decoding step: write k, v into the caches at ``cache_length`` and attend q to everything cached.

    Args:
        q: (batch, new, heads_q, head_dim); k, v: (batch, new, heads_kv, head_dim).
        k_cache, v_cache: (batch, max_len, heads_kv, head_dim), updated in place.
        cache_length: tokens already cached (the same for every sequence).
    Returns:
        (batch, new, heads_q, head_dim), causal (bottom-right) over cache_length + new keys.
    """
    backend = resolve_backend(backend, q.device)
    if backend in FLASH_BACKENDS:
        with _kernel_path(backend):
            return flash_attn_with_kvcache(q, k_cache, v_cache, k=k, v=v, cache_seqlens=cache_length, causal=True,
                                           softmax_scale=softmax_scale, window_size=window_size, softcap=softcap)
    end = cache_length + k.shape[1]
    k_cache[:, cache_length:end] = k
    v_cache[:, cache_length:end] = v
    return _DENSE[backend](q, k_cache[:, :end], v_cache[:, :end], True, window_size, softcap, softmax_scale)
