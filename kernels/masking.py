"""Which keys a query sees: causal and sliding-window semantics, shared by every attention path.

flash-attn's convention: the mask is aligned bottom-right, so with ``diag = seqlen_k - seqlen_q``
query i sees key j iff ``i + diag - left <= j <= i + diag + right``, where a negative bound is
unbounded and ``causal`` means ``right = 0``.
"""

from __future__ import annotations

import torch


def normalize_window(causal: bool, window_size: tuple[int, int]) -> tuple[int, int]:
    """Fold ``causal`` into the window: (left, right) with -1 for an unbounded side."""
    left, right = window_size
    if causal:
        right = 0
    return left, right


def visible_mask(q0, q1, k0, k1, seqlen_q, seqlen_k, window_left, window_right, device):
    """Bool (q1 - q0, k1 - k0): True where query q0 + r sees key k0 + c."""
    rows = torch.arange(q0, q1, device=device)[:, None] + (seqlen_k - seqlen_q)
    cols = torch.arange(k0, k1, device=device)[None, :]
    mask = cols < seqlen_k
    if window_right >= 0:
        mask = mask & (cols <= rows + window_right)
    if window_left >= 0:
        mask = mask & (cols >= rows - window_left)
    return mask


def key_block_range(q0, q1, seqlen_q, seqlen_k, window_left, window_right):
    """Keys that queries [q0, q1) may see: (lo, full_lo, full_hi, hi).

    Keys outside [lo, hi) are invisible to every row; keys in [full_lo, full_hi) are visible to
    every row, so tiles inside it need no mask. full_lo >= full_hi means no such key.
    """
    diag = seqlen_k - seqlen_q
    last = min(q1, seqlen_q) - 1
    lo, hi, full_lo, full_hi = 0, seqlen_k, 0, seqlen_k
    if window_right >= 0:
        hi = max(0, min(hi, last + diag + window_right + 1))
        full_hi = max(0, min(full_hi, q0 + diag + window_right + 1))
    if window_left >= 0:
        lo = min(seqlen_k, max(lo, q0 + diag - window_left))
        full_lo = max(full_lo, last + diag - window_left)
    return lo, full_lo, full_hi, hi
