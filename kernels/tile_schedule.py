"""Tile schedule of the persistent Hopper forward: which (batch, head, query block) tiles each program
runs, in what order, and how many sets of Q blocks it holds.

A persistent launch has one program per SM (up to the number of tiles); program p runs tiles p,
p + programs, p + 2 * programs, ... of one global order, derived from its id alone: a static schedule,
with no counter in global memory to reset between launches. The order walks the (batch, head) pairs,
heads inner, in sections whose K and V fit in L2 together (the programs running at one time share
them); within a section it takes the query blocks longest first and, for each block, all of the
section's pairs. Under a causal mask (any right bound) the last query blocks see the most keys, so the
blocks go last to first and the launch ends on short tiles; with only a left window bound the first
blocks are the longest. Two-sided windows give every block about the same length (shorter only at
the edges), and so does no mask.

tile_coords is the decoding the kernel runs (a triton.jit function: the Gluon kernel calls it, and the
interpreter runs it on CPU); schedule() builds the same order from nested loops in plain Python, the
reference the tests hold tile_coords to.
"""

import triton
import triton.language as tl

from .tile_ops import key_range

# K and V bytes a section of (batch, head) pairs may read: a third of the H200's 50 MB L2, which also
# holds the Q tiles streaming through and the outputs being written.
L2_SECTION_BYTES = 16 * 1024 * 1024
# Shared memory a program's tiles may take on the H200 (227 KB, less what barriers and scratch need).
TILE_SHARED_BYTES = 226 * 1024


@triton.jit
def tile_coords(tile, num_m_blocks, heads, pairs, section, LONGEST_LAST: tl.constexpr):
    """(batch, head, query block) of global tile ``tile``.

    Args:
        num_m_blocks: query blocks per head; heads: query heads; pairs: batch * heads; section: pairs per
        L2 section (the last section may be shorter); LONGEST_LAST: the last query block is the longest.
    """
    section_tiles = section * num_m_blocks
    index = tile // section_tiles
    within = tile - index * section_tiles
    width = tl.minimum(section, pairs - index * section)
    rank = within // width
    pair = index * section + within - rank * width
    m_block = rank
    if LONGEST_LAST:
        m_block = num_m_blocks - 1 - rank
    return pair // heads, pair % heads, m_block


@triton.jit
def program_tile(RIGHT_BOUNDED: tl.constexpr):
    """(batch, head, query block) of a program of the one-tile-per-program grid (blocks, heads, batch):
    causal, the blocks run last to first, the longest first."""
    pid_m = tl.program_id(0)
    if RIGHT_BOUNDED:
        pid_m = tl.num_programs(0) - 1 - pid_m
    return tl.program_id(2), tl.program_id(1), pid_m


@triton.jit
def query_block(pid_m, seqlen_q, seqlen_k, window_left, window_right, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, LEFT_BOUNDED: tl.constexpr, RIGHT_BOUNDED: tl.constexpr):
    """Query block pid_m's first row and key tiles: m0, start, unmasked start, unmasked end, tile count."""
    m0 = pid_m * BLOCK_M
    start, un_lo, un_hi, end = key_range(m0, seqlen_q, seqlen_k, window_left, window_right,
                                         BLOCK_M, BLOCK_N, LEFT_BOUNDED, RIGHT_BOUNDED)
    return m0, start, un_lo, un_hi, (end - start) // BLOCK_N


def schedule(programs, batch, heads, num_m_blocks, section, longest_last):
    """Tiles of each of ``programs`` programs in the order each runs them, as (batch, head, m_block).

    Args:
        programs: the grid; batch, heads: query (batch, head) pairs; num_m_blocks: query blocks per head;
        section: pairs per L2 section; longest_last: blocks go last to first (causal).
    """
    pairs = [(b, h) for b in range(batch) for h in range(heads)]
    blocks = range(num_m_blocks - 1, -1, -1) if longest_last else range(num_m_blocks)
    order = [(b, h, m) for first in range(0, len(pairs), section) for m in blocks
             for b, h in pairs[first:first + section]]
    return [order[p::programs] for p in range(programs)]


def section_pairs(seqlen_k, head_dim_pad, heads_q, heads_kv, element_size):
    """(batch, head) pairs per L2 section: the query heads of as many key/value heads as L2_SECTION_BYTES
    holds K and V of (at least one).

    Args:
        seqlen_k: keys per sequence; head_dim_pad: the padded head_dim TMA reads; heads_q, heads_kv: query
        and key/value heads (a key/value head serves heads_q // heads_kv consecutive query heads).
    """
    kv_head_bytes = 2 * seqlen_k * head_dim_pad * element_size
    return max(1, L2_SECTION_BYTES // kv_head_bytes) * (heads_q // heads_kv)


def q_buffers(ring_rows, query_rows, head_dim_pad, element_size):
    """Sets of Q blocks a persistent program holds: 2 where two fit beside the K/V ring (the next tile's
    queries load while this tile runs; at head_dim 256 they do not), else 1.

    Args:
        ring_rows: K and V rows in the ring (2 * stages * BLOCK_N); query_rows: rows of one set (BLOCK_M).
    """
    return 2 if (ring_rows + 2 * query_rows) * head_dim_pad * element_size <= TILE_SHARED_BYTES else 1
