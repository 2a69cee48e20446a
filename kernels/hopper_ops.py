"""Gluon helpers shared by the Hopper (sm_90) kernels: their jit with unspecialised integers, the wgmma
accumulator layout, and the per-head TMA view each partition builds (tile_ops.py is the tl kernels' side)."""

from __future__ import annotations

import inspect

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import tma

# Query rows of one consumer warpgroup in the forward: a wgmma's M, so one product per warpgroup and tile.
CONSUMER_ROWS = gl.constexpr(64)


def unspecialised_jit(fn):
    """``gluon.jit`` with every lower-case argument (lengths, strides, window bounds) unspecialised: through
    TMA descriptors the sm_90 PTX is the same with or without divisibility by 16 (compared for each kernel),
    so Triton's variants would only compile the same kernel again per class of length. CI compiles these."""
    return gluon.jit(fn, do_not_specialize=[name for name in inspect.signature(fn).parameters if name.islower()])


@gluon.constexpr_function
def mma_layout(n, num_warps):
    """Accumulator layout of a (rows, n) wgmma product: one 16-row slab per warp of the warpgroup."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, n, 16])


@gluon.jit
def rows_descriptor(base, rows, stride_rows, BLOCK: gl.constexpr, HEAD_DIM: gl.constexpr,
                    HEAD_DIM_PAD: gl.constexpr, LAYOUT: gl.constexpr):
    """TMA view of one head, (rows, HEAD_DIM) from ``base`` in (BLOCK, HEAD_DIM_PAD) tiles: zeros are read past
    either end and stores are clipped there. Each partition builds the descriptors it uses: one written to global
    memory reaches the TMA unit only through the writing threads' tensormap fence, which no other warp executes."""
    return tma.make_tensor_descriptor(base, [rows, HEAD_DIM], [stride_rows, 1], [BLOCK, HEAD_DIM_PAD], LAYOUT)
