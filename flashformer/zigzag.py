"""Context parallelism's zigzag layout, and the attention calls each ring step makes in it.

The sequence is cut into 2 * world chunks and rank r holds chunks r and 2 * world - 1 - r, so every
rank does the same causal work (rank 0 holds the first and the last chunk). ``ring_plan`` lists, for
every step of the ring, the varlen calls (``RingBlock``) between this rank's queries and the K/V the
step brings, such that together they compute exactly causal (optionally windowed) attention within
each document of the whole rows.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .kernels import cu_seqlens_from_lengths


def zigzag_shard(x, rank, world_size, dim=1):
    """This rank's zigzag slice of a full-sequence tensor (chunks rank and 2*world_size-1-rank).

    Args:
        x: (batch, seqlen, ...) or any tensor whose ``dim`` is the sequence; seqlen divisible by
            2 * world_size.
    Returns:
        (batch, seqlen // world_size, ...): the two chunks, in sequence order.
    """
    chunks = 2 * world_size
    if x.shape[dim] % chunks:
        raise ValueError(f"sequence length {x.shape[dim]} must be divisible by 2 * world_size = {chunks}")
    pieces = x.chunk(chunks, dim)
    return torch.cat([pieces[rank], pieces[chunks - 1 - rank]], dim)


def zigzag_merge(shards, dim=1):
    """Inverse of ``zigzag_shard``: the full sequence from every rank's slice, rank 0 first.

    Args:
        shards: world_size tensors (batch, local_seqlen, ...), local_seqlen even.
    Returns:
        (batch, world_size * local_seqlen, ...).
    """
    halves = [shard.chunk(2, dim) for shard in shards]
    return torch.cat([first for first, _ in halves] + [second for _, second in reversed(halves)], dim)


class RingBlock(NamedTuple):
    """One varlen call of a ring step: rows ``batch_rows`` of this rank's queries ``q_rows`` against
    ``k_rows`` of the K/V held, the segments pairing their documents given by cu_seqlens_q / _k (and
    their longest), causal or not, with a window of ``window_left`` keys (-1: none)."""

    batch_rows: slice
    q_rows: slice
    k_rows: slice
    causal: bool
    window_left: int
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int

    @property
    def window_size(self) -> tuple[int, int]:
        return self.window_left, -1


def _pair_documents(q_documents, k_documents):
    """Varlen offsets that pair the query and key tokens of each document: (cu_seqlens_q, cu_seqlens_k,
    max_seqlen_q, max_seqlen_k). A document on one side only gets an empty segment on the other (its
    queries see no key: out 0, lse -inf).

    Args:
        q_documents, k_documents: (tokens,) int64 document ids, non-decreasing.
    """
    documents = torch.unique(torch.cat([q_documents, k_documents]))
    lengths = [torch.searchsorted(ids, documents, right=True) - torch.searchsorted(ids, documents)
               for ids in (q_documents, k_documents)]
    longest = torch.stack([length.max() for length in lengths]).tolist()
    return (*(cu_seqlens_from_lengths(length).to(q_documents.device) for length in lengths), *longest)


def _whole_step(rank, source, world_size, causal, document_ids):
    """The one call of a step without a window, over both chunks of either side.

    Within a zigzag slice a document's tokens are contiguous and in sequence order (a document in
    both chunks ends the first and starts the second), so causal attention within documents is the
    block's causal flag applied inside each document's segment. The own block is causal as a whole;
    from an earlier source, every query sees that source's first chunk and nothing of its second;
    from a later source, only this rank's second chunk sees anything, and sees all of it. The fully
    masked quarters are sliced away: every non-diagonal step costs the same (all queries x half the
    keys, or half the queries x all keys) on every rank.
    """
    local_seqlen = document_ids.shape[1] // world_size
    half, everything = local_seqlen // 2, slice(0, local_seqlen)
    if not causal:
        q_rows, k_rows, block_causal = everything, everything, False
    elif source == rank:
        q_rows, k_rows, block_causal = everything, everything, True
    elif source < rank:
        q_rows, k_rows, block_causal = everything, slice(0, half), False
    else:
        q_rows, k_rows, block_causal = slice(half, local_seqlen), everything, False
    own = zigzag_shard(document_ids, rank, world_size)[:, q_rows]
    held = zigzag_shard(document_ids, source, world_size)[:, k_rows]
    return [RingBlock(slice(None), q_rows, k_rows, block_causal, -1,
                      *_pair_documents(own.flatten(), held.flatten()))]


def _crossing_blocks(q_rows, k_rows, q_documents, k_documents, reach):
    """Calls of an earlier key chunk against a query chunk under a window, row by row (rows alike merged).

    Only a document that ends the key chunk and starts the query chunk spans both, and only the first
    ``reach`` queries of the chunk come within the window of its last key. With the query segment cut
    there (the rest of the chunk's queries see nothing), query i and key j (of sk) of the segments are
    ``gap + i + sk - j`` tokens apart: a window of ``reach - sq`` keys, bottom-right aligned.

    Args:
        q_rows, k_rows: the chunks' local rows. q_documents, k_documents: (batch, chunk) their documents.
        reach: window_left - the tokens between the chunks; > 0.
    """
    first_query, last_key = q_documents[:, 0], k_documents[:, -1]
    spans = [((q_documents[:, :reach] == first_query[:, None]).sum(1)),
             (k_documents == last_key[:, None]).sum(1)]
    crossing = (first_query == last_key).tolist()
    segments = [(sq, sk) if cross else None for cross, sq, sk in zip(crossing, *(s.tolist() for s in spans))]
    blocks, start = [], 0
    for end in range(1, len(segments) + 1):  # consecutive rows with equal segments share one call
        if end < len(segments) and segments[end] == segments[start]:
            continue
        if segments[start] is not None:
            sq, sk = segments[start]
            rows = end - start
            cu_q, cu_k = (cu_seqlens_from_lengths([n] * rows).to(q_documents.device) for n in (sq, sk))
            blocks.append(RingBlock(slice(start, end), slice(q_rows.start, q_rows.start + sq),
                                    slice(k_rows.stop - sk, k_rows.stop), False, reach - sq, cu_q, cu_k, sq, sk))
        start = end
    return blocks


def _window_step(rank, source, world_size, window_left, document_ids):
    """The calls of a causal step under a window: chunk against chunk, skipping pairs wholly outside it."""
    chunk = document_ids.shape[1] // (2 * world_size)
    chunks = document_ids.split(chunk, dim=1)
    blocks = []
    for q_half, q_chunk in enumerate((rank, 2 * world_size - 1 - rank)):
        q_rows = slice(q_half * chunk, (q_half + 1) * chunk)
        for k_half, k_chunk in enumerate((source, 2 * world_size - 1 - source)):
            k_rows = slice(k_half * chunk, (k_half + 1) * chunk)
            if k_chunk == q_chunk:
                blocks.append(RingBlock(slice(None), q_rows, k_rows, True, window_left,
                                        *_pair_documents(chunks[q_chunk].flatten(), chunks[k_chunk].flatten())))
            elif k_chunk < q_chunk and window_left > (q_chunk - k_chunk - 1) * chunk:
                blocks += _crossing_blocks(q_rows, k_rows, chunks[q_chunk], chunks[k_chunk],
                                           window_left - (q_chunk - k_chunk - 1) * chunk)
    return blocks


def ring_plan(rank, world_size, causal, window_left, document_ids):
    """The RingBlocks of every ring step on ``rank`` (step s holds the K/V of rank ``rank - s``).

    Args:
        causal: causal attention (then the tokens are in the zigzag layout); else full.
        window_left: keys a query sees to its left besides itself, -1 for all; only with causal.
        document_ids: (batch, seqlen) int64 document of every token of the whole rows, increasing
            over the flattened rows (a row starts a document).
    Returns:
        world_size lists of RingBlock.
    """
    plan = []
    for step in range(world_size):
        source = (rank - step) % world_size
        if window_left < 0:
            plan.append(_whole_step(rank, source, world_size, causal, document_ids))
        else:
            plan.append(_window_step(rank, source, world_size, window_left, document_ids))
    return plan
