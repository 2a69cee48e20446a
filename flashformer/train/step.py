"""One optimizer step (and a context-parallel rank's slice of its micro batches), shared by the Trainer,
context parallelism's script and the memory sweep.

    loss, grad_norm = train_step(model, optimizer, micro_batches, bf16=True, max_grad_norm=1.0)

Nothing here reads a value back from the device: the step is queued, and the caller decides when to
wait for its loss and gradient norm.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from ..batches import IGNORE_INDEX, Batch
from ..context_parallel import shard_batch
from ..parallel import clip_grad_norm, gradient_sync


def lr_factor(step: int, cfg, total_steps: int) -> float:
    """Multiplier of ``cfg.lr`` for optimizer step ``step`` (0-based): linear warmup, cosine to min_lr.

    Args:
        step: optimizer steps taken so far.
        cfg: an OptimConfig (lr, min_lr, warmup_steps).
        total_steps: the run's length; the cosine reaches min_lr there.
    """
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
    min_factor = cfg.min_lr / cfg.lr
    return min_factor + (1 - min_factor) * 0.5 * (1 + math.cos(math.pi * progress))


def build_optimizer(model: nn.Module, cfg) -> torch.optim.AdamW:
    """AdamW over the trainable parameters; weight decay on matrices and embeddings only.

    Args:
        model: the module to train (possibly wrapped).
        cfg: an OptimConfig.
    """
    trainable = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in trainable if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in trainable if p.dim() < 2], "weight_decay": 0.0}]
    # Fused (on CPU too): it skips a step whose gradients are not finite on the device (``found_inf``),
    # so train_step needs no wait for the loss to decide.
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=bool(trainable))


def set_hyperparameters(optimizer: torch.optim.Optimizer, scheduler, cfg, factor: float) -> None:
    """Put ``cfg``'s lr, betas, eps and weight decay into the optimizer and the schedule.

    Loading an optimizer or scheduler state dict restores the hyper-parameters it was saved with; a
    resumed run calls this afterwards so that the ones it was asked for are the ones it trains with.

    Args:
        optimizer, scheduler: from ``build_optimizer`` and a LambdaLR over ``lr_factor``.
        cfg: an OptimConfig.
        factor: ``lr_factor`` at the scheduler's current step.
    """
    scheduler.base_lrs = [cfg.lr] * len(optimizer.param_groups)
    for group, weight_decay in zip(optimizer.param_groups, (cfg.weight_decay, 0.0)):
        group.update(initial_lr=cfg.lr, lr=cfg.lr * factor, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                     weight_decay=weight_decay)
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]


def lm_loss(model: nn.Module, batch: Batch, bf16: bool = False, loss_chunk_size: int | None = None,
            divisor: torch.Tensor | float | None = None) -> torch.Tensor:
    """Next-token cross-entropy of one micro batch, fp32: the mean over its targets, or their sum / ``divisor``.

    Args:
        model: a Transformer or a wrapper of one (DDP / FSDP hook only ``forward``, so the chunked loss
            goes through ``forward(targets=...)``).
        batch: a data.Batch on the model's device.
        bf16: run under bf16 autocast.
        loss_chunk_size: LM head + cross-entropy in chunks of this many tokens (never the full
            (tokens x vocab) logits); None materializes the logits.
        divisor: what the summed token loss is divided by; None: the batch's count of targets (the mean).
    """
    reduction = "mean" if divisor is None else "sum"
    with torch.autocast(batch.input_ids.device.type, dtype=torch.bfloat16, enabled=bf16):
        if loss_chunk_size:
            loss = model(batch.input_ids, targets=batch.targets, loss_chunk_size=loss_chunk_size,
                         loss_reduction=reduction, **batch.model_kwargs())
        else:
            logits = model(batch.input_ids, **batch.model_kwargs())
            loss = F.cross_entropy(logits.float().flatten(0, 1), batch.targets.flatten(), reduction=reduction)
    return loss if divisor is None else loss / divisor


def count_targets(batch: Batch) -> torch.Tensor:
    """The batch's targets that carry a loss (not IGNORE_INDEX), a 0-dim int64 tensor on its device."""
    return (batch.targets != IGNORE_INDEX).sum()


def step_divisor(micro_batches: list[Batch], mean_over_ranks=None) -> torch.Tensor:
    """What each micro batch's summed token loss is divided by, so that the step's gradient is the one of the
    mean loss over all its targets, however they fall into micro batches, ranks and slices of a row.

    DDP and FSDP average the ranks' gradients, so a rank divides by the mean over the ranks of their counts
    (not by the total): the mean of (rank's sum / mean count) is (all ranks' sum / total count).

    Args:
        micro_batches: this rank's micro batches of the step (under context parallelism, its slices).
        mean_over_ranks: the mean of a tensor over the ranks whose gradients are averaged (e.g. an
            all-reduce over them / their number); None: one process.
    Returns:
        a 0-dim tensor on the batches' device.
    """
    count = torch.stack([count_targets(batch) for batch in micro_batches]).sum()
    return count.float() if mean_over_ranks is None else mean_over_ranks(count).float()


def shard_micro_batch(batch: Batch, group) -> Batch:
    """This rank's zigzag slice of a micro batch that every rank of ``group`` holds whole.

    Divided by ``step_divisor`` over all ranks, the slices' summed losses make the rows' loss, and
    their gradients, averaged over the ranks (DDP / FSDP over the whole world), the one process's of the
    same rows, whichever slices hold how many targets. Packed documents keep the whole rows' cu_seqlens
    (the ring pairs every rank's tokens by document) and their positions.

    Args:
        batch: rows of seq_len tokens, seq_len divisible by 2 * the group's size.
    """
    input_ids, targets, position_ids = shard_batch(batch.input_ids, batch.targets, group, batch.position_ids)
    return Batch(input_ids, targets, position_ids=position_ids, cu_seqlens=batch.cu_seqlens)


def nonfinite(loss: torch.Tensor, grad_norm: torch.Tensor | None) -> torch.Tensor:
    """1.0 where the 0-dim ``loss`` or ``grad_norm`` (if any) is NaN or infinite, else 0.0 (a 0-dim float32
    tensor on their device, not read back)."""
    finite = torch.isfinite(loss) if grad_norm is None else torch.isfinite(loss) & torch.isfinite(grad_norm)
    return (~finite).float()


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: list[Batch], *,
               bf16: bool = False, loss_chunk_size: int | None = None, max_grad_norm: float | None = None,
               scheduler=None, context=contextlib.nullcontext, reduce_gradients=None, skip_nonfinite: bool = False,
               agree=None, mean_over_ranks=None):
    """Queue one optimizer step: forward + backward of every micro batch (DDP / FSDP reduce the
    gradients on the last only), then clip, step the optimizer and the schedule, zero the gradients.

    The gradient is that of the mean loss over every target of the step (``step_divisor``): a micro
    batch or a rank with few targets (chat data's prompts carry none) weighs by them.

    Args:
        model: the module to call; its parameters are the optimizer's.
        optimizer: the optimizer.
        micro_batches: data.Batch list on the model's device.
        bf16, loss_chunk_size: as in ``lm_loss``.
        max_grad_norm: clip the global gradient norm to it (``math.inf`` measures without clipping);
            None neither measures nor clips.
        scheduler: stepped after the optimizer, if given.
        context: entered around each micro batch's forward and backward (context parallelism routes
            attention around the ring inside it; recomputed activations need it in backward too).
        reduce_gradients: called with the loss after the last backward, before clipping, for
            gradients averaged by hand (context parallelism without DDP; with ``mean_over_ranks`` over the
            same ranks where their counts of targets differ); may average the loss in place.
        skip_nonfinite: where the loss or the gradient norm is NaN / inf (a step without targets too), leave
            the parameters and the optimizer state as they were (needs the fused AdamW of ``build_optimizer``);
            the schedule steps.
        agree: under several processes, the max of a flag over the ranks (e.g. an all-reduce), so that every
            rank skips the same steps.
        mean_over_ranks: as in ``step_divisor``; under several processes every rank must pass it.
    Returns:
        (loss, gradient norm or None), 0-dim tensors on the device. The loss is this rank's summed token
        loss over ``step_divisor``: on one process the step's mean loss, and its mean over the ranks otherwise.
    """
    divisor = step_divisor(micro_batches, mean_over_ranks)
    step_loss = torch.zeros((), device=micro_batches[0].input_ids.device)
    for index, batch in enumerate(micro_batches):
        with gradient_sync(model, enabled=index == len(micro_batches) - 1), context():
            loss = lm_loss(model, batch, bf16, loss_chunk_size, divisor)
            loss.backward()
        step_loss += loss.detach()
    if reduce_gradients is not None:
        reduce_gradients(step_loss)
    grad_norm = None
    if max_grad_norm is not None:
        grad_norm = clip_grad_norm([p for group in optimizer.param_groups for p in group["params"]], max_grad_norm)
    if skip_nonfinite:
        if not optimizer.defaults.get("fused"):
            raise ValueError("skip_nonfinite needs a fused optimizer (build_optimizer's), which reads found_inf")
        flag = nonfinite(step_loss, grad_norm)
        # The flag GradScaler hands fused optimizers: read on the device, the host never waits for it.
        optimizer.found_inf = agree(flag) if agree is not None else flag
    optimizer.step()
    if skip_nonfinite:
        del optimizer.found_inf
    if scheduler is not None:
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return step_loss, grad_norm
