"""Context parallelism: ring attention over torch.distributed for sequences one GPU cannot hold.

Each rank of a process group holds a slice of every sequence: queries, keys and values of its
own tokens. ``ring_flash_attn`` passes the K/V slices around the ring with P2P sends; at each
step a rank attends its queries to the K/V block it holds, and merges the partial (out, lse)
pairs exactly through log-sum-exp. The backward walks the same ring, and the dK/dV of each block
travel with it until they are home.

Layout. Non-causal attention works with any split of the tokens. Causal attention needs the
"zigzag" layout: the sequence is cut into 2 * world chunks and rank r holds chunks r and
2 * world - 1 - r, so every rank does the same work (rank 0 holds the first and the last chunk).
``zigzag_shard`` / ``zigzag_unshard`` move tensors into and out of it; shard the position ids
the same way so RoPE sees each token's true position.

The model stays single-device: ``context_parallel(group)`` routes its attention through the ring
from outside (attention.route_attention), and ``shard_batch`` gives each rank its zigzag slice of the
tokens, targets and positions. Wrapping the model in DDP over the same group then averages the
gradients, which equals the full sequence's gradient (every rank holds as many tokens)::

    ids, targets, positions = shard_batch(input_ids, targets, group)
    with context_parallel(group):
        loss = model(ids, position_ids=positions, targets=targets)
        loss.backward()

The trainer (``parallel.context_parallel``) shards whole batches with train.step's ``shard_micro_batch``,
whose loss is exact also where the slices hold different numbers of targets, and averages gradients over
data- and context-parallel ranks at once.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch
import torch.distributed as dist

from flashformer.attention import route_attention
from flashformer.config import ConfigError
from flashformer.kernels import (cu_seqlens_from_lengths, document_ids_from_cu_seqlens, flash_attn_varlen_backward,
                                flash_attn_varlen_func)
from flashformer.kernels.checks import autocast_inputs, check_cu_seqlens

KV_TAG, GRAD_KV_TAG = 0, 1


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


def zigzag_unshard(local, group=None, dim=1):
    """All-gather every rank's zigzag slice and return the full sequence on every rank.

    Not differentiable (plain all_gather): meant for outputs, metrics and tests.

    Args:
        local: (batch, local_seqlen, ...) this rank's slice.
    Returns:
        (batch, world_size * local_seqlen, ...).
    """
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, local.contiguous(), group=group)
    return zigzag_merge(gathered, dim)


class _Ring:
    """This rank's neighbours in ``group`` and the P2P shift of a buffer to the next rank."""

    def __init__(self, group):
        self.group = dist.group.WORLD if group is None else group
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        # P2P ops name peers by global rank, whatever group they run in.
        self.next_peer = dist.get_global_rank(self.group, (self.rank + 1) % self.world_size)
        self.prev_peer = dist.get_global_rank(self.group, (self.rank - 1) % self.world_size)

    def start_shift(self, tensor, tag):
        """Send ``tensor`` to the next rank and receive the previous rank's; returns
        (receive buffer, requests) so the caller computes while the transfer runs. ``tag`` keeps
        two shifts in flight at once (K/V and their gradients) apart on backends that match by it.
        """
        received = torch.empty_like(tensor)
        requests = dist.batch_isend_irecv([
            dist.P2POp(dist.isend, tensor, self.next_peer, self.group, tag),
            dist.P2POp(dist.irecv, received, self.prev_peer, self.group, tag),
        ])
        return received, requests


def _finish(requests):
    for request in requests:
        request.wait()


class _Block(NamedTuple):
    """What one ring step computes: this rank's queries ``q_rows`` against ``k_rows`` of the K/V block it
    holds, as one varlen call pairing the documents the two share (cu_seqlens_q / _k, their longest)."""

    q_rows: slice
    k_rows: slice
    causal: bool
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int


def _block_rows(source, ring, causal, local_seqlen):
    """Which queries attend which keys of the K/V block from rank ``source``, and whether causally.

    Returns (query slice, key slice, block_causal); the fully masked quarters of a causal block
    are sliced away, never computed. In the zigzag layout (chunks rank, 2W-1-rank against source,
    2W-1-source): the own block is causal as a whole; from an earlier source, every query sees
    that source's first chunk and nothing of its second; from a later source, only this rank's
    second chunk sees anything, and sees all of it. Every non-diagonal step thus costs the same
    (all queries x half the keys, or half the queries x all keys) on every rank.
    """
    everything = slice(0, local_seqlen)
    if not causal:
        return everything, everything, False
    half = local_seqlen // 2
    if source == ring.rank:
        return everything, everything, True
    if source < ring.rank:
        return everything, slice(0, half), False
    return slice(half, local_seqlen), everything, False


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


def _ring_plan(ring, causal, document_ids):
    """The _Block of every ring step on this rank.

    Within a zigzag slice a document's tokens are contiguous and in sequence order (a document in
    both chunks ends the first and starts the second), so causal attention within documents is, per
    step, the block's causal flag applied inside each document's segment.

    Args:
        document_ids: (batch, seqlen) int64 document of every token of the whole rows, increasing
            over the flattened rows (a row starts a document).
    """
    local_seqlen = document_ids.shape[1] // ring.world_size
    own = zigzag_shard(document_ids, ring.rank, ring.world_size)
    plan = []
    for step in range(ring.world_size):
        source = (ring.rank - step) % ring.world_size
        q_rows, k_rows, block_causal = _block_rows(source, ring, causal, local_seqlen)
        held = zigzag_shard(document_ids, source, ring.world_size)
        plan.append(_Block(q_rows, k_rows, block_causal,
                           *_pair_documents(own[:, q_rows].flatten(), held[:, k_rows].flatten())))
    return plan


def _tokens(x, rows):
    """(batch, seqlen, heads, head_dim) -> the varlen (batch * rows, heads, head_dim) of ``rows``."""
    return x[:, rows].flatten(0, 1)


def _exp_shift(lse):
    """lse with -inf replaced by 0: rows that see no key keep weight exp(-inf - 0) = 0, not NaN."""
    return torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)


def _merge_block(out, lse, block_out, block_lse):
    """Fold one block's (out, lse) into the running (out, lse), in place, exactly, in fp32.

    Args:
        out: (batch, seqlen, heads, head_dim) fp32; lse: (batch, heads, seqlen) fp32, -inf where
            no key was seen yet. block_out, block_lse: the same for the block's keys.
    """
    merged_lse = torch.logaddexp(lse, block_lse)
    shift = _exp_shift(merged_lse)
    old_weight = torch.exp(lse - shift).transpose(1, 2).unsqueeze(-1)
    block_weight = torch.exp(block_lse - shift).transpose(1, 2).unsqueeze(-1)
    out.mul_(old_weight).add_(block_out.float() * block_weight)
    lse.copy_(merged_lse)


def _ring_forward(q, k, v, ring, plan, softmax_scale):
    batch, local_seqlen, heads_q, _ = q.shape
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full((batch, heads_q, local_seqlen), -torch.inf, dtype=torch.float32, device=q.device)
    kv = torch.stack([k, v])  # one message per step instead of two
    for step, block in enumerate(plan):
        last = step + 1 == ring.world_size
        if not last:
            next_kv, requests = ring.start_shift(kv, KV_TAG)
        rows = block.q_rows
        block_out, block_lse = flash_attn_varlen_func(
            _tokens(q, rows), _tokens(kv[0], block.k_rows), _tokens(kv[1], block.k_rows), block.cu_seqlens_q,
            block.cu_seqlens_k, block.max_seqlen_q, block.max_seqlen_k, causal=block.causal,
            softmax_scale=softmax_scale, return_lse=True)
        queries = out[:, rows].shape[1]
        _merge_block(out[:, rows], lse[:, :, rows], block_out.view(batch, queries, *block_out.shape[1:]),
                     block_lse.view(heads_q, batch, queries).transpose(0, 1))
        if not last:
            _finish(requests)
            kv = next_kv
    return out.to(q.dtype), lse


def _ring_backward(grad_out, q, k, v, out, lse, ring, plan, softmax_scale):
    """The kernels' backward per block, fed the merged (out, lse): each block's probabilities are then
    the global softmax's and its delta (grad_out . out) the global one, so no block forward reruns."""
    batch, _, heads_q, _ = q.shape
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    kv = torch.stack([k, v])
    # dK/dV of the K/V block held now; it travels with the block and is home after a full turn.
    dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
    dkv_requests = []
    for step, block in enumerate(plan):
        last = step + 1 == ring.world_size
        if not last:
            next_kv, kv_requests = ring.start_shift(kv, KV_TAG)
        rows, k_rows = block.q_rows, block.k_rows
        block_lse = lse[:, :, rows].transpose(0, 1).flatten(1)
        block_dq, block_dk, block_dv = flash_attn_varlen_backward(
            _tokens(grad_out, rows), _tokens(q, rows), _tokens(kv[0], k_rows), _tokens(kv[1], k_rows),
            _tokens(out, rows), block_lse, block.cu_seqlens_q, block.cu_seqlens_k, block.max_seqlen_q,
            block.max_seqlen_k, softmax_scale=softmax_scale, causal=block.causal)
        dq[:, rows] += block_dq.view(batch, -1, *block_dq.shape[1:])
        _finish(dkv_requests)  # the dK/dV that belongs to this step's block has arrived
        dkv[0][:, k_rows] += block_dk.view(batch, -1, *block_dk.shape[1:])
        dkv[1][:, k_rows] += block_dv.view(batch, -1, *block_dv.shape[1:])
        if ring.world_size > 1:
            dkv, dkv_requests = ring.start_shift(dkv, GRAD_KV_TAG)
        if not last:
            _finish(kv_requests)
            kv = next_kv
    _finish(dkv_requests)
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class _RingFlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring, plan, softmax_scale):
        out, lse = _ring_forward(q, k, v, ring, plan, softmax_scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.params = (ring, plan, softmax_scale)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _ring_backward(grad_out, q, k, v, out, lse, *ctx.params)
        return dq, dk, dv, None, None, None


def _document_ids(cu_seqlens, batch, seqlen, device):
    """(batch, seqlen) int64 document of every token of the whole rows; every row one document without
    cu_seqlens (int32 boundaries over the batch * seqlen flattened tokens)."""
    if cu_seqlens is None:
        return torch.arange(batch, device=device)[:, None].expand(batch, seqlen)
    check_cu_seqlens("cu_seqlens", cu_seqlens, batch * seqlen, device)
    return document_ids_from_cu_seqlens(cu_seqlens).view(batch, seqlen)


# The last call's plan: every layer of a model rings over the same rows (activation checkpointing reruns
# them), and a plan reads the offsets on the host. (group, cu_seqlens, key, plan) or None.
_last_plan = None


def _cached_plan(ring, causal, cu_seqlens, batch, local_seqlen, device):
    global _last_plan
    if cu_seqlens is not None and cu_seqlens.is_inference():  # no version counter: in-place edits go unseen
        return _ring_plan(ring, causal, _document_ids(cu_seqlens, batch, local_seqlen * ring.world_size, device))
    key = (ring.world_size, ring.rank, causal, batch, local_seqlen, device,
           None if cu_seqlens is None else cu_seqlens._version)
    if _last_plan is not None and _last_plan[0] is ring.group and _last_plan[1] is cu_seqlens and _last_plan[2] == key:
        return _last_plan[3]
    plan = _ring_plan(ring, causal, _document_ids(cu_seqlens, batch, local_seqlen * ring.world_size, device))
    _last_plan = (ring.group, cu_seqlens, key, plan)
    return plan


def ring_flash_attn(q, k, v, group=None, causal=True, softmax_scale=None, cu_seqlens=None):
    """Exact attention over a sequence split across the ranks of ``group``; differentiable.

    Every rank of ``group`` must call it with the same shapes. Equals flash_attn_func on the full
    sequence (flash_attn_varlen_func over its documents), restricted to this rank's queries.

    Args:
        q: (batch, local_seqlen, heads_q, head_dim); k, v: (batch, local_seqlen, heads_kv,
            head_dim), heads_q a multiple of heads_kv (GQA). For causal=True or packed documents the
            tokens must be in the zigzag layout (``zigzag_shard``) and local_seqlen even; else any split.
        group: the context-parallel process group (default: the whole world).
        softmax_scale: defaults to head_dim ** -0.5.
        cu_seqlens: int32 (num_docs + 1,) boundaries of the documents packed in the whole rows, over
            their batch * world_size * local_seqlen flattened tokens (the same on every rank); no token
            attends across one. None: every row is one sequence.
    Returns:
        out (batch, local_seqlen, heads_q, head_dim), like q.
    """
    if not dist.is_initialized():
        raise RuntimeError("ring_flash_attn needs torch.distributed to be initialized")
    if q.dim() != 4 or k.shape != v.shape or q.shape[:2] != k.shape[:2]:
        raise ValueError(f"q, k, v must be (batch, local_seqlen, heads, head_dim) with one local_seqlen, "
                         f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if (causal or cu_seqlens is not None) and q.shape[1] % 2:
        raise ValueError(f"causal or packed ring attention needs the zigzag layout: local_seqlen {q.shape[1]} "
                         f"must be even")
    ring = _Ring(group)
    plan = _cached_plan(ring, causal, cu_seqlens, q.shape[0], q.shape[1], q.device)
    # The backward runs outside autocast: fix the dtype here so both passes compute alike.
    q, k, v = autocast_inputs(q, k, v)
    return _RingFlashAttention.apply(q, k, v, ring, plan, softmax_scale)


def shard_batch(input_ids, targets, group=None, position_ids=None):
    """This rank's (input_ids, targets, position_ids): the zigzag slice of every (batch, seqlen) row,
    with each token's true position (RoPE and learned positions need it): ``position_ids`` where given
    (packed documents restart them), else 0 .. seqlen - 1. seqlen must be divisible by 2 * the group's
    size."""
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    if position_ids is None:
        position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
    return tuple(zigzag_shard(t, rank, world_size) for t in (input_ids, targets, position_ids))


def check_ring_supports(config) -> None:
    """Refuse a model whose attention the ring cannot compute (sliding windows, score softcaps).

    Args:
        config: the model's ModelConfig.
    Raises:
        ConfigError: naming the model key.
    """
    if "sliding" in config.layer_kinds():
        raise ConfigError(f"parallel.context_parallel > 1 rings plain causal attention: this model has sliding-"
                          f"window layers (model.sliding_window={config.sliding_window}, model.layer_types); "
                          f"train it with parallel.context_parallel=1")
    if config.attn_softcap:
        raise ConfigError(f"parallel.context_parallel > 1 rings plain causal attention: model.attn_softcap="
                          f"{config.attn_softcap} is not supported; train it with parallel.context_parallel=1")


@contextlib.contextmanager
def context_parallel(group=None):
    """Inside, a model's full-sequence attention is ring attention over ``group``: feed it this rank's
    ``shard_batch``, and as cu_seqlens the whole rows' document boundaries (the same on every rank).
    Plain causal or full attention only (no window, no softcap)."""
    def ring(q, k, v, causal, window_size, softcap, softmax_scale, cu_seqlens):
        if tuple(window_size) != (-1, -1) or softcap:
            raise ValueError(f"context parallelism supports plain causal or full attention, got "
                             f"window_size={tuple(window_size)}, softcap={softcap}")
        return ring_flash_attn(q, k, v, group=group, causal=causal, softmax_scale=softmax_scale,
                               cu_seqlens=cu_seqlens)

    with route_attention(ring):
        yield
