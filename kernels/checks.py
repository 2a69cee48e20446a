"""Argument checks shared by every public attention function, and the head_dim padding the kernels need.

Raises ValueError naming the argument; reads device values only where a function's contract says so
(check_cu_seqlens).
"""

from __future__ import annotations

import math
import weakref

import torch

from .sizes import HEAD_DIM_MULTIPLE, MAX_HEAD_DIM, MIN_HEAD_DIM, cdiv

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def describe(x):
    """An argument as an error message shows it: a tensor's dtype, shape and device, else its repr."""
    if isinstance(x, torch.Tensor):
        return f"{x.dtype} tensor of shape {tuple(x.shape)} on {x.device}"
    return repr(x)


def check_index_layout(name, t):
    """Raise unless ``t``, a 1-d int tensor argument (already checked as one), is contiguous: the kernels read entry
    b at offset b, so a strided one (a column of a 2-d tensor, a slice with a step) would be misread, not copied.
    flash-attn refuses them too."""
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (the kernels read its entries at unit stride), got stride "
                         f"{t.stride()}: pass {name}.contiguous()")


def _check_tensor(name, t, rank):
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != rank:
        raise ValueError(f"{name} must have {rank} dims, got shape {tuple(t.shape)}")
    if t.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{name} has dtype {t.dtype}; supported: float16, bfloat16, float32")


def check_attention_args(q, k, v, seq_dim, softmax_scale, window_size, softcap, same_batch=True):
    """Validate q/k/v and options shared by every public function; return (scale, window_size).

    Args:
        q, k, v: attention inputs whose last two dims are (heads, head_dim); ``seq_dim`` is the
            index of the sequence dim (dims before it must agree between q and k/v where
            ``same_batch``; a paged cache's do not). q and k share a head_dim; v's may differ. Any
            head_dim in [1, MAX_HEAD_DIM] passes: see kernel_inputs.
        softmax_scale: None defaults to q's head_dim ** -0.5.
    """
    rank = seq_dim + 3
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, t, rank)
    if not (q.dtype == k.dtype == v.dtype) and not torch.is_autocast_enabled(q.device.type):
        raise ValueError(f"q, k, v must share a dtype (or be cast by torch.autocast), got {q.dtype}, {k.dtype}, "
                         f"{v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if same_batch and q.shape[:seq_dim] != k.shape[:seq_dim]:
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
    if window_size != (-1, -1) and (  # the common case first: a decoding step's host time is this function's too
            not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or not all(isinstance(w, int) and not isinstance(w, bool) and w >= -1 for w in window_size)):
        raise ValueError(f"window_size must be a pair of ints >= -1 (-1 = unbounded), got {window_size!r}")
    if not isinstance(softcap, (int, float)) or not 0 <= softcap < math.inf:
        raise ValueError(f"softcap must be a finite float >= 0 (0 disables it), got {softcap!r}")
    if softmax_scale is None:
        softmax_scale = head_dim**-0.5
    elif not isinstance(softmax_scale, (int, float)) or not 0 < softmax_scale < math.inf:
        raise ValueError(f"softmax_scale must be a finite positive float or None, got {softmax_scale!r}")
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


def check_dropout_and_alibi(q, batch, dropout_p, alibi_slopes, softcap, return_attn_probs):
    """Validate flash-attn's dropout_p, alibi_slopes and return_attn_probs; returns (dropout_p as a
    float, alibi_slopes contiguous, as the kernels index them).

    Args:
        q: (..., heads_q, head_dim); batch: the number of sequences.
    """
    if not isinstance(dropout_p, (int, float)) or isinstance(dropout_p, bool) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be a float in [0, 1) (0.0 in eval), got {dropout_p!r}")
    if dropout_p > 0.0 and softcap > 0.0:
        raise ValueError("dropout_p > 0 with softcap > 0: softcap does not support dropout (as in flash-attn)")
    if not isinstance(return_attn_probs, bool):
        raise ValueError(f"return_attn_probs must be a bool, got {return_attn_probs!r}")
    return float(dropout_p), check_alibi(q, batch, alibi_slopes)


def check_alibi(q, batch, alibi_slopes):
    """Validate flash-attn's alibi_slopes (None, or fp32 (heads_q,) / (batch, heads_q) on q's device); returns
    them contiguous, as the kernels index them."""
    if alibi_slopes is None:
        return None
    heads_q = q.shape[-2]
    if not isinstance(alibi_slopes, torch.Tensor) or alibi_slopes.dtype != torch.float32:
        got = alibi_slopes.dtype if isinstance(alibi_slopes, torch.Tensor) else type(alibi_slopes).__name__
        raise ValueError(f"alibi_slopes must be an fp32 tensor, got {got}")
    if tuple(alibi_slopes.shape) not in ((heads_q,), (batch, heads_q)):
        raise ValueError(f"alibi_slopes must have shape (heads_q,) = ({heads_q},) or (batch, heads_q) = "
                         f"({batch}, {heads_q}), got {tuple(alibi_slopes.shape)}")
    if alibi_slopes.device != q.device:
        raise ValueError(f"alibi_slopes is on {alibi_slopes.device}, q on {q.device}")
    return alibi_slopes.contiguous()


def draw_dropout_seed(device):
    """The 64-bit Philox key of one dropout call, an int64 (1,) tensor on ``device``, drawn from torch's
    default generator there: torch.manual_seed makes the masks reproducible, and the kernels read the
    key on the device (no host sync)."""
    return torch.randint(0, 2**63 - 1, (1,), dtype=torch.int64, device=device)


def autocast_inputs(*tensors):
    """Under torch.autocast, run attention in the autocast dtype (as SDPA does)."""
    device_type = tensors[0].device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        return tuple(t.to(dtype) for t in tensors)
    return tensors


# Value checks of cu_seqlens read the device (a host sync, tens of µs with the launch queue drained). A
# tensor is checked once per version: every layer of a model shares one, and repeated calls reuse it.
# Entries leave with their tensor (weakref.finalize), so a new tensor at a reused id is checked anew.
_CHECKED_CU_SEQLENS: dict[int, tuple[int, int, int]] = {}


def check_cu_seqlens(name, cu_seqlens, total, device, read_values=True):
    """Validate int32 (batch + 1,) sequence offsets over ``total`` packed tokens (None: any count, as
    for keys in pages): always their type, shape and device; their values (one device read for all)
    when ``read_values``.

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
    check_index_layout(name, cu_seqlens)
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
    if first != 0 or last != (last if total is None else total):
        end = "" if total is None else f" and end at the token count {total}"
        raise ValueError(f"{name} must start at 0{end}, got {first} ... {last}")
    if shortest < 0:
        raise ValueError(f"{name} must be non-decreasing, got {cu_seqlens.tolist()}")
    if version is not None:
        if checked is None:
            weakref.finalize(cu_seqlens, _CHECKED_CU_SEQLENS.pop, key, None)
        _CHECKED_CU_SEQLENS[key] = (version, total, longest)
    return longest


def max_seqlen_arg(name, given, longest):
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


def reads_offsets(check_lengths, max_seqlen, triton_path):
    """Whether flash_attn_varlen_func reads (and so checks) one cu_seqlens tensor's values."""
    if check_lengths is not None:
        return check_lengths
    return max_seqlen is None or not triton_path


def check_deterministic(deterministic):
    if not isinstance(deterministic, bool):
        raise ValueError(f"deterministic must be a bool, got {deterministic!r}")
    return deterministic
