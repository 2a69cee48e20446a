"""The fused Gluon backward for Hopper (sm_90): flash_bwd_hopper.py's dK/dV kernel also forming dQ
(DQ_ORDERED or DQ_ATOMIC there), 5 tile products per query tile and key block instead of the two
kernels' 7. Runs after flash_bwd.py's preprocess (delta, lse in log2 units), like the two kernels.
"""

from __future__ import annotations

import torch
import triton

from .flash_bwd_hopper import FUSED_BLOCK_M, launch_dkdv, split_head_dim


def fused_supports(head_dim_pad):
    """Whether the dK/dV kernel can also form dQ (DQ_ATOMIC / DQ_ORDERED) at this padded head_dim: not
    when the consumers split the head_dim (each would own half of dQ's columns and need an order of
    its own); head_dim 256 keeps the two-kernel path."""
    return not split_head_dim(head_dim_pad)


def launch_fused(q, k, v, grad_out, dq, dk, dv, lse_log2, delta, softmax_scale, qk_scale, softcap_log2, window_left,
                 window_right, softcap, head_dim_pad, strides, strides_lse, deterministic=True):
    """dQ, dK and dV from the dK/dV kernel alone (fused_supports): dQ's shares are summed in fp32 in a
    fixed order (``deterministic``) or in arrival order, then scaled into ``dq``. Arguments as
    flash_bwd_hopper.launch_dkdv's, ``strides`` without dq's."""
    dq_acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    semaphores = None
    if deterministic:
        batch, seqlen_q, heads_q = q.shape[:3]
        semaphores = torch.zeros(batch * heads_q * triton.cdiv(seqlen_q, FUSED_BLOCK_M), dtype=torch.int32,
                                 device=q.device)
    launch_dkdv(q, k, v, grad_out, dk, dv, lse_log2, delta, softmax_scale, qk_scale, softcap_log2, window_left,
                window_right, softcap, head_dim_pad, strides, strides_lse, dq_acc=dq_acc, dq_semaphores=semaphores)
    return dq.copy_(dq_acc.mul_(softmax_scale))
