"""Gluon helpers shared by the Hopper (sm_90) kernels: their jit with unspecialised integers, the wgmma
accumulator layout, the per-head TMA view each partition builds, a one-tile program's sequence and tile, and the
consumers' turns on the tensor cores (tile_ops.py is the tl kernels' side)."""

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


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def program_sequence_tile(num_seqs, CU_SEQLENS, BLOCK: gl.constexpr, LAST_FIRST: gl.constexpr,
                          IS_VARLEN: gl.constexpr, SEQS_PAD: gl.constexpr, NUM_WARPS: gl.constexpr):
    """(sequence, tile within it) of a one-tile program, as tile_ops.program_tile places them: dense, its grid
    position (tiles, heads, batch); varlen, the tiles of every sequence packed one after another on a grid of
    (cdiv(total rows, BLOCK) + num_seqs, heads, 1), the programs past the last tile at sequence num_seqs.
    LAST_FIRST: the tiles in reverse order (a causal tile's work grows with its index). Computed once per
    program, before the partitions split, by its NUM_WARPS default warps."""
    t = gl.program_id(0)
    if LAST_FIRST:
        t = gl.num_programs(0) - 1 - t
    if IS_VARLEN:
        index = gl.arange(0, SEQS_PAD, layout=gl.BlockedLayout([1], [32], [NUM_WARPS], [0]))
        starts = gl.load(CU_SEQLENS + index, mask=index < num_seqs, other=0)
        ends = gl.load(CU_SEQLENS + index + 1, mask=index < num_seqs, other=0)
        tiles = (ends - starts + BLOCK - 1) // BLOCK
        seq = gl.sum((gl.associative_scan(tiles, 0, _add) <= t).to(gl.int32), 0)
        tile = t - gl.sum(gl.where(index < seq, tiles, 0), 0)
    else:
        seq = gl.program_id(2)
        tile = t
    return seq, tile


# Named barriers of consumer warpgroups' turns on the tensor cores, one per consumer, above those Triton gives its
# partitions' own thread barriers (ids 0 and 2 onwards; tests/test_kernels_compile.py checks the PTX for a clash).
TURN_BARRIER = gl.constexpr(8)


@gluon.jit
def _named_barrier(barrier_id, ARRIVE: gl.constexpr):
    """bar.sync (or, ARRIVE, bar.arrive) on named barrier ``barrier_id`` for 256 threads (the warpgroup whose turn
    it is and the one handing it over), once per thread of the calling warpgroup: an elementwise asm over one
    element per thread."""
    ONE_PER_THREAD: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])  # the calling warpgroup's 128 threads
    ids = gl.full([128], barrier_id, gl.int32, ONE_PER_THREAD)
    if ARRIVE:
        gl.inline_asm_elementwise("mov.u32 $0, $1;\n\tbar.arrive $1, 256;", "=r,r", [ids], dtype=gl.int32,
                                  is_pure=False, pack=1)
    else:
        gl.inline_asm_elementwise("mov.u32 $0, $1;\n\tbar.sync $1, 256;", "=r,r", [ids], dtype=gl.int32,
                                  is_pure=False, pack=1)


@gluon.jit
def wait_turn(CONSUMER: gl.constexpr, TURNS: gl.constexpr):
    """TURNS (the number of consumer warpgroups; 0: no turns): wait until the consumer before this one has issued
    its products, so that the consumers issue theirs in rotation and one's softmax runs under the next one's
    products, as FlashAttention-3's warp scheduler barriers make them. The last consumer hands consumer 0 the first
    turn (pass_turn) before its first wait."""
    if TURNS > 0:
        _named_barrier(TURN_BARRIER + CONSUMER, False)


@gluon.jit
def pass_turn(CONSUMER: gl.constexpr, TURNS: gl.constexpr):
    """Hand the tensor cores to the next consumer (see wait_turn)."""
    if TURNS > 0:
        _named_barrier(TURN_BARRIER + (CONSUMER + 1) % TURNS, True)
