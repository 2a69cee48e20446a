"""Fused LM head + cross-entropy that never materializes the (tokens x vocab) logits.

At long context the LM head dominates memory: 131k tokens x a 50k vocabulary is 26 GB of fp32
logits, and as much again for their gradient. ``chunked_cross_entropy`` walks the tokens in
chunks: the forward keeps only each token's logsumexp, and the backward recomputes one chunk of
logits at a time and turns it straight into that chunk's share of the gradients of hidden,
weight and bias. The largest temporary is one chunk of logits (chunk_size x vocab, in the matmul's dtype); the
cross-entropy over it runs in fp32 inside kernels/cross_entropy.py (Triton on the GPU).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from flashformer.kernels.cross_entropy import capped_logits, cross_entropy_rows, cross_entropy_rows_grad_
from flashformer.kernels.checks import autocast_inputs

# One chunk of fp32 logits is at most this many elements (128 MiB): big enough that each chunk's
# matmul keeps the GPU busy, small next to the model's activations at long context.
CHUNK_LOGITS_ELEMENTS = 2**25
# lm_head_loss materializes the logits (one matmul fewer, autograd's fused cross-entropy) while
# tokens x vocab stays under this (256 MiB of fp32 logits); above it, it chunks.
MATERIALIZED_LOGITS_MAX_ELEMENTS = 2**26
REDUCTIONS = ("mean", "sum", "none")


def default_chunk_size(vocab_size: int) -> int:
    """Tokens per chunk such that one chunk of logits holds about CHUNK_LOGITS_ELEMENTS values."""
    return max(1, CHUNK_LOGITS_ELEMENTS // vocab_size)


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Gradients are recomputed chunk by chunk in backward rather than computed in forward and
    stored (Liger's choice). Both reach the same worst moment, the start of backward, holding
    grad_hidden + an fp32 grad_weight + one chunk of logits. Computing them in forward would
    additionally hold grad_hidden and grad_weight (vocab x d_model fp32: 2 GB for a 128k vocab
    at d_model 4096) from the forward until the backward, through whatever runs in between
    (other loss terms, evaluation, accumulation), and would fix grad_output to a scalar known
    in advance, which reduction="none" cannot offer. Recomputing costs one extra
    (tokens x vocab x d_model) matmul; that buys the lower or equal peak in every schedule.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, ignore_index, chunk_size, reduction, softcap):
        tokens = hidden.shape[0]
        valid = targets != ignore_index
        safe_targets = torch.where(valid, targets, torch.zeros_like(targets))
        lse = torch.zeros(tokens, dtype=torch.float32, device=hidden.device)
        losses = torch.zeros(tokens, dtype=torch.float32, device=hidden.device)
        for start, end in _chunks_with_targets(valid, chunk_size):
            # The matmul in the inputs' dtype (fp32 accumulation); the cross-entropy in fp32 inside.
            lse[start:end], losses[start:end] = cross_entropy_rows(hidden[start:end] @ weight.t(), targets[start:end],
                                                                   ignore_index, bias, softcap)
        ctx.save_for_backward(hidden, weight, bias, safe_targets, valid, lse)
        ctx.params = (chunk_size, reduction, softcap)
        if reduction == "none":
            return losses
        # Mean over the non-ignored tokens; 0 / 0 = nan when all are ignored, as F.cross_entropy.
        return losses.sum() / valid.sum() if reduction == "mean" else losses.sum()

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, bias, safe_targets, valid, lse = ctx.saved_tensors
        chunk_size, reduction, softcap = ctx.params
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        # d loss / d (token's loss): grad_output spread over the tokens, 0 for ignored ones.
        scale = grad_loss.float()
        if reduction == "mean":
            scale = scale / valid.sum()
        token_scale = scale * valid
        grad_hidden = torch.zeros_like(hidden) if need_hidden else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if need_weight else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if need_bias else None
        for start, end in _chunks_with_targets(valid, chunk_size):
            hidden_chunk = hidden[start:end]
            # (softmax - one_hot(target)) * token_scale, written over the recomputed logits in their dtype.
            grad_logits = cross_entropy_rows_grad_(hidden_chunk @ weight.t(), safe_targets[start:end],
                                                   lse[start:end], token_scale[start:end], bias, softcap)
            if need_bias:
                grad_bias += grad_logits.float().sum(0)
            if need_hidden:
                grad_hidden[start:end] = grad_logits @ weight
            if need_weight:
                grad_weight += (grad_logits.t() @ hidden_chunk).float()
        return (grad_hidden,
                grad_weight.to(weight.dtype) if need_weight else None,
                grad_bias.to(bias.dtype) if need_bias else None,
                None, None, None, None, None)


def _chunks_with_targets(valid, chunk_size):
    """Yield (start, end) of each token chunk holding at least one non-ignored target.

    Chunks whose targets are all ignored (prompts in fine-tuning, padding) contribute nothing to
    loss or gradient, so their logits are never computed. One host sync for all chunks.
    """
    has_target = torch.stack([chunk.any() for chunk in valid.split(chunk_size)]).tolist()
    for index, keep in enumerate(has_target):
        if keep:
            yield index * chunk_size, min((index + 1) * chunk_size, valid.shape[0])


def chunked_cross_entropy(hidden, weight, targets, bias=None, ignore_index=-100, chunk_size=None,
                          reduction="mean", softcap=0.0):
    """Cross-entropy of ``hidden @ weight.T + bias`` without the full logits in memory.

    Equals ``F.cross_entropy(logits.float(), targets, ignore_index=ignore_index,
    reduction=reduction)`` with ``logits = hidden @ weight.T + bias`` (then
    ``softcap * tanh(logits / softcap)`` when softcap > 0), in loss and gradients.

    Args:
        hidden: (tokens, d_model), the final hidden states.
        weight: (vocab, d_model), the LM head (or the tied embedding).
        targets: (tokens,) int64 class ids; ``ignore_index`` marks tokens without a loss.
        bias: optional (vocab,).
        chunk_size: tokens per chunk; None picks ``default_chunk_size(vocab)``.
        reduction: "mean" (over non-ignored tokens; nan if there are none), "sum" or "none".
        softcap: if > 0, logits become softcap * tanh(logits / softcap) (Gemma 2's final cap).
    Returns:
        fp32: a scalar, or (tokens,) per-token losses for reduction="none" (0 where ignored).
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden (tokens, d_model) and weight (vocab, d_model) expected, got "
                         f"{tuple(hidden.shape)} and {tuple(weight.shape)}")
    if targets.shape != hidden.shape[:1] or targets.dtype != torch.int64:
        raise ValueError(f"targets must be int64 of shape ({hidden.shape[0]},), got "
                         f"{targets.dtype} {tuple(targets.shape)}")
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if chunk_size is None:
        chunk_size = default_chunk_size(weight.shape[0])
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")
    if not 0 <= softcap < math.inf:
        raise ValueError(f"softcap must be a finite float >= 0 (0 disables it), got {softcap!r}")
    # Backward runs outside autocast, so settle the matmul dtype here (fp32 master weights
    # under bf16 autocast would otherwise meet bf16 hidden states there).
    hidden, weight = autocast_inputs(hidden, weight)
    return _ChunkedCrossEntropy.apply(hidden, weight, bias, targets, ignore_index, chunk_size,
                                      reduction, float(softcap))


def lm_head_loss(hidden, weight, targets, chunk_size=None, *, bias=None, ignore_index=-100,
                 softcap=0.0, reduction="mean"):
    """Mean (or summed) next-token loss of the LM head; chunks it when the logits would be large.

    Args:
        hidden: (..., d_model) final hidden states, e.g. (batch, seqlen, d_model).
        weight: (vocab, d_model) LM head or tied embedding; bias: optional (vocab,).
        targets: (...) int64 matching hidden's leading dims; ``ignore_index`` marks no loss.
        chunk_size: tokens per chunk; None chunks (with the default size) only when
            tokens x vocab exceeds MATERIALIZED_LOGITS_MAX_ELEMENTS, else materializes the logits.
        softcap: final logit softcap, 0 disables it.
        reduction: "mean" over the non-ignored tokens, or "sum".
    Returns:
        the fp32 scalar loss.
    """
    hidden = hidden.reshape(-1, hidden.shape[-1])
    targets = targets.reshape(-1)
    if chunk_size is None and hidden.shape[0] * weight.shape[0] <= MATERIALIZED_LOGITS_MAX_ELEMENTS:
        logits = capped_logits(hidden @ weight.t(), bias, softcap)
        return F.cross_entropy(logits, targets, ignore_index=ignore_index, reduction=reduction)
    return chunked_cross_entropy(hidden, weight, targets, bias=bias, ignore_index=ignore_index,
                                 chunk_size=chunk_size, reduction=reduction, softcap=softcap)
