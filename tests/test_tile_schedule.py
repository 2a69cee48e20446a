"""The persistent Hopper forward's tile schedule (kernels/tile_schedule.py).

The decoding the kernel's partitions run (tile_coords, then query_block's key tiles), executed by
Triton's interpreter, must give every program the tiles of the plain-Python order, cover every
(batch, head, query block) exactly once, and start the tiles of each L2 section longest first.
"""

import pytest
import torch
import triton
import triton.language as tl

from flashformer.kernels.tile_schedule import L2_SECTION_BYTES, query_block, schedule, section_pairs, tile_coords

FIELDS = 4  # batch, head, query block, key tiles


@triton.jit
def _walk_schedule(OUT, batch_size, heads, num_m_blocks, section, max_tiles, seqlen_q, seqlen_k, window_left,
                   window_right, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, LEFT_BOUNDED: tl.constexpr,
                   RIGHT_BOUNDED: tl.constexpr):
    """Each program's tiles in the order it runs them, as the persistent forward's partitions walk them."""
    pid = tl.program_id(0)
    index = 0
    for tile in range(pid, batch_size * heads * num_m_blocks, tl.num_programs(0)):
        batch, head, m_block = tile_coords(tile, num_m_blocks, heads, batch_size * heads, section, RIGHT_BOUNDED)
        _, _, _, _, key_tiles = query_block(m_block, seqlen_q, seqlen_k, window_left, window_right, BLOCK_M, BLOCK_N,
                                            LEFT_BOUNDED, RIGHT_BOUNDED)
        row = OUT + (pid * max_tiles + index) * 4
        tl.store(row, batch)
        tl.store(row + 1, head)
        tl.store(row + 2, m_block)
        tl.store(row + 3, key_tiles)
        index += 1


def walk_schedule(programs, batch, heads, seqlen_q, seqlen_k, window, section, device, block_m=192, block_n=128):
    """Per program, its (batch, head, m_block, key tiles) tiles as the kernel decodes them."""
    num_m_blocks = triton.cdiv(seqlen_q, block_m)
    max_tiles = triton.cdiv(batch * heads * num_m_blocks, programs)
    out = torch.full((programs, max_tiles, FIELDS), -1, dtype=torch.int32, device=device)
    _walk_schedule[(programs,)](out, batch, heads, num_m_blocks, section, max_tiles, seqlen_q, seqlen_k, window[0],
                                window[1], BLOCK_M=block_m, BLOCK_N=block_n, LEFT_BOUNDED=window[0] >= 0,
                                RIGHT_BOUNDED=window[1] >= 0)
    return [[tuple(tile) for tile in rows.tolist() if tile[0] >= 0] for rows in out]


# (batch, heads, seqlen_q, seqlen_k, window, programs, section): window (-1, 0) is causal (bottom-right);
# sections of 4 pairs leave a short last section of 2 (6 pairs); 1000 queries make a ragged last block.
CASES = [(2, 3, 1000, 1000, (-1, 0), 5, 4), (2, 3, 1000, 1000, (-1, 0), 132, 6), (1, 5, 300, 1000, (-1, 0), 4, 2),
         (2, 3, 1000, 1000, (-1, -1), 7, 4), (2, 3, 1000, 700, (300, -1), 5, 4), (3, 2, 777, 900, (-1, 40), 8, 5),
         (2, 3, 1000, 1000, (256, 0), 5, 4)]


@pytest.mark.parametrize("batch, heads, seqlen_q, seqlen_k, window, programs, section", CASES)
def test_schedule_covers_every_tile_once_longest_first(batch, heads, seqlen_q, seqlen_k, window, programs, section,
                                                      device):
    num_m_blocks = triton.cdiv(seqlen_q, 192)
    programs = min(programs, batch * heads * num_m_blocks)
    walked = walk_schedule(programs, batch, heads, seqlen_q, seqlen_k, window, section, device)
    expected = schedule(programs, batch, heads, num_m_blocks, section, longest_last=window[1] >= 0)
    assert [[tile[:3] for tile in tiles] for tiles in walked] == expected

    every = sorted(tile[:3] for tiles in walked for tile in tiles)
    assert every == [(b, h, m) for b in range(batch) for h in range(heads) for m in range(num_m_blocks)]

    # Global tile t is program t % programs's (t // programs)-th.
    order = [walked[t % programs][t // programs] for t in range(len(every))]
    section_tiles = section * num_m_blocks
    for first in range(0, len(order), section_tiles):
        lengths = [tile[3] for tile in order[first:first + section_tiles]]
        if window[0] >= 0 and window[1] >= 0:
            # Two-sided: a block's window is cut only at the sequence's ends, and where it falls on the
            # key tiles moves its count by one, so last to first is longest first up to that one tile.
            assert all(a >= b - 1 for i, a in enumerate(lengths) for b in lengths[i + 1:]), lengths
        else:
            assert lengths == sorted(lengths, reverse=True), (first, lengths)
    if window == (-1, 0):
        assert order[0][3] > order[-1][3]  # causal: the last tiles to start are the short ones


@pytest.mark.parametrize("seqlen_k, head_dim_pad, heads_q, heads_kv", [(1024, 64, 32, 32), (16384, 128, 16, 16),
                                                                       (4096, 128, 32, 8), (1 << 20, 256, 8, 2)])
def test_a_section_holds_the_kv_heads_l2_can_keep(seqlen_k, head_dim_pad, heads_q, heads_kv):
    group = heads_q // heads_kv
    pairs = section_pairs(seqlen_k, head_dim_pad, heads_q, heads_kv, element_size=2)
    kv_head_bytes = 2 * seqlen_k * head_dim_pad * 2
    assert pairs % group == 0
    kv_heads = pairs // group
    assert kv_heads == 1 or kv_heads * kv_head_bytes <= L2_SECTION_BYTES
    assert (kv_heads + 1) * kv_head_bytes > L2_SECTION_BYTES
