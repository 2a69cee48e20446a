"""Public attention functions: argument checks, the choice of path, autograd and torch.library ops.

The one place that decides which implementation runs is ``kernel_impl``:

* ``"gluon"``: the Triton path with the Hopper kernels written in Gluon (flash_fwd_hopper.py) for the
  inputs they cover, the ``tl`` kernels for the rest. Runs on sm_90 devices with a Triton version the
  Gluon kernels were tested on (GLUON_TRITON_VERSIONS); the default there (the H200 runs the kernel suite
  over both paths).
* ``"triton"``: our portable Triton kernels (flash_fwd.py / flash_bwd.py). Chosen on CUDA devices,
  and on CPU when ``TRITON_INTERPRET=1`` is set (that is how CI executes the kernels).
* ``"torch"``: the tiled PyTorch path of reference.py, O(seqlen) memory. Chosen on CPU otherwise.

Force one with ``FLASHFORMER_KERNEL=gluon|triton|torch`` (process-wide) or ``with force_kernel_impl(...)``
(process-wide; takes precedence).
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Optional

import torch

from .masking import normalize_window
from .reference import attention_tiled
from . import settings
from .sizes import HEAD_DIM_MULTIPLE, MAX_HEAD_DIM, MIN_HEAD_DIM, cdiv

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
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


def kernel_impl(device: torch.device) -> str:
    """Which implementation runs for tensors on ``device``: "gluon", "triton" or "torch"."""
    forced = _forced_impl or settings.forced_kernel()
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
            index of the sequence dim (dims before it must agree between q and k/v). q and k share
            a head_dim; v's may differ. Any head_dim in [1, MAX_HEAD_DIM] passes: see kernel_inputs.
        softmax_scale: None defaults to q's head_dim ** -0.5.
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
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"k and v must have the same shape but for head_dim, got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    head_dim = q.shape[-1]
    if k.shape[-1] != head_dim:
        raise ValueError(f"head_dim of q ({head_dim}) and k ({k.shape[-1]}) differ")
    for name, dim in (("head_dim", head_dim), ("head_dim of v", v.shape[-1])):
        if not 1 <= dim <= MAX_HEAD_DIM:
            raise ValueError(f"{name}={dim}: must be in [1, {MAX_HEAD_DIM}]")
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


def kernel_head_dim(head_dim):
    """The head_dim the kernels run ``head_dim`` at: the next multiple of HEAD_DIM_MULTIPLE, at least
    MIN_HEAD_DIM (tensor descriptors need 16-byte strides, tl.dot a K of 16)."""
    return max(MIN_HEAD_DIM, cdiv(head_dim, HEAD_DIM_MULTIPLE) * HEAD_DIM_MULTIPLE)


def kernel_inputs(q, k, v):
    """q, k, v zero-padded along head_dim to the one width the kernels run both products at:
    kernel_head_dim of the wider of q/k's and v's head_dim.

    Zero columns add nothing to q . k, and v's zero columns give output columns that the caller drops
    (``out[..., :v.shape[-1]]``); autograd carries the gradients back through the pad and that slice.
    Inputs already at the width pass through as they are (no copy).
    """
    width = kernel_head_dim(max(q.shape[-1], v.shape[-1]))
    return tuple(t if t.shape[-1] == width else torch.nn.functional.pad(t, (0, width - t.shape[-1]))
                 for t in (q, k, v))


def autocast_inputs(*tensors):
    """Under torch.autocast, run attention in the autocast dtype (as SDPA does)."""
    device_type = tensors[0].device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        return tuple(t.to(dtype) for t in tensors)
    return tensors


# --- The Triton path. Eagerly it is a plain autograd.Function over the launchers: no dispatcher
# round trip per call (less overhead, and it sidesteps intermittent crashes inside torch 2.13's
# custom-op dispatch on CPU, whose cause lies in torch). Under torch.compile it is the torch.library ops
# below, which the compiler sees as opaque nodes with fakes. Dense and varlen share everything:
# cu_seqlens_q/_k None means dense (batch, seqlen, heads, head_dim).

def _forward_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: Optional[torch.Tensor],
                  cu_seqlens_k: Optional[torch.Tensor], max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float,
                  window_left: int, window_right: int, softcap: float,
                  deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    # ``deterministic`` only shapes the backward; it rides along so that autograd hands it back.
    from .flash_fwd import attention_forward

    return attention_forward(q, k, v, softmax_scale, window_left, window_right, softcap,
                             cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                             gluon=kernel_impl(q.device) == "gluon")


def _backward_impl(grad_out: torch.Tensor, grad_lse: Optional[torch.Tensor], q: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, cu_seqlens_q: Optional[torch.Tensor],
                   cu_seqlens_k: Optional[torch.Tensor], max_seqlen_q: int, max_seqlen_k: int,
                   softmax_scale: float, window_left: int, window_right: int,
                   softcap: float, deterministic: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from .flash_bwd import attention_backward

    return attention_backward(grad_out, grad_lse, q, k, v, out, lse, softmax_scale, window_left, window_right,
                              softcap, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, deterministic)


_flash_attn_fwd = torch.library.custom_op("flashformer::flash_attn_fwd", _forward_impl, mutates_args=())
_flash_attn_bwd = torch.library.custom_op("flashformer::flash_attn_bwd", _backward_impl, mutates_args=())


@_flash_attn_fwd.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, window_left, window_right,
      softcap, deterministic):
    lse_shape = (q.shape[1], q.shape[0]) if cu_seqlens_q is not None else (q.shape[0], q.shape[2], q.shape[1])
    return torch.empty_like(q), q.new_empty(lse_shape, dtype=torch.float32)


@_flash_attn_bwd.register_fake
def _(grad_out, grad_lse, q, k, v, out, lse, *args):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _save_for_backward(ctx, inputs, output):
    q, k, v, cu_seqlens_q, cu_seqlens_k, *params = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)
    ctx.params = params


def _gradients(ctx, grad_out, grad_lse, backward=_flash_attn_bwd):
    # The op's registered backward always calls the op: AOT autograd traces it with fake tensors,
    # and torch 2.11's is_compiling() is False there (the kernels' launchers would see fakes).
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
    if grad_out is None:  # only lse was used
        grad_out = torch.zeros_like(out)
    # Layouts are the launcher's business (it copies only what TMA cannot address); no grad_lse
    # (the common case) skips its read instead of materialising zeros.
    dq, dk, dv = backward(grad_out, grad_lse, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *ctx.params)
    return dq, dk, dv, *([None] * 9)


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


def _triton_attention(*inputs):
    """(out, lse) through the Triton kernels; ``inputs`` as ``_forward_impl`` takes them."""
    if torch.compiler.is_compiling():
        return _flash_attn_fwd(*inputs)
    return _FlashAttention.apply(*inputs)


def attention_with_lse(q, k, v, softmax_scale, window_left, window_right, softcap, deterministic=True):
    """Dispatch validated dense inputs to the chosen path; returns (out, lse), both differentiable."""
    if kernel_impl(q.device) != "torch":
        return _triton_attention(q, k, v, None, None, 0, 0, softmax_scale, window_left, window_right, softcap,
                                 deterministic)
    return attention_tiled(q, k, v, softmax_scale, window_left, window_right, softcap)


def _varlen_tiled(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, window_left, window_right, softcap):
    """The PyTorch varlen path: the tiled reference on each sequence; lse (heads, total_q)."""
    outs, lses = [], []
    bounds = zip(cu_seqlens_q.tolist(), cu_seqlens_q[1:].tolist(), cu_seqlens_k.tolist(), cu_seqlens_k[1:].tolist())
    for q0, q1, k0, k1 in bounds:
        out, lse = attention_tiled(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], softmax_scale, window_left,
                                   window_right, softcap)
        outs.append(out[0])
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=1)


# Value checks of cu_seqlens read the device (a host sync, tens of µs with the launch queue drained). A
# tensor is checked once per version: every layer of a model shares one, and repeated calls reuse it.
# Entries leave with their tensor (weakref.finalize), so a new tensor at a reused id is checked anew.
_CHECKED_CU_SEQLENS: dict[int, tuple[int, int, int]] = {}


def check_cu_seqlens(name, cu_seqlens, total, device, read_values=True):
    """Validate int32 (batch + 1,) sequence offsets over ``total`` packed tokens: always their type,
    shape and device; their values (one device read for all) when ``read_values``.

    Returns:
        The longest sequence's length, or None when the values were not read (``read_values`` False,
        or under torch.compile, where a traced graph trusts its caller).
    """
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.dtype != torch.int32:
        raise ValueError(f"{name} must be a 1-d int32 tensor, got "
                         f"{cu_seqlens.dtype if isinstance(cu_seqlens, torch.Tensor) else type(cu_seqlens).__name__}")
    if cu_seqlens.device != device:
        raise ValueError(f"{name} is on {cu_seqlens.device}, q on {device}")
    if cu_seqlens.numel() < 2:
        raise ValueError(f"{name} needs at least 2 entries (batch + 1), got {cu_seqlens.numel()}")
    if not read_values or torch.compiler.is_compiling():
        return None
    key = id(cu_seqlens)
    # Inference tensors keep no version counter (in-place changes go unseen): they are checked every call.
    version = None if cu_seqlens.is_inference() else cu_seqlens._version
    checked = _CHECKED_CU_SEQLENS.get(key)
    if checked is not None and version is not None and checked[:2] == (version, total):
        return checked[2]
    lengths = cu_seqlens.diff()
    first, last, shortest, longest = torch.stack((cu_seqlens[0], cu_seqlens[-1], lengths.min(), lengths.max())).tolist()
    if first != 0 or last != total:
        raise ValueError(f"{name} must start at 0 and end at the token count {total}, got {first} ... {last}")
    if shortest < 0:
        raise ValueError(f"{name} must be non-decreasing, got {cu_seqlens.tolist()}")
    if version is not None:
        if checked is None:
            weakref.finalize(cu_seqlens, _CHECKED_CU_SEQLENS.pop, key, None)
        _CHECKED_CU_SEQLENS[key] = (version, total, longest)
    return longest


def _max_seqlen(name, given, longest):
    """``given`` (validated against ``longest``, the actual longest length when known), or ``longest``."""
    if longest is None:  # offsets unread (or under torch.compile): the caller's figure
        if not torch.compiler.is_compiling() and (not isinstance(given, int) or isinstance(given, bool)
                                                   or given < 0):
            raise ValueError(f"{name} must be an int >= 0, got {given!r}")
        return int(given)
    if given is None:
        return longest
    if not isinstance(given, int) or given < longest:
        raise ValueError(f"{name}={given!r} is smaller than the longest sequence ({longest})")
    return given


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, causal=False,
                           softmax_scale=None, window_size=(-1, -1), softcap=0.0, return_lse=False,
                           deterministic=True, check_lengths=None, block_table=None):
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
        causal, softmax_scale, window_size, softcap, return_lse, deterministic: as flash_attn_func.
        check_lengths: whether the offsets' values are checked (start 0, end at the token count,
            non-decreasing, max_seqlen_q/_k at least the longest); their type, shape and device
            always are. None (the default): when they are read anyway (a max_seqlen left None, or
            the PyTorch path); with both max_seqlen given the Triton path reads no device value (no
            host sync) and trusts the offsets, as flash-attn does. True: always (one device read per
            offsets tensor and version). False: never; needs both max_seqlen and the Triton path.
        block_table: flash-attn's paged K/V for varlen; not supported (an error): use
            flash_attn_with_kvcache, whose caches may be paged.
    Returns:
        out (total_q, heads_q, head_dim_v), or (out, lse) with lse (heads_q, total_q) fp32.
    """
    if block_table is not None:
        raise ValueError("block_table (paged K/V) is not supported by flash_attn_varlen_func; "
                         "flash_attn_with_kvcache takes paged caches")
    softmax_scale, window_size = check_attention_args(q, k, v, 0, softmax_scale, window_size, softcap)
    deterministic = _check_deterministic(deterministic)
    if check_lengths is not None and not isinstance(check_lengths, bool):
        raise ValueError(f"check_lengths must be a bool or None, got {check_lengths!r}")
    triton_path = kernel_impl(q.device) != "torch"
    if check_lengths is False and (max_seqlen_q is None or max_seqlen_k is None or not triton_path):
        raise ValueError("check_lengths=False needs max_seqlen_q and max_seqlen_k and the Triton path (otherwise "
                         "the offsets are read on the host)")
    longest_q = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0], q.device,
                                 _read_offsets(check_lengths, max_seqlen_q, triton_path))
    longest_k = check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0], q.device,
                                 _read_offsets(check_lengths, max_seqlen_k, triton_path))
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k describe {cu_seqlens_q.numel() - 1} and "
                         f"{cu_seqlens_k.numel() - 1} sequences")
    max_seqlen_q = _max_seqlen("max_seqlen_q", max_seqlen_q, longest_q)
    max_seqlen_k = _max_seqlen("max_seqlen_k", max_seqlen_k, longest_k)
    head_dim_v = v.shape[-1]
    q, k, v = kernel_inputs(*autocast_inputs(q, k, v))
    window_left, window_right = normalize_window(causal, window_size)
    if triton_path:
        out, lse = _triton_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                                   window_left, window_right, float(softcap), deterministic)
    else:
        out, lse = _varlen_tiled(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, window_left, window_right,
                                 float(softcap))
    out = out[..., :head_dim_v]
    return (out, lse) if return_lse else out


def _read_offsets(check_lengths, max_seqlen, triton_path):
    """Whether flash_attn_varlen_func reads (and so checks) one cu_seqlens tensor's values."""
    if check_lengths is not None:
        return check_lengths
    return max_seqlen is None or not triton_path


def _check_deterministic(deterministic):
    if not isinstance(deterministic, bool):
        raise ValueError(f"deterministic must be a bool, got {deterministic!r}")
    return deterministic


def flash_attn_func(q, k, v, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                    return_lse=False, deterministic=True):
    """Exact attention, flash-attn's dense API.

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
        softcap: if > 0, scores become softcap * tanh(scores / softcap) before masking.
        return_lse: also return lse (batch, heads_q, seqlen_q), fp32, natural log; -inf for a row
            that sees no key (its output is 0).
        deterministic: True (the default): the backward gives bit-identical gradients run after run.
            False: a faster backward (5 tile matmuls instead of 7) that adds dQ in whatever order the
            GPU's reductions arrive, as flash-attn does by default. The PyTorch path ignores it.
    Returns:
        out (batch, seqlen_q, heads_q, head_dim_v), or (out, lse).
    """
    softmax_scale, window_size = check_attention_args(q, k, v, 1, softmax_scale, window_size, softcap)
    head_dim_v = v.shape[-1]
    q, k, v = kernel_inputs(*autocast_inputs(q, k, v))
    window_left, window_right = normalize_window(causal, window_size)
    out, lse = attention_with_lse(q, k, v, softmax_scale, window_left, window_right, float(softcap),
                                  _check_deterministic(deterministic))
    out = out[..., :head_dim_v]
    return (out, lse) if return_lse else out


def _unpack(name, packed, rank, parts):
    """The ``parts`` views of ``packed`` along its dim rank - 3 (no copy); ValueError naming ``name``."""
    if not isinstance(packed, torch.Tensor) or packed.dim() != rank or packed.shape[-3] != parts:
        shape = tuple(packed.shape) if isinstance(packed, torch.Tensor) else type(packed).__name__
        layout = {5: "(batch, seqlen", 4: "(total"}[rank] + f", {parts}, heads, head_dim)"
        raise ValueError(f"{name} must be a {rank}-D tensor {layout}, got {shape}")
    return packed.unbind(-3)


# The packed functions take their options by keyword only: flash-attn's put dropout_p second, so a call
# written positionally for flash-attn fails here rather than binding its dropout_p to softmax_scale.

def flash_attn_qkvpacked_func(qkv, *, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                              deterministic=True, return_lse=False):
    """flash_attn_func on q, k, v stacked in one tensor (flash-attn's qkvpacked API).

    q, k and v are views of ``qkv`` (the kernels take its strides as they are); the gradient lands in
    ``qkv``.

    Args:
        qkv: (batch, seqlen, 3, heads, head_dim).
        softmax_scale, causal, window_size, softcap, deterministic, return_lse: as flash_attn_func.
    Returns:
        out (batch, seqlen, heads, head_dim), or (out, lse) as flash_attn_func.
    """
    q, k, v = _unpack("qkv", qkv, 5, 3)
    return flash_attn_func(q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                           softcap=softcap, return_lse=return_lse, deterministic=deterministic)


def flash_attn_kvpacked_func(q, kv, *, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                             deterministic=True, return_lse=False):
    """flash_attn_func with k and v stacked in one tensor (flash-attn's kvpacked API; MQA / GQA allowed).

    Args:
        q: (batch, seqlen_q, heads_q, head_dim).
        kv: (batch, seqlen_k, 2, heads_kv, head_dim); k and v are views of it, and their gradient
            lands in it.
        softmax_scale, causal, window_size, softcap, deterministic, return_lse: as flash_attn_func.
    Returns:
        out (batch, seqlen_q, heads_q, head_dim), or (out, lse) as flash_attn_func.
    """
    k, v = _unpack("kv", kv, 5, 2)
    return flash_attn_func(q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                           softcap=softcap, return_lse=return_lse, deterministic=deterministic)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen=None, *, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, deterministic=True, return_lse=False,
                                     check_lengths=None):
    """flash_attn_varlen_func on packed sequences whose q, k, v share one tensor (and one cu_seqlens).

    Args:
        qkv: (total, 3, heads, head_dim); q, k, v are views of it, and their gradient lands in it.
        cu_seqlens: int32 (batch + 1,) offsets of the sequences, for q and k alike.
        max_seqlen: the longest sequence; None reads it from cu_seqlens (a host sync on CUDA).
        softmax_scale, causal, window_size, softcap, deterministic, return_lse, check_lengths: as
            flash_attn_varlen_func.
    Returns:
        out (total, heads, head_dim), or (out, lse) with lse (heads, total) fp32.
    """
    q, k, v = _unpack("qkv", qkv, 4, 3)
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, causal=causal,
                                  softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
                                  return_lse=return_lse, deterministic=deterministic, check_lengths=check_lengths)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, *,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    deterministic=True, return_lse=False, check_lengths=None):
    """flash_attn_varlen_func with k and v stacked in one tensor.

    Args:
        q: (total_q, heads_q, head_dim).
        kv: (total_k, 2, heads_kv, head_dim); k and v are views of it, and their gradient lands in it.
        cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_size,
            softcap, deterministic, return_lse, check_lengths: as flash_attn_varlen_func.
    Returns:
        out (total_q, heads_q, head_dim), or (out, lse) with lse (heads_q, total_q) fp32.
    """
    k, v = _unpack("kv", kv, 4, 2)
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
                                  softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
                                  return_lse=return_lse, deterministic=deterministic, check_lengths=check_lengths)
