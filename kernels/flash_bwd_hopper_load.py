"""The producer partition of the Hopper dK/dV kernel (flash_bwd_hopper.py): one warp that loads the program's K and V
tiles once, then streams every query tile of its GQA group by TMA into a ring of NUM_STAGES slots: Q with its rows'
delta (one "ready" mbarrier), dO with their lse (another), each slot refilled once both consumers have released it."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

from .dq_reduce_hopper import heads_descriptor, tma_view
from .hopper_ops import rows_descriptor


@gluon.jit
def dkdv_load_partition(q_base, do_base, k_base, v_base, lse_group, delta_group, stride_qh, stride_qs, stride_doh,
                        stride_dos, stride_ks, stride_vs, stride_lse_h, seqlen_q, seqlen_k, q_smem, do_smem, k_smem,
                        v_smem, lse_smem, delta_smem, kv_bars, q_ready, do_ready, slot_empty, n0, start,
                        tiles_per_head, stats_first, GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, HEAD_DIM_PAD: gl.constexpr,
                        BLOCK_M: gl.constexpr, NUM_STAGES: gl.constexpr, SPLIT_HEAD_DIM: gl.constexpr,
                        QO_TMA: gl.constexpr, KV_SMEM: gl.constexpr, KEYS: gl.constexpr):
    q_desc = heads_descriptor(q_base, GROUP, seqlen_q, stride_qh, stride_qs, BLOCK_M, HEAD_DIM, HEAD_DIM_PAD, QO_TMA)
    do_desc = heads_descriptor(do_base, GROUP, seqlen_q, stride_doh, stride_dos, BLOCK_M, HEAD_DIM, HEAD_DIM_PAD,
                                QO_TMA)
    k_desc = rows_descriptor(k_base, seqlen_k, stride_ks, KEYS, HEAD_DIM, HEAD_DIM_PAD, KV_SMEM)
    v_desc = rows_descriptor(v_base, seqlen_k, stride_vs, KEYS, HEAD_DIM, HEAD_DIM_PAD, KV_SMEM)
    # The group's row statistics as one run of rows (each head's padded to STATS_ROWS), BLOCK_M rows a copy; the
    # sequence's from stats_first on (varlen: its first row among the packed ones).
    lse_desc = tma.make_tensor_descriptor(lse_group, [GROUP * stride_lse_h], [1], [BLOCK_M], lse_smem.layout)
    delta_desc = tma.make_tensor_descriptor(delta_group, [GROUP * stride_lse_h], [1], [BLOCK_M], lse_smem.layout)
    for c in gl.static_range(1 if SPLIT_HEAD_DIM else 2):
        bar = kv_bars.index(c)
        mbarrier.expect(bar, 2 * k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [n0 + c * KEYS, 0], bar, k_smem.index(c))
        tma.async_copy_global_to_shared(v_desc, [n0 + c * KEYS, 0], bar, v_smem.index(c))
    for i in range(GROUP * tiles_per_head):
        stage = i % NUM_STAGES
        head = i // tiles_per_head
        m0 = start + (i - head * tiles_per_head) * BLOCK_M
        # The slot's previous use (tile i - NUM_STAGES) must be released by both consumers first.
        mbarrier.wait(slot_empty.index(stage), ((i // NUM_STAGES) & 1) ^ 1, pred=i >= NUM_STAGES)
        # delta with Q (dP^T's accumulator starts at -delta before S^T is issued), lse with dO
        mbarrier.expect(q_ready.index(stage), q_desc.block_type.nbytes + delta_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [head, m0, 0], q_ready.index(stage),
                                        tma_view(q_smem.index(stage)))
        stats_row = (head * stride_lse_h + stats_first + m0).to(gl.int32)  # TMA coordinates are 32-bit
        tma.async_copy_global_to_shared(delta_desc, [stats_row], q_ready.index(stage), delta_smem.index(stage))
        mbarrier.expect(do_ready.index(stage), do_desc.block_type.nbytes + lse_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(do_desc, [head, m0, 0], do_ready.index(stage),
                                        tma_view(do_smem.index(stage)))
        tma.async_copy_global_to_shared(lse_desc, [stats_row], do_ready.index(stage), lse_smem.index(stage))
