"""The choice of path, autograd and the torch.library ops behind the public functions (flash_attn.py).

The one place that decides which implementation runs is ``kernel_impl``:

* ``"gluon"``: the Triton path with the Hopper kernels written in Gluon (flash_fwd_hopper.py,
  flash_bwd_hopper.py) for the inputs they cover, the ``tl`` kernels for the rest. Runs on sm_90
  devices with a Triton version the Gluon kernels were tested on (GLUON_TRITON_VERSIONS); the default
  there (the H200 runs the kernel suite over both paths).
* ``"triton"``: our portable Triton kernels (flash_fwd.py / flash_bwd.py). Chosen on CUDA devices,
  and on CPU when ``TRITON_INTERPRET=1`` is set (that is how CI executes the kernels).
* ``"torch"``: the tiled PyTorch path of reference.py, O(seqlen) memory. Chosen on CPU otherwise.

Force one with ``FLASHFORMER_KERNEL=gluon|triton|torch`` (process-wide) or ``with force_kernel_impl(...)``
(process-wide; takes precedence).
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

from .reference import attention_probabilities, attention_tiled, dropout_keep_mask, tiled_backward
from . import settings

KERNEL_IMPLS = ("gluon", "triton", "torch")
# Triton releases whose Gluon API and code generation the Hopper kernels were checked on (the H200 runs
# the kernel suite over them); Gluon is experimental and changes between releases.
GLUON_TRITON_VERSIONS = ("3.6.",)


# A plain module global rather than a ContextVar: torch.compile traces global reads (and guards on
# them) but graph-breaks on ContextVar.get.
_forced_impl = None


@contextlib.contextmanager
def force_kernel_impl(impl: str):
    """Run the attention calls inside the block on ``impl`` (one of KERNEL_IMPLS); process-wide."""
    global _forced_impl
    if impl not in KERNEL_IMPLS:
        raise ValueError(f"impl={impl!r}: expected one of {KERNEL_IMPLS}")
    previous, _forced_impl = _forced_impl, impl
    try:
        yield
    finally:
        _forced_impl = previous


def forced_impl() -> str:
    """The implementation that force_kernel_impl or else FLASHFORMER_KERNEL asks for ("auto" when neither does)."""
    return _forced_impl or settings.forced_kernel()


# CUDA device index -> whether the Gluon kernels run there (a plain dict: torch.compile traces its reads).
_GLUON_DEVICES: dict[int, bool] = {}


def hopper_gluon_available(device_index: int) -> bool:
    """Whether CUDA device ``device_index`` is an sm_90 GPU and this Triton is one the Gluon kernels
    were tested on."""
    available = _GLUON_DEVICES.get(device_index)
    if available is None:
        import triton

        try:
            capability = torch.cuda.get_device_capability(device_index)
        except (RuntimeError, AssertionError):  # no CUDA driver or device
            capability = None
        available = _GLUON_DEVICES[device_index] = (capability == (9, 0)
                                                     and triton.__version__.startswith(GLUON_TRITON_VERSIONS))
    return available


def kernel_impl(device: torch.device | str | None = None) -> str:
    """Which implementation runs for tensors on ``device`` (default: the current CUDA device, else the CPU):
    "gluon", "triton" or "torch"."""
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if not isinstance(device, torch.device):
        device = torch.device(device)
    forced = forced_impl()
    if forced in KERNEL_IMPLS:
        if forced == "gluon" and not (device.type == "cuda" and hopper_gluon_available(
                device.index if device.index is not None else torch.cuda.current_device())):
            raise ValueError(f"FLASHFORMER_KERNEL=gluon: the Gluon kernels need an sm_90 CUDA device and Triton "
                             f"{' or '.join(v + 'x' for v in GLUON_TRITON_VERSIONS)}; tensors are on {device}")
        if forced == "triton" and device.type != "cuda" and not settings.INTERPRETED:
            raise ValueError(f"FLASHFORMER_KERNEL=triton with tensors on {device}: the Triton kernels run on CUDA "
                             "devices, or on CPU in Triton's interpreter (set TRITON_INTERPRET=1 before the first "
                             "import of triton)")
        return forced
    if forced != "auto":
        raise ValueError(f"FLASHFORMER_KERNEL={forced!r}: expected one of 'auto', 'gluon', 'triton', 'torch'")
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return "gluon" if hopper_gluon_available(index) else "triton"
    if settings.INTERPRETED:
        return "triton"
    return "torch"


# --- The Triton path. Eagerly it is a plain autograd.Function over the launchers: no dispatcher
# round trip per call (less overhead, and it sidesteps intermittent crashes inside torch 2.13's
# custom-op dispatch on CPU, whose cause lies in torch). Under torch.compile it is the torch.library ops
# below, which the compiler sees as opaque nodes with fakes. Dense and varlen share everything:
# cu_seqlens_q/_k None means dense (batch, seqlen, heads, head_dim).

def _forward_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: Optional[torch.Tensor],
                  cu_seqlens_k: Optional[torch.Tensor], alibi_slopes: Optional[torch.Tensor],
                  dropout_seed: Optional[torch.Tensor], max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float,
                  window_left: int, window_right: int, softcap: float, dropout_p: float,
                  deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    # ``deterministic`` only shapes the backward; it rides along so that autograd hands it back.
    from .flash_fwd import attention_forward

    return attention_forward(q, k, v, softmax_scale, window_left, window_right, softcap,
                             cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                             gluon=kernel_impl(q.device) == "gluon", alibi_slopes=alibi_slopes, dropout_p=dropout_p,
                             dropout_seed=dropout_seed)


def _backward_impl(grad_out: torch.Tensor, grad_lse: Optional[torch.Tensor], q: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, cu_seqlens_q: Optional[torch.Tensor],
                   cu_seqlens_k: Optional[torch.Tensor], alibi_slopes: Optional[torch.Tensor],
                   dropout_seed: Optional[torch.Tensor], max_seqlen_q: int, max_seqlen_k: int,
                   softmax_scale: float, window_left: int, window_right: int, softcap: float, dropout_p: float,
                   deterministic: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from .compile_ahead import wait_for_backward
    from .flash_bwd import attention_backward

    gluon = kernel_impl(q.device) == "gluon"
    wait_for_backward((q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, dropout_seed, max_seqlen_q, max_seqlen_k,
                       softmax_scale, window_left, window_right, softcap, dropout_p, deterministic), gluon)
    return attention_backward(grad_out, grad_lse, q, k, v, out, lse, softmax_scale, window_left, window_right,
                              softcap, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, deterministic,
                              alibi_slopes=alibi_slopes, dropout_p=dropout_p, dropout_seed=dropout_seed, gluon=gluon)


_flash_attn_fwd = torch.library.custom_op("flashformer::flash_attn_fwd", _forward_impl, mutates_args=())
_flash_attn_bwd = torch.library.custom_op("flashformer::flash_attn_bwd", _backward_impl, mutates_args=())


@_flash_attn_fwd.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, dropout_seed, max_seqlen_q, max_seqlen_k, softmax_scale,
      window_left, window_right, softcap, dropout_p, deterministic):
    from .flash_fwd import lse_shape

    return torch.empty_like(q), q.new_empty(lse_shape(q, cu_seqlens_q is not None), dtype=torch.float32)


@_flash_attn_bwd.register_fake
def _(grad_out, grad_lse, q, k, v, out, lse, *args):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _save_for_backward(ctx, inputs, output):
    q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, dropout_seed, *params = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, dropout_seed)
    ctx.params = params


def _gradients(ctx, grad_out, grad_lse, backward=_flash_attn_bwd):
    # The op's registered backward always calls the op: AOT autograd traces it with fake tensors,
    # and torch 2.11's is_compiling() is False there (the kernels' launchers would see fakes).
    q, k, v, out, lse, *offsets_slopes_seed = ctx.saved_tensors
    if grad_out is None:  # only lse was used
        grad_out = torch.zeros_like(out)
    # Layouts are the launcher's business (it copies only what TMA cannot address); no grad_lse
    # (the common case) skips its read instead of materialising zeros.
    dq, dk, dv = backward(grad_out, grad_lse, q, k, v, out, lse, *offsets_slopes_seed, *ctx.params)
    return dq, dk, dv, *([None] * 12)


_flash_attn_fwd.register_autograd(_gradients, setup_context=_save_for_backward)


class _FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, *inputs):
        ctx.set_materialize_grads(False)
        output = _forward_impl(*inputs)
        _save_for_backward(ctx, inputs, output)
        return output

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        return _gradients(ctx, grad_out, grad_lse, backward=_backward_impl)


def triton_attention(*inputs):
    """(out, lse) through the Triton kernels; ``inputs`` as ``_forward_impl`` takes them."""
    if torch.compiler.is_compiling():
        return _flash_attn_fwd(*inputs)
    q, k, v = inputs[:3]
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad) and q.is_cuda:
        from .compile_ahead import submit_backward

        submit_backward(inputs, kernel_impl(q.device) == "gluon")  # its kernels compile beside the forward's
    return _FlashAttention.apply(*inputs)


def attention_with_lse(q, k, v, softmax_scale, window_left, window_right, softcap, deterministic=True,
                       alibi_slopes=None, dropout_p=0.0, dropout_seed=None):
    """Dispatch validated dense inputs to the chosen path; returns (out, lse), both differentiable.
    ``dropout_seed`` (draw_dropout_seed) is needed when dropout_p > 0."""
    if kernel_impl(q.device) != "torch":
        return triton_attention(q, k, v, None, None, alibi_slopes, dropout_seed, 0, 0, softmax_scale, window_left,
                                 window_right, softcap, dropout_p, deterministic)
    if alibi_slopes is not None:
        alibi_slopes = alibi_slopes.expand(q.shape[0], q.shape[2])
    return attention_tiled(q, k, v, softmax_scale, window_left, window_right, softcap, alibi_slopes, dropout_p,
                           _seed_value(dropout_p, dropout_seed))


def _seed_value(dropout_p, dropout_seed):
    """The PyTorch path's seed as an int (a device read where the seed lives on a GPU)."""
    return int(dropout_seed.item()) if dropout_p > 0.0 else 0


def varlen_tiled(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, window_left, window_right, softcap,
                  alibi_slopes, dropout_p, dropout_seed):
    """The PyTorch varlen path: the tiled reference on each sequence; lse (heads, total_q)."""
    outs, lses = [], []
    bounds = zip(cu_seqlens_q.tolist(), cu_seqlens_q[1:].tolist(), cu_seqlens_k.tolist(), cu_seqlens_k[1:].tolist())
    if alibi_slopes is not None:
        alibi_slopes = alibi_slopes.expand(cu_seqlens_q.numel() - 1, q.shape[1])
    seed = _seed_value(dropout_p, dropout_seed)
    for b, (q0, q1, k0, k1) in enumerate(bounds):
        out, lse = attention_tiled(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], softmax_scale, window_left,
                                   window_right, softcap, None if alibi_slopes is None else alibi_slopes[b:b + 1],
                                   dropout_p, seed, batch_start=b)
        outs.append(out[0])
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=1)


def varlen_backward(grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                    softmax_scale, window_left, window_right, softcap, deterministic):
    """(dq, dk, dv) of validated varlen inputs for a given (out, lse), on the chosen path; not autograd.
    Where (out, lse) are those of a softmax over more keys than k holds, the gradients are k's share of
    that softmax's (what ring attention needs)."""
    if kernel_impl(q.device) != "torch":
        return _backward_impl(grad_out, None, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, None, None, max_seqlen_q,
                              max_seqlen_k, softmax_scale, window_left, window_right, softcap, 0.0, deterministic)
    grads = [torch.empty_like(t) for t in (q, k, v)]
    bounds = zip(cu_seqlens_q.tolist(), cu_seqlens_q[1:].tolist(), cu_seqlens_k.tolist(), cu_seqlens_k[1:].tolist())
    for q0, q1, k0, k1 in bounds:
        dq, dk, dv = tiled_backward(grad_out[None, q0:q1], None, q[None, q0:q1], k[None, k0:k1], v[None, k0:k1],
                                    out[None, q0:q1], lse[None, :, q0:q1].contiguous(), softmax_scale, window_left,
                                    window_right, softcap)
        for grad, block, start, end in zip(grads, (dq, dk, dv), (q0, k0, k0), (q1, k1, k1)):
            grad[start:end] = block[0]
    return grads


@torch.no_grad()
def attention_probs_dmask(q, k, softmax_scale, window_left, window_right, softcap, alibi_slopes, dropout_p,
                          dropout_seed, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0):
    """flash-attn's S_dmask for return_attn_probs: the softmax probabilities (batch, heads_q, seqlen_q,
    seqlen_k) fp32, those dropout dropped negated (its encoding; a dropped 0 reads -0.0). Materialises
    the score matrix (a testing aid, as in flash-attn), with the mask the kernels drew from the same
    seed. Varlen inputs give (batch, heads_q, max_seqlen_q, max_seqlen_k), zero past each sequence."""
    if cu_seqlens_q is None:
        batch, max_seqlen_q, max_seqlen_k = q.shape[0], q.shape[1], k.shape[1]
        chunks = [(0, batch, q, k)]
    else:
        batch = cu_seqlens_q.numel() - 1
        bounds = zip(cu_seqlens_q.tolist(), cu_seqlens_q[1:].tolist(), cu_seqlens_k.tolist(), cu_seqlens_k[1:].tolist())
        chunks = [(b, b + 1, q[None, q0:q1], k[None, k0:k1]) for b, (q0, q1, k0, k1) in enumerate(bounds)]
    heads_q = q.shape[-2]
    probs = q.new_zeros((batch, heads_q, max_seqlen_q, max_seqlen_k), dtype=torch.float32)
    slopes = None if alibi_slopes is None else alibi_slopes.expand(batch, heads_q)
    seed = _seed_value(dropout_p, dropout_seed)
    for b0, b1, q_chunk, k_chunk in chunks:
        seqlen_q, seqlen_k = q_chunk.shape[1], k_chunk.shape[1]
        p, _ = attention_probabilities(q_chunk.float(), k_chunk.float(), softmax_scale, False,
                                       (window_left, window_right), softcap, None if slopes is None else slopes[b0:b1])
        if dropout_p > 0.0:
            keep = dropout_keep_mask(seed, dropout_p, torch.arange(b0, b1, device=q.device).view(-1, 1, 1, 1),
                                     torch.arange(heads_q, device=q.device).view(-1, 1, 1),
                                     torch.arange(seqlen_q, device=q.device).view(-1, 1),
                                     torch.arange(seqlen_k, device=q.device))
            p = torch.where(keep, p, -p)
        probs[b0:b1, :, :seqlen_q, :seqlen_k] = p
    return probs
