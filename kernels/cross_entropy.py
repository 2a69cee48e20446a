"""Cross-entropy over rows of logits as the LM head's matmul leaves them (bf16 under autocast), for the
chunked LM-head loss (flashformer/losses.py).

The torch version of the same math upcasts a chunk of logits to fp32, then reads and writes that fp32
buffer five or six more times (logsumexp, exp, one-hot, scale, downcast): about 40 bytes of memory
traffic per logit. The kernels read the 16-bit logits once per pass and keep the arithmetic in fp32:

* forward: one program per row; an online logsumexp over the vocabulary in BLOCK_V slices, and the
  target's logit: (lse, loss) per row, fp32.
* backward: (softmax - one_hot(target)) * the row's scale, written over the logits in place in their
  dtype (what the next matmul reads anyway).

Optional bias and Gemma-2 style final softcap (logit -> softcap * tanh(logit / softcap)) are applied
in-kernel. ``cross_entropy_rows`` / ``cross_entropy_rows_grad_`` pick the Triton kernels or the torch
reference next to them through interface.kernel_impl, like the attention functions.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .interface import kernel_impl
from .launch import new_output
from .sizes import next_power_of_2
from .tile_ops import narrow, tanh

FLOAT_MIN = tl.constexpr(-3.4028234663852886e38)  # a finite floor for running maxima: max(floor, -inf) - floor = 0, never nan


@triton.jit
def _row_logits(ROW, BIAS, cols, vocab, softcap, HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    """fp32 logits of ``cols`` in one row (bias added, softcap applied); -inf past the vocabulary."""
    inside = cols < vocab
    x = tl.load(ROW + cols, mask=inside, other=0.0).to(tl.float32)
    if HAS_BIAS:
        x += tl.load(BIAS + cols, mask=inside, other=0.0).to(tl.float32)
    if HAS_SOFTCAP:
        x = softcap * tanh(x / softcap)
    return tl.where(inside, x, float("-inf"))


@triton.jit
def _ce_forward_kernel(LOGITS, BIAS, TARGETS, LSE, LOSSES, stride_row, vocab, ignore_index, softcap,
                       BLOCK_V: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    row = tl.program_id(0)
    row_logits = LOGITS + row.to(tl.int64) * stride_row
    # Per-lane running max and sum, folded together at the end: no cross-lane reduction per slice.
    lane_max = tl.full([BLOCK_V], FLOAT_MIN, dtype=tl.float32)
    lane_sum = tl.zeros([BLOCK_V], dtype=tl.float32)
    for v0 in range(0, vocab, BLOCK_V):
        x = _row_logits(row_logits, BIAS, v0 + tl.arange(0, BLOCK_V), vocab, softcap, HAS_BIAS, HAS_SOFTCAP)
        new_max = tl.maximum(lane_max, x)
        lane_sum = lane_sum * tl.exp(lane_max - new_max) + tl.exp(x - new_max)
        lane_max = new_max
    row_max = tl.max(lane_max, 0)
    lse = row_max + tl.log(tl.sum(lane_sum * tl.exp(lane_max - row_max), 0))
    target = tl.load(TARGETS + row)
    valid = target != ignore_index
    # The target's logit, through the same bias / softcap path (lane 0 of a one-wide slice).
    target_cols = tl.where(valid, target, 0) + tl.arange(0, 1)
    target_logit = tl.sum(_row_logits(row_logits, BIAS, target_cols, vocab, softcap, HAS_BIAS, HAS_SOFTCAP), 0)
    tl.store(LSE + row, lse)
    tl.store(LOSSES + row, tl.where(valid, lse - target_logit, 0.0))


@triton.jit
def _ce_backward_kernel(LOGITS, BIAS, TARGETS, LSE, TOKEN_SCALE, stride_row, vocab, softcap,
                        BLOCK_V: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    row = tl.program_id(0)
    row_logits = LOGITS + row.to(tl.int64) * stride_row
    lse = tl.load(LSE + row)
    scale = tl.load(TOKEN_SCALE + row)  # 0 for an ignored target: its row of gradients is 0
    target = tl.load(TARGETS + row)
    for v0 in range(0, vocab, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        x = _row_logits(row_logits, BIAS, cols, vocab, softcap, HAS_BIAS, HAS_SOFTCAP)
        grad = (tl.exp(x - lse) - tl.where(cols == target, 1.0, 0.0)) * scale
        if HAS_SOFTCAP:  # x = softcap * tanh(raw / softcap): d x / d raw = 1 - (x / softcap)^2
            # Past the vocabulary x is -inf and grad 0: their product would be nan (never stored, but the
            # interpreter's numpy warns about it), so those lanes take a zero derivative instead.
            grad *= tl.where(cols < vocab, 1.0 - (x / softcap) * (x / softcap), 0.0)
        tl.store(row_logits + cols, narrow(grad, LOGITS.dtype.element_ty), mask=cols < vocab)


def _launch_options(logits):
    # The interpreter walks slices element by element: small slices keep the CPU tests short.
    block_v = 64 if logits.device.type != "cuda" else min(4096, next_power_of_2(logits.shape[1]))
    return dict(BLOCK_V=block_v, num_warps=8 if block_v >= 2048 else 4)


def cross_entropy_rows(logits, targets, ignore_index, bias=None, softcap=0.0):
    """Per-row (lse, loss) of (rows, vocab) ``logits``: fp32, loss 0 where target == ignore_index.

    Args:
        logits: (rows, vocab), unit stride along the vocabulary, any float dtype (math in fp32).
        targets: (rows,) int64; bias: optional (vocab,); softcap: final cap, 0 disables it.
    """
    if kernel_impl(logits.device) != "torch":
        rows, vocab = logits.shape
        lse = new_output(logits, (rows,), torch.float32)
        losses = new_output(logits, (rows,), torch.float32)
        if rows:
            _ce_forward_kernel[(rows,)](logits, bias, targets, lse, losses, logits.stride(0), vocab, ignore_index,
                                        float(softcap), HAS_BIAS=bias is not None, HAS_SOFTCAP=softcap > 0.0,
                                        **_launch_options(logits))
        return lse, losses
    x = capped_logits(logits, bias, softcap)
    lse = torch.logsumexp(x, dim=-1)
    valid = targets != ignore_index
    target_logit = x.gather(1, torch.where(valid, targets, 0)[:, None]).squeeze(1)
    return lse, torch.where(valid, lse - target_logit, 0.0)


def cross_entropy_rows_grad_(logits, targets, lse, token_scale, bias=None, softcap=0.0):
    """Overwrite ``logits`` with d loss / d logits = (softmax - one_hot(target)) * token_scale per row
    (through bias and softcap); returns it. ``targets``: valid class ids (ignored rows have
    token_scale 0 and any id in range); ``token_scale``: fp32 (rows,)."""
    if kernel_impl(logits.device) != "torch":
        if logits.shape[0]:
            _ce_backward_kernel[(logits.shape[0],)](logits, bias, targets, lse, token_scale, logits.stride(0),
                                                    logits.shape[1], float(softcap), HAS_BIAS=bias is not None,
                                                    HAS_SOFTCAP=softcap > 0.0, **_launch_options(logits))
        return logits
    x = capped_logits(logits, bias, softcap)  # fp32 logits without bias or softcap: logits itself
    softcap_grad = 1.0 - (x / softcap).square() if softcap > 0.0 else None
    grad = x.sub_(lse[:, None]).exp_()
    grad[torch.arange(grad.shape[0], device=grad.device), targets] -= 1.0
    grad.mul_(token_scale[:, None])
    if softcap_grad is not None:
        grad.mul_(softcap_grad)
    return logits.copy_(grad)


def capped_logits(logits, bias=None, softcap=0.0):
    """fp32 logits with bias added and softcap applied (the torch path; ``logits`` itself when it is
    fp32 and there is neither)."""
    x = logits.float()
    if bias is not None:
        x = x + bias.float()
    if softcap > 0.0:
        x = softcap * torch.tanh(x / softcap)
    return x
