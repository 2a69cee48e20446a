"""Fused LM head + cross-entropy that never materializes the (tokens x vocab) logits.

At long context the LM head dominates memory: 131k tokens x a 50k vocabulary is 26 GB of fp32
logits, and as much again for their gradient. ``chunked_cross_entropy`` walks the tokens in
chunks: the forward keeps only each token's logsumexp, and the backward recomputes one chunk of
logits at a time and turns it straight into that chunk's share of the gradients of hidden,
weight and bias. The largest temporary is one chunk of logits (chunk_size x vocab, fp32).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flashformer.kernels.interface import autocast_inputs

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


def _logits_fp32(hidden, weight, bias, softcap):
    """(tokens, d_model) x (vocab, d_model) -> fp32 (tokens, vocab) logits, biased and capped.

    The matmul runs in the inputs' dtype (tensor cores accumulate in fp32); everything after it
    (softcap, logsumexp, softmax) runs in fp32.
    """
    logits = (hidden @ weight.t()).float()
    if bias is not None:
        logits += bias.float()
    if softcap > 0.0:
        logits = softcap * torch.tanh(logits / softcap)
    return logits


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
            logits = _logits_fp32(hidden[start:end], weight, bias, softcap)
            lse[start:end] = torch.logsumexp(logits, dim=-1)
            target_logit = logits.gather(1, safe_targets[start:end, None]).squeeze(1)
            losses[start:end] = torch.where(valid[start:end], lse[start:end] - target_logit, 0.0)
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
            logits = _logits_fp32(hidden_chunk, weight, bias, softcap)
            # logits = softcap * tanh(raw / softcap), so d logits / d raw = 1 - (logits / softcap)^2.
            softcap_grad = 1.0 - (logits / softcap).square_() if softcap > 0.0 else None
            # (softmax - one_hot(target)) * token_scale, built in place in the logits' buffer.
            grad_logits = logits.sub_(lse[start:end, None]).exp_()
            grad_logits[torch.arange(end - start, device=logits.device), safe_targets[start:end]] -= 1.0
            grad_logits.mul_(token_scale[start:end, None])
            if softcap_grad is not None:
                grad_logits.mul_(softcap_grad)
            if need_bias:
                grad_bias += grad_logits.sum(0)
            grad_logits_low = grad_logits.to(hidden.dtype)
            if need_hidden:
                grad_hidden[start:end] = grad_logits_low @ weight
            if need_weight:
                grad_weight += (grad_logits_low.t() @ hidden_chunk).float()
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
    if softcap < 0:
        raise ValueError(f"softcap must be >= 0 (0 disables it), got {softcap!r}")
    # Backward runs outside autocast, so settle the matmul dtype here (fp32 master weights
    # under bf16 autocast would otherwise meet bf16 hidden states there).
    hidden, weight = autocast_inputs(hidden, weight)
    return _ChunkedCrossEntropy.apply(hidden, weight, bias, targets, ignore_index, chunk_size,
                                      reduction, float(softcap))


def lm_head_loss(hidden, weight, targets, chunk_size=None, *, bias=None, ignore_index=-100,
                 softcap=0.0):
    """Mean next-token loss of the LM head; chunks it when the logits would be large.

    Args:
        hidden: (..., d_model) final hidden states, e.g. (batch, seqlen, d_model).
        weight: (vocab, d_model) LM head or tied embedding; bias: optional (vocab,).
        targets: (...) int64 matching hidden's leading dims; ``ignore_index`` marks no loss.
        chunk_size: tokens per chunk; None chunks (with the default size) only when
            tokens x vocab exceeds MATERIALIZED_LOGITS_MAX_ELEMENTS, else materializes the logits.
        softcap: final logit softcap, 0 disables it.
    Returns:
        the fp32 scalar mean loss over non-ignored tokens.
    """
    hidden = hidden.reshape(-1, hidden.shape[-1])
    targets = targets.reshape(-1)
    if chunk_size is None and hidden.shape[0] * weight.shape[0] <= MATERIALIZED_LOGITS_MAX_ELEMENTS:
        logits = _logits_fp32(hidden, weight, bias, softcap)
        return F.cross_entropy(logits, targets, ignore_index=ignore_index)
    return chunked_cross_entropy(hidden, weight, targets, bias=bias, ignore_index=ignore_index,
                                 chunk_size=chunk_size, softcap=softcap)
