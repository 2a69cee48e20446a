"""The fused Gluon backward's dQ share (flash_bwd_hopper.py with DQ_MODE ordered or unordered), reduced
in bulk as FlashAttention-3 does it: a consumer stores its share dS K (fp32) to a shared-memory tile and
adds the whole tile into the fp32 dQ accumulator with one TMA reduction (PTX
cp.reduce.async.bulk.tensor ... .add), instead of 64 x head_dim scalar atomics.

Ordered (deterministic): one int32 semaphore per (batch, query head, query tile) admits the tile's
contributors one at a time in a fixed order, so every element's fp32 sum runs in the same order on every
run. Gluon 3.6's hopper tma module has copies only; the reduction is its IR op (ttng.async_tma_reduce).
Also here: the heads descriptors (and their tiles' views) through which the dK/dV kernel's TMA copies and
reductions see every head of a GQA group.
"""

from __future__ import annotations

from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, tma


@builtin
def async_reduce_add_shared_to_global(tensor_desc, coord, src, _semantic=None):
    """Add the shared-memory tile ``src`` into the box of ``tensor_desc`` at ``coord`` (elements past the
    tensor's ends are dropped). Asynchronous like tma.async_copy_shared_to_global: ``src`` may be
    rewritten after tma.store_wait."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


@gluon.jit
def heads_descriptor(base, heads, rows, stride_heads, stride_rows, BLOCK: gl.constexpr, HEAD_DIM: gl.constexpr,
                     HEAD_DIM_PAD: gl.constexpr, LAYOUT: gl.constexpr):
    """TMA view of ``heads`` consecutive heads, (heads, rows, HEAD_DIM) from ``base``, in (1, BLOCK,
    HEAD_DIM_PAD) tiles that read zeros past the ends: one descriptor serves every query head of a GQA
    group (a descriptor rebuilt per head would be rewritten while TMA copies may still read it)."""
    return tma.make_tensor_descriptor(base, [heads, rows, HEAD_DIM], [stride_heads, stride_rows, 1],
                                      [1, BLOCK, HEAD_DIM_PAD], LAYOUT)


@gluon.jit
def tma_view(tile):
    """A (rows, cols) shared-memory tile as the (1, rows, cols) box of a heads descriptor."""
    return tile.reshape([1, tile.shape[0], tile.shape[1]])


@gluon.jit
def _wait_until_at_least(pointers, targets):
    """Each thread spins (ld.acquire.gpu) until its int32 at ``pointers`` reaches its ``targets``, then
    fences the proxies: the bulk reductions its program issues next (async proxy) come after the writes
    that the value released. Per thread, with no reduction across the warps: the threads that issue
    the TMA messages have acquired for themselves. Returns the value seen."""
    return gl.inline_asm_elementwise(
        """{
        .reg .pred waiting;
        spin:
        ld.acquire.gpu.global.b32 $0, [$1];
        setp.lt.s32 waiting, $0, $2;
        @waiting bra spin;
        fence.proxy.async.global;
        }""", "=r,l,r", [pointers, targets], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _release_after_bulk_writes(pointers, increments):
    """Wait until this thread's bulk reductions have written global memory (tma.store_wait waits only
    until they have read shared memory), then release-add ``increments`` (1, or 0 for nothing to release)
    to ``pointers``."""
    return gl.inline_asm_elementwise(
        "cp.async.bulk.wait_group 0;\n\tfence.proxy.async.global;\n\tatom.release.gpu.global.add.u32 $0, [$1], $2;",
        "=r,l,r", [pointers, increments], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def release_dq_share(semaphore, released, THREADS: gl.constexpr, ONE_PER_THREAD: gl.constexpr):
    """ORDERED: once this consumer's last reduction has landed, count it into ``semaphore`` (its tile's
    counter), from each of the THREADS threads; ``released`` False adds nothing (no share was added)."""
    counters = semaphore + gl.zeros([THREADS], gl.int32, ONE_PER_THREAD)
    _release_after_bulk_writes(counters, gl.full([THREADS], 1, gl.int32, ONE_PER_THREAD) * released.to(gl.int32))


@gluon.jit
def add_dq_share(dq, stage, dq_desc, head, m0, col, semaphore, rank, previous, has_previous, ORDERED: gl.constexpr,
                 THREADS: gl.constexpr, ONE_PER_THREAD: gl.constexpr):
    """Add a consumer's dQ share into rows m0.. and columns col.. of query ``head`` of the accumulator
    behind ``dq_desc``.

    Args:
        dq: the share, fp32 registers (BLOCK_M x the box's width: HEAD_DIM_PAD, or half of it).
        stage: the consumer's fp32 shared tile of that shape; its previous share may still be in flight.
        dq_desc: heads descriptor of the accumulator, (heads, seqlen_q, HEAD_DIM_PAD), box (1, BLOCK_M,
            the share's width).
        semaphore, rank: ORDERED only: the tile's counter and this contributor's place among its
            contributors. Each of the consumer's THREADS threads waits (acquire) until the counter
            reaches THREADS x rank; the TMA messages of one tile are spread over several threads, and
            counting every thread makes the next contributor wait for all of them without a barrier.
        previous, has_previous: ORDERED only: the counter of this consumer's previous share (if any),
            released here, a query tile after its reduction was issued (see release_dq_share), so that
            the consumer never waits for its own reduction's round trip to L2; the caller releases its
            last share after the loop.
        ONE_PER_THREAD: a 1-D layout of THREADS elements, one per thread.
    """
    if ORDERED:  # also: the previous share has left the stage
        release_dq_share(previous, has_previous, THREADS, ONE_PER_THREAD)
    else:
        tma.store_wait(0)  # the previous share has left the stage (a whole query tile ago)
    stage.store(dq)
    fence_async_shared()
    if ORDERED:
        counters = semaphore + gl.zeros([THREADS], gl.int32, ONE_PER_THREAD)
        _wait_until_at_least(counters, gl.full([THREADS], rank * THREADS, gl.int32, ONE_PER_THREAD))
    async_reduce_add_shared_to_global(dq_desc, [head, m0, col], tma_view(stage))
