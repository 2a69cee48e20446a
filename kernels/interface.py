"""Public attention functions: argument checks, the choice of path, autograd and torch.library ops.

The one place that decides which implementation runs is ``kernel_impl``:

* ``"triton"``: our Triton kernels (flash_fwd.py / flash_bwd.py). Chosen on CUDA, and on CPU when
  ``TRITON_INTERPRET=1`` is set (that is how CI executes the kernels).
* ``"torch"``: the tiled PyTorch path of reference.py, O(seqlen) memory. Chosen on CPU otherwise.

Set ``FLASHFORMER_KERNEL=triton|torch`` to force one.
"""

from __future__ import annotations

import os

import torch

from .masking import normalize_window
from .reference import attention_tiled

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256
KERNEL_IMPLS = ("triton", "torch")


def kernel_impl(device: torch.device) -> str:
    """Which implementation runs for tensors on ``device``: "triton" or "torch"."""
    forced = os.environ.get("FLASHFORMER_KERNEL", "auto")
    if forced in KERNEL_IMPLS:
        return forced
    if forced != "auto":
        raise ValueError(f"FLASHFORMER_KERNEL={forced!r}: expected one of 'auto', 'triton', 'torch'")
    if device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return "triton"
    return "torch"


def _check_tensor(name, t, rank):
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != rank:
        raise ValueError(f"{name} must have {rank} dims, got shape {tuple(t.shape)}")
    if t.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{name} has dtype {t.dtype}; supported: float16, bfloat16, float32")


def check_attention_args(q, k, v, seq_dim, softmax_scale, window_size, softcap):
    """Validate q/k/v and options shared by every public function; return (scale, window_size).

    Args:
        q, k, v: attention inputs whose last two dims are (heads, head_dim); ``seq_dim`` is the
            index of the sequence dim (dims before it must agree between q and k/v).
    """
    rank = seq_dim + 3
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, t, rank)
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if q.shape[:seq_dim] != k.shape[:seq_dim]:
        raise ValueError(f"q and k disagree in batch: {tuple(q.shape)} vs {tuple(k.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    head_dim = q.shape[-1]
    if k.shape[-1] != head_dim:
        raise ValueError(f"head_dim of q ({head_dim}) and k ({k.shape[-1]}) differ")
    if head_dim % 8 or not MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim={head_dim}: must be a multiple of 8 in [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}]")
    heads_q, heads_kv = q.shape[-2], k.shape[-2]
    if heads_kv == 0 or heads_q % heads_kv:
        raise ValueError(f"heads of q ({heads_q}) must be a multiple of heads of k/v ({heads_kv})")
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or not all(isinstance(w, int) and not isinstance(w, bool) and w >= -1 for w in window_size)):
        raise ValueError(f"window_size must be a pair of ints >= -1 (-1 = unbounded), got {window_size!r}")
    if not isinstance(softcap, (int, float)) or softcap < 0:
        raise ValueError(f"softcap must be a float >= 0 (0 disables it), got {softcap!r}")
    if softmax_scale is None:
        softmax_scale = head_dim**-0.5
    elif not isinstance(softmax_scale, (int, float)) or softmax_scale <= 0:
        raise ValueError(f"softmax_scale must be a positive float or None, got {softmax_scale!r}")
    return float(softmax_scale), (int(window_size[0]), int(window_size[1]))


def autocast_inputs(*tensors):
    """Under torch.autocast, run attention in the autocast dtype (as SDPA does)."""
    device_type = tensors[0].device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        return tuple(t.to(dtype) for t in tensors)
    return tensors


# --- the Triton path as torch.library ops, so torch.compile sees one opaque node with a fake ---

@torch.library.custom_op("flashformer::flash_attn_fwd", mutates_args=())
def _flash_attn_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float,
                    window_left: int, window_right: int, softcap: float) -> tuple[torch.Tensor, torch.Tensor]:
    from .flash_fwd import attention_forward

    return attention_forward(q, k, v, softmax_scale, window_left, window_right, softcap)


@_flash_attn_fwd.register_fake
def _(q, k, v, softmax_scale, window_left, window_right, softcap):
    batch, seqlen_q, heads_q, _ = q.shape
    return torch.empty_like(q), q.new_empty((batch, heads_q, seqlen_q), dtype=torch.float32)


@torch.library.custom_op("flashformer::flash_attn_bwd", mutates_args=())
def _flash_attn_bwd(grad_out: torch.Tensor, grad_lse: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                    v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, softmax_scale: float,
                    window_left: int, window_right: int,
                    softcap: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from .flash_bwd import attention_backward

    return attention_backward(grad_out, grad_lse, q, k, v, out, lse, softmax_scale, window_left,
                              window_right, softcap)


@_flash_attn_bwd.register_fake
def _(grad_out, grad_lse, q, k, v, out, lse, softmax_scale, window_left, window_right, softcap):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _fwd_setup_context(ctx, inputs, output):
    q, k, v, softmax_scale, window_left, window_right, softcap = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.params = (softmax_scale, window_left, window_right, softcap)


def _fwd_backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    if grad_lse is None:
        grad_lse = torch.zeros_like(lse)
    dq, dk, dv = _flash_attn_bwd(grad_out.contiguous(), grad_lse.contiguous(), q, k, v, out, lse,
                                 *ctx.params)
    return dq, dk, dv, None, None, None, None


_flash_attn_fwd.register_autograd(_fwd_backward, setup_context=_fwd_setup_context)


def attention_with_lse(q, k, v, softmax_scale, window_left, window_right, softcap):
    """Dispatch validated dense inputs to the chosen path; returns (out, lse), both differentiable."""
    if kernel_impl(q.device) == "triton":
        return _flash_attn_fwd(q, k, v, softmax_scale, window_left, window_right, softcap)
    return attention_tiled(q, k, v, softmax_scale, window_left, window_right, softcap)


def flash_attn_func(q, k, v, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                    return_lse=False):
    """Exact attention, flash-attn's dense API.

    Args:
        q: (batch, seqlen_q, heads_q, head_dim); k, v: (batch, seqlen_k, heads_kv, head_dim) with
            heads_q a multiple of heads_kv (MQA / GQA); fp16, bf16 or fp32; head_dim a multiple of 8
            in [16, 256]; any strides whose last dim is contiguous.
        causal: mask aligned bottom-right: query i sees key j iff j <= i + seqlen_k - seqlen_q.
        softmax_scale: defaults to head_dim ** -0.5.
        window_size: (left, right) sliding window, -1 = unbounded on that side.
        softcap: if > 0, scores become softcap * tanh(scores / softcap) before masking.
        return_lse: also return lse (batch, heads_q, seqlen_q), fp32, natural log; -inf for a row
            that sees no key (its output is 0).
    Returns:
        out (batch, seqlen_q, heads_q, head_dim), or (out, lse).
    """
    softmax_scale, window_size = check_attention_args(q, k, v, 1, softmax_scale, window_size, softcap)
    q, k, v = autocast_inputs(q, k, v)
    window_left, window_right = normalize_window(causal, window_size)
    out, lse = attention_with_lse(q, k, v, softmax_scale, window_left, window_right, float(softcap))
    return (out, lse) if return_lse else out
