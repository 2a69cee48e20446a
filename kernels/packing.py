"""Conversions between the ways a packed batch names its documents.

A packed batch puts several documents back to back along the token dim. The varlen kernels want
``cu_seqlens`` (int32 offsets, batch + 1 entries); data pipelines tend to carry per-token document
ids or per-document lengths; rotary embeddings want positions that restart at every document.
"""

from __future__ import annotations

import torch


def cu_seqlens_from_lengths(lengths) -> torch.Tensor:
    """(num_docs,) lengths (list or tensor, zeros allowed) -> int32 (num_docs + 1,) offsets."""
    lengths = torch.as_tensor(lengths)
    if lengths.dim() != 1 or lengths.dtype.is_floating_point or bool((lengths < 0).any()):
        raise ValueError(f"lengths must be a 1-d sequence of non-negative ints, got {lengths!r}")
    return torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)


def cu_seqlens_from_document_ids(document_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Per-token document ids -> (int32 cu_seqlens, max_seqlen).

    Args:
        document_ids: (total,) or (batch, seqlen) ints; a document is a run of equal ids. In the 2-d
            form each row also starts a new document (rows are flattened row-major, as the model does).
    """
    if document_ids.dim() not in (1, 2) or document_ids.dtype.is_floating_point:
        raise ValueError(f"document_ids must be a 1-d or 2-d integer tensor, got {tuple(document_ids.shape)} "
                         f"{document_ids.dtype}")
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[..., 1:] = document_ids[..., 1:] != document_ids[..., :-1]
    flat = starts.flatten()
    total = flat.numel()
    offsets = torch.cat([flat.nonzero().flatten(), torch.tensor([total], device=flat.device)])
    if total == 0:
        offsets = offsets[-1:].repeat(2)
    cu_seqlens = offsets.to(torch.int32)
    return cu_seqlens, int(cu_seqlens.diff().max()) if total else 0


def document_ids_from_cu_seqlens(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """int32 (num_docs + 1,) offsets -> (total,) int64 document index of every token."""
    lengths = cu_seqlens.diff().long()
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=cu_seqlens.device), lengths)


def position_ids_from_cu_seqlens(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """int32 (num_docs + 1,) offsets -> (total,) int64 positions restarting at 0 in every document."""
    total = int(cu_seqlens[-1])
    starts = cu_seqlens[:-1].long()[document_ids_from_cu_seqlens(cu_seqlens)]
    return torch.arange(total, device=cu_seqlens.device) - starts
