"""The order in which the fused Gluon backward (flash_bwd_hopper.DQ_ORDERED) reduces dQ shares.

Each query tile's semaphore admits its contributors by rank: the key blocks whose query_range holds
the tile, counted down from tile_ops.last_key_block (the order in which they reach the tile). Run in
Triton's interpreter, query_range and last_key_block must give every contributor of a tile a distinct
rank 0, 1, ..., in descending key-block order (a gap would leave a waiter spinning forever), and the
contributors must be exactly the key blocks that see the tile under the mask (bottom-right causal,
windows), enumerated here by brute force. On a GPU the same functions run compiled.
"""

import pytest
import torch
import triton
import triton.language as tl

from flashformer.kernels.tile_ops import last_key_block, query_range

BLOCK_M, BLOCK_N = 64, 128


@triton.jit
def _contributor_ranks(RANKS, seqlen_q, seqlen_k, window_left, window_right, num_tiles, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, LEFT_BOUNDED: tl.constexpr, RIGHT_BOUNDED: tl.constexpr):
    """RANKS[block, tile]: the key block's rank among the contributors to the query tile, for the tiles
    the dK/dV kernel walks (its query_range); the others keep their fill."""
    block = tl.program_id(0)
    n0 = block * BLOCK_N
    start, _, _, end = query_range(n0, seqlen_q, seqlen_k, window_left, window_right, BLOCK_M, BLOCK_N,
                                   LEFT_BOUNDED, RIGHT_BOUNDED)
    for m0 in range(start, end, BLOCK_M):
        rank = last_key_block(m0, seqlen_q, seqlen_k, window_right, BLOCK_M, BLOCK_N, RIGHT_BOUNDED) - block
        tl.store(RANKS + block * num_tiles + m0 // BLOCK_M, rank)


def visible_pairs(seqlen_q, seqlen_k, window_left, window_right):
    """Bool (key blocks, query tiles): whether any row of the tile sees any key of the block."""
    rows = torch.arange(seqlen_q)[:, None]
    cols = torch.arange(seqlen_k)[None, :]
    shifted = rows + seqlen_k - seqlen_q
    mask = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool)
    if window_right >= 0:
        mask &= cols <= shifted + window_right
    if window_left >= 0:
        mask &= cols >= shifted - window_left
    tiles, blocks = triton.cdiv(seqlen_q, BLOCK_M), triton.cdiv(seqlen_k, BLOCK_N)
    padded = torch.zeros(tiles * BLOCK_M, blocks * BLOCK_N, dtype=torch.bool)
    padded[:seqlen_q, :seqlen_k] = mask
    return padded.view(tiles, BLOCK_M, blocks, BLOCK_N).any(dim=(1, 3)).T


# (seqlen_q, seqlen_k, window_left, window_right): full, causal (both length orders), windows
CASES = [(300, 500, -1, -1), (1000, 1000, -1, 0), (513, 200, -1, 0), (200, 777, -1, 0), (700, 700, 100, 0),
         (640, 1000, 300, 40), (1000, 333, 17, 5), (129, 1, -1, -1), (1, 300, 64, 0), (900, 900, 0, 0),
         # a tile's first visible key just before / on a key-block boundary
         (1000, 1000, 1, 0), (1000, 1000, 64, 0), (700, 765, 66, 3),
         # whole query tiles only (no partial last tile), causal and right-bounded
         (1024, 1024, -1, 0), (512, 300, -1, 0), (640, 900, -1, 70)]


@pytest.mark.parametrize("seqlen_q,seqlen_k,window_left,window_right", CASES)
def test_contributors_rank_consecutively_from_the_last_key_block(seqlen_q, seqlen_k, window_left, window_right,
                                                                 device):
    tiles, blocks = triton.cdiv(seqlen_q, BLOCK_M), triton.cdiv(seqlen_k, BLOCK_N)
    ranks = torch.full((blocks, tiles), -1, dtype=torch.int32, device=device)
    _contributor_ranks[(blocks,)](ranks, seqlen_q, seqlen_k, window_left, window_right, tiles, BLOCK_M=BLOCK_M,
                                  BLOCK_N=BLOCK_N, LEFT_BOUNDED=window_left >= 0, RIGHT_BOUNDED=window_right >= 0)
    ranks = ranks.cpu()
    walked = ranks >= 0
    assert torch.equal(walked, visible_pairs(seqlen_q, seqlen_k, window_left, window_right))
    assert walked.any()
    for tile in range(tiles):
        contributors = walked[:, tile].nonzero().flatten()
        assert torch.equal(ranks[contributors.flip(0), tile], torch.arange(len(contributors), dtype=torch.int32)), tile

