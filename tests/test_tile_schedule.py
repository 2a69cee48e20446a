"""The persistent Hopper forward's tile schedule (kernels/tile_schedule.py).

The walk the kernel's partitions run (their slice of the schedule table, tile_coords, then query_block's
key tiles), executed by Triton's interpreter, must give every program the tiles the host dealt it, cover
every (batch, head, query block) exactly once, and keep each L2 section's tiles longest first; the deal
must leave no program far above the mean.
"""

import pytest
import torch
import triton
import triton.language as tl

from flashformer.kernels.tile_schedule import (L2_SECTION_BYTES, TILE_OVERHEAD_KEY_TILES, balanced_schedule,
                                               block_key_tiles, device_schedule, query_block, scheduled_tiles,
                                               section_pairs, tile_coords, tile_order)

FIELDS = 4  # batch, head, query block, key tiles


@triton.jit
def _walk_schedule(OUT, TILE_SCHEDULE, batch_size, heads, num_m_blocks, section, max_tiles, seqlen_q, seqlen_k,
                   window_left, window_right, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   LEFT_BOUNDED: tl.constexpr, RIGHT_BOUNDED: tl.constexpr):
    """Each program's tiles in the order it runs them, as the persistent forward's partitions walk them."""
    first, last = scheduled_tiles(TILE_SCHEDULE)
    for index in range(last - first):
        tile = tl.load(TILE_SCHEDULE + first + index)
        batch, head, m_block = tile_coords(tile, num_m_blocks, heads, batch_size * heads, section, RIGHT_BOUNDED)
        _, _, _, _, key_tiles = query_block(m_block, seqlen_q, seqlen_k, window_left, window_right, BLOCK_M, BLOCK_N,
                                            LEFT_BOUNDED, RIGHT_BOUNDED)
        row = OUT + (tl.program_id(0) * max_tiles + index) * 4
        tl.store(row, batch)
        tl.store(row + 1, head)
        tl.store(row + 2, m_block)
        tl.store(row + 3, key_tiles)


def walk_schedule(programs, batch, heads, seqlen_q, seqlen_k, window, section, device, block_m=192, block_n=128):
    """Per program, its (batch, head, m_block, key tiles) tiles as the kernel walks the table the launch makes."""
    num_m_blocks = triton.cdiv(seqlen_q, block_m)
    table = device_schedule(torch.device(device), programs, batch, heads, num_m_blocks, section, seqlen_q, seqlen_k,
                            window[0], window[1], block_m, block_n)
    max_tiles = max(table[1:programs + 1] - table[:programs]).item()
    out = torch.full((programs, max_tiles, FIELDS), -1, dtype=torch.int32, device=device)
    _walk_schedule[(programs,)](out, table, batch, heads, num_m_blocks, section, max_tiles, seqlen_q, seqlen_k,
                                window[0], window[1], BLOCK_M=block_m, BLOCK_N=block_n, LEFT_BOUNDED=window[0] >= 0,
                                RIGHT_BOUNDED=window[1] >= 0)
    return [[tuple(tile) for tile in rows.tolist() if tile[0] >= 0] for rows in out]


# (batch, heads, seqlen_q, seqlen_k, window, programs, section): window (-1, 0) is causal (bottom-right);
# sections of 4 pairs leave a short last section of 2 (6 pairs); 1000 queries make a ragged last block.
CASES = [(2, 3, 1000, 1000, (-1, 0), 5, 4), (2, 3, 1000, 1000, (-1, 0), 132, 6), (1, 5, 300, 1000, (-1, 0), 4, 2),
         (2, 3, 1000, 1000, (-1, -1), 7, 4), (2, 3, 1000, 700, (300, -1), 5, 4), (3, 2, 777, 900, (-1, 40), 8, 5),
         (2, 3, 1000, 1000, (256, 0), 5, 4)]


@pytest.mark.parametrize("batch, heads, seqlen_q, seqlen_k, window, programs, section", CASES)
def test_schedule_covers_every_tile_once_as_dealt_longest_first(batch, heads, seqlen_q, seqlen_k, window, programs,
                                                                section, device):
    num_m_blocks = triton.cdiv(seqlen_q, 192)
    programs = min(programs, batch * heads * num_m_blocks)
    walked = walk_schedule(programs, batch, heads, seqlen_q, seqlen_k, window, section, device)
    order = tile_order(batch, heads, num_m_blocks, section, longest_last=window[1] >= 0)
    key_tiles = block_key_tiles(num_m_blocks, seqlen_q, seqlen_k, window[0], window[1], 192, 128)
    shares = balanced_schedule(programs, [key_tiles[m] for _, _, m in order])
    assert [[tile[:3] for tile in tiles] for tiles in walked] == [[order[t] for t in share] for share in shares]
    # the host's count of each block's key tiles is the kernel's
    assert all(tile[3] == key_tiles[tile[2]] for tiles in walked for tile in tiles)
    assert all(share == sorted(share) for share in shares)  # every program walks the order forward

    every = sorted(tile[:3] for tiles in walked for tile in tiles)
    assert every == [(b, h, m) for b in range(batch) for h in range(heads) for m in range(num_m_blocks)]

    section_tiles = section * num_m_blocks
    for first in range(0, len(order), section_tiles):
        lengths = [key_tiles[m] for _, _, m in order[first:first + section_tiles]]
        if window[0] >= 0 and window[1] >= 0:
            # Two-sided: a block's window is cut only at the sequence's ends, and where it falls on the
            # key tiles moves its count by one, so last to first is longest first up to that one tile.
            assert all(a >= b - 1 for i, a in enumerate(lengths) for b in lengths[i + 1:]), lengths
        else:
            assert lengths == sorted(lengths, reverse=True), (first, lengths)


# The H200's causal grid (16k tokens per call, 2048 / head_dim heads), and gpt2-124m's attention at 1k and 4k.
BALANCE_CASES = [(32, 16, 512, 128), (16, 16, 1024, 128), (4, 16, 4096, 128), (1, 16, 16384, 128),
                 (16, 12, 1024, 64), (16, 12, 4096, 64), (8, 32, 2048, 64), (16, 8, 1024, 256)]


@pytest.mark.parametrize("batch, heads, seqlen, head_dim", BALANCE_CASES)
def test_the_deal_leaves_no_program_far_above_the_mean(batch, heads, seqlen, head_dim):
    """Causal, 128-row blocks and 128-key tiles over 132 programs: the busiest program has at most 5% more
    work than the mean. Each program's p-th tile by stride left the busiest at 1.15-1.30x here."""
    num_m_blocks = seqlen // 128
    order = tile_order(batch, heads, num_m_blocks, section_pairs(seqlen, head_dim, heads, heads, 2), True)
    key_tiles = block_key_tiles(num_m_blocks, seqlen, seqlen, -1, 0, 128, 128)
    assert key_tiles == list(range(1, num_m_blocks + 1))
    tile_key_tiles = [key_tiles[m] for _, _, m in order]
    loads = [sum(tile_key_tiles[t] + TILE_OVERHEAD_KEY_TILES for t in share)
             for share in balanced_schedule(132, tile_key_tiles)]
    assert max(loads) <= 1.05 * sum(loads) / len(loads), (max(loads), sum(loads) / len(loads))


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


# A persistent launch's table arguments: (programs, batch, heads, num_m_blocks, section, seqlen_q, seqlen_k,
# window_left, window_right, block_m, block_n), causal; evicting() walks MAX_TABLES + 1 other shapes.
TABLE_ARGS = (132, 2, 3, 6, 6, 1000, 1000, -1, 0, 192, 128)


def evicting(device):
    from flashformer.kernels.tile_schedule import MAX_TABLES
    for extra in range(1, MAX_TABLES + 2):
        device_schedule(device, *TABLE_ARGS[:6], TABLE_ARGS[6] + extra, *TABLE_ARGS[7:])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs")
def test_a_table_a_cuda_graph_captured_outlives_the_cache():
    """A graph that read a table keeps reading it after the cache has dropped it and its memory is asked for."""
    device = torch.device("cuda", torch.cuda.current_device())
    expected = device_schedule(device, *TABLE_ARGS).clone()
    copy = torch.empty_like(expected)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        copy.copy_(device_schedule(device, *TABLE_ARGS))
    evicting(device)
    claims = [torch.full_like(expected, -7) for _ in range(512)]  # what would reuse the freed tables' memory
    copy.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(copy, expected), len(claims)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA streams")
def test_a_table_read_on_another_stream_survives_eviction_until_that_stream_is_done():
    device = torch.device("cuda", torch.cuda.current_device())
    expected = device_schedule(device, *TABLE_ARGS).clone()
    other = torch.cuda.Stream(device)
    other.wait_stream(torch.cuda.current_stream(device))
    copy = torch.zeros_like(expected)
    with torch.cuda.stream(other):
        torch.cuda._sleep(200_000_000)  # the copy below reads the table long after the host has moved on
        copy.copy_(device_schedule(device, *TABLE_ARGS))
    evicting(device)
    claims = [torch.full_like(expected, -7) for _ in range(512)]  # on the stream the table was made on
    torch.cuda.synchronize()
    assert torch.equal(copy, expected), len(claims)
