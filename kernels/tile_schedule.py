"""Tile schedule of the persistent Hopper forward: which (batch, head, query block) tiles each program
runs, in what order, and how many sets of Q blocks it holds.

A persistent launch has one program per SM (up to the number of tiles). The tiles have one global
order: it walks the (batch, head) pairs, heads inner, in sections whose K and V fit in L2 together (the
programs running at one time share them); within a section it takes the query blocks longest first and,
for each block, all of the section's pairs. Under a causal mask (any right bound) the last query blocks
see the most keys, so the blocks go last to first; with only a left window bound the first blocks are
the longest. Two-sided windows give every block about the same length (shorter only at the edges), and
so does no mask.

The host deals the global order out to the programs (balanced_schedule): each tile in turn goes to the
program with the least work so far, counted in key tiles, which is how a hardware scheduler hands out
one-tile programs as SMs free up. Taking every program's p-th tile by stride instead (tiles p,
p + programs, ...) costs 15-30% under a causal mask: each section restarts the long blocks, and the
programs whose share lands on them run up to 1.3x the mean. The deal is a table in device memory,
computed once per shape (schedule_table), that each program reads its slice of.

tile_coords is the decoding the kernel runs (a triton.jit function: the Gluon kernel calls it, and the
interpreter runs it on CPU); tile_order() builds the same order from nested loops in plain Python, the
reference the tests hold tile_coords to.
"""

import heapq

import torch
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


@triton.jit
def scheduled_tiles(TILE_SCHEDULE):
    """[first, last): where this program's tiles sit in the schedule table (schedule_table)."""
    return tl.load(TILE_SCHEDULE + tl.program_id(0)), tl.load(TILE_SCHEDULE + tl.program_id(0) + 1)


def tile_order(batch, heads, num_m_blocks, section, longest_last):
    """Every (batch, head, query block) in the global order tile_coords decodes.

    Args:
        batch, heads: query (batch, head) pairs; num_m_blocks: query blocks per head; section: pairs per
        L2 section; longest_last: blocks go last to first (causal).
    """
    pairs = [(b, h) for b in range(batch) for h in range(heads)]
    blocks = range(num_m_blocks - 1, -1, -1) if longest_last else range(num_m_blocks)
    return [(b, h, m) for first in range(0, len(pairs), section) for m in blocks
            for b, h in pairs[first:first + section]]


def block_key_tiles(num_m_blocks, seqlen_q, seqlen_k, window_left, window_right, block_m, block_n):
    """Key tiles of each query block, as query_block counts them on the device (-1 = unbounded side)."""
    diag, tiles = seqlen_k - seqlen_q, []
    for m in range(num_m_blocks):
        m0, last = m * block_m, min((m + 1) * block_m, seqlen_q) - 1
        lo = min(max(0, m0 + diag - window_left), seqlen_k) if window_left >= 0 else 0
        hi = max(min(seqlen_k, last + diag + window_right + 1), 0) if window_right >= 0 else seqlen_k
        tiles.append(-(-hi // block_n) - lo // block_n)
    return tiles


# A tile's fixed work (its Q load, the epilogue's normalisation and output store) in key tiles, so that a
# tile without keys still counts.
TILE_OVERHEAD_KEY_TILES = 1


def balanced_schedule(programs, tile_costs):
    """Each program's tiles (indices into the global order, ascending): tile t goes to the program with the
    least cost so far (the lowest-numbered among equals), so that the programs finish together.

    Args:
        tile_costs: the work of each tile of the global order, in key tiles.
    """
    loads = [(0, p) for p in range(programs)]
    shares = [[] for _ in range(programs)]
    for tile, cost in enumerate(tile_costs):
        load, program = heapq.heappop(loads)
        shares[program].append(tile)
        heapq.heappush(loads, (load + cost + TILE_OVERHEAD_KEY_TILES, program))
    return shares


def schedule_table(programs, order, key_tiles):
    """The table scheduled_tiles reads: programs + 1 offsets into the table itself, then every program's
    tiles in turn (global indices, decoded by tile_coords).

    Args:
        order: tile_order's list; key_tiles: block_key_tiles' list for its query blocks.
    """
    shares = balanced_schedule(programs, [key_tiles[m] for _, _, m in order])
    offsets = [programs + 1]
    for share in shares:
        offsets.append(offsets[-1] + len(share))
    return offsets + [tile for share in shares for tile in share]


_TABLES = {}
MAX_TABLES = 64  # a training run launches a handful of shapes; a long-lived process must not grow without bound
# Tables a CUDA graph has captured: its replays read them, so they outlive the cache's eviction.
_CAPTURED = {}


def device_schedule(device, programs, batch, heads, num_m_blocks, section, seqlen_q, seqlen_k, window_left,
                    window_right, block_m, block_n):
    """schedule_table's int32 tensor on ``device`` for one persistent launch, dealt once per shape; None while
    a CUDA graph is being captured and this shape has none yet (a host-to-device copy cannot be captured):
    the caller launches the one-tile grid then. A table the cache later drops stays safe to read: one that a
    graph captured is kept for the process, and one read on another stream than the one it was made on is
    recorded on that stream, so the allocator reuses its memory only once that stream's queued work is done.

    Args:
        window_left, window_right: -1 = unbounded; causal is window_right = 0 (the blocks go last to first).
    """
    if device.type == "cuda" and device.index is None:  # "cuda" alone: the current device, one key for both spellings
        device = torch.device("cuda", torch.cuda.current_device())
    key = (device, programs, batch, heads, num_m_blocks, section, seqlen_q, seqlen_k, window_left, window_right,
           block_m, block_n)
    entry = _TABLES.get(key)
    if device.type == "cuda":
        if torch.cuda.is_current_stream_capturing():
            if entry is not None:
                _CAPTURED[key] = entry[0]
            return None if entry is None else entry[0]
        stream = torch._C._cuda_getCurrentRawStream(device.index)
        if entry is not None and stream not in entry[1]:
            entry[0].record_stream(torch.cuda.current_stream(device))
            entry[1].add(stream)
    if entry is None:
        if len(_TABLES) >= MAX_TABLES:
            _TABLES.clear()
        order = tile_order(batch, heads, num_m_blocks, section, longest_last=window_right >= 0)
        key_tiles = block_key_tiles(num_m_blocks, seqlen_q, seqlen_k, window_left, window_right, block_m, block_n)
        table = torch.tensor(schedule_table(programs, order, key_tiles), dtype=torch.int32, device=device)
        # the streams the table has been read on: the one it was made on, then any it is recorded on
        entry = _TABLES[key] = (table, {torch._C._cuda_getCurrentRawStream(device.index)} if device.type == "cuda"
                                else set())
    return entry[0]


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
