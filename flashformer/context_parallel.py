"""Context parallelism: ring attention over torch.distributed for sequences one GPU cannot hold.

Each rank of a process group holds a slice of every sequence: queries, keys and values of its
own tokens. ``ring_flash_attn`` passes the K/V slices around the ring with P2P sends; at each
step a rank attends its queries to the K/V block it holds (the varlen kernels, on the calls
zigzag.ring_plan lists: packed documents and sliding windows included), and merges the partial
(out, lse) pairs exactly, in fp32, through log-sum-exp. The backward walks the same ring: the
kernels' backward takes the merged (out, lse), which makes each block's gradient its exact share
of the whole softmax's, and the dK/dV of each block travel with it until they are home.

Layout. Non-causal attention of whole rows works with any split of the tokens. Causal attention
and packed documents need the "zigzag" layout (zigzag.py): the sequence is cut into 2 * world
chunks and rank r holds chunks r and 2 * world - 1 - r, so every rank does the same work.
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

import torch
import torch.distributed as dist

from flashformer.attention import route_attention
from flashformer.config import ConfigError
from flashformer.kernels import document_ids_from_cu_seqlens, flash_attn_varlen_backward, flash_attn_varlen_func
from flashformer.kernels.checks import autocast_inputs, check_cu_seqlens
from flashformer.zigzag import ring_plan, zigzag_merge, zigzag_shard

KV_TAG, GRAD_KV_TAG = 0, 1


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


def _tokens(x, block, rows):
    """(batch, seqlen, heads, head_dim) -> the varlen (tokens, heads, head_dim) of ``block.batch_rows`` x ``rows``."""
    return x[block.batch_rows, rows].flatten(0, 1)


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
    for step, blocks in enumerate(plan):
        last = step + 1 == ring.world_size
        if not last:
            next_kv, requests = ring.start_shift(kv, KV_TAG)
        for block in blocks:
            rows, batch_rows = block.q_rows, block.batch_rows
            block_out, block_lse = flash_attn_varlen_func(
                _tokens(q, block, rows), _tokens(kv[0], block, block.k_rows), _tokens(kv[1], block, block.k_rows),
                block.cu_seqlens_q, block.cu_seqlens_k, block.max_seqlen_q, block.max_seqlen_k,
                causal=block.causal, window_size=block.window_size, softmax_scale=softmax_scale, return_lse=True)
            running_out = out[batch_rows, rows]
            rows_in_block, queries = running_out.shape[:2]
            _merge_block(running_out, lse[batch_rows, :, rows], block_out.view(running_out.shape),
                         block_lse.view(heads_q, rows_in_block, queries).transpose(0, 1))
        if not last:
            _finish(requests)
            kv = next_kv
    return out.to(q.dtype), lse


def _ring_backward(grad_out, q, k, v, out, lse, ring, plan, softmax_scale):
    """The kernels' backward per block, fed the merged (out, lse): each block's probabilities are then
    the global softmax's and its delta (grad_out . out) the global one, so no block forward reruns."""
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    kv = torch.stack([k, v])
    # dK/dV of the K/V block held now; it travels with the block and is home after a full turn.
    dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
    dkv_requests = []
    for step, blocks in enumerate(plan):
        last = step + 1 == ring.world_size
        if not last:
            next_kv, kv_requests = ring.start_shift(kv, KV_TAG)
        grads = []
        for block in blocks:
            rows, k_rows = block.q_rows, block.k_rows
            block_lse = lse[block.batch_rows, :, rows].transpose(0, 1).flatten(1)
            grads.append(flash_attn_varlen_backward(
                _tokens(grad_out, block, rows), _tokens(q, block, rows), _tokens(kv[0], block, k_rows),
                _tokens(kv[1], block, k_rows), _tokens(out, block, rows), block_lse, block.cu_seqlens_q,
                block.cu_seqlens_k, block.max_seqlen_q, block.max_seqlen_k, softmax_scale=softmax_scale,
                causal=block.causal, window_size=block.window_size))
        _finish(dkv_requests)  # the dK/dV that belongs to this step's block has arrived
        for block, (block_dq, block_dk, block_dv) in zip(blocks, grads):
            rows, k_rows, batch_rows = block.q_rows, block.k_rows, block.batch_rows
            dq[batch_rows, rows] += block_dq.view(dq[batch_rows, rows].shape)
            dkv[0][batch_rows, k_rows] += block_dk.view(dkv[0][batch_rows, k_rows].shape)
            dkv[1][batch_rows, k_rows] += block_dv.view(dkv[1][batch_rows, k_rows].shape)
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


# The plans of the last rows rung over: every layer of a model rings over the same rows (activation
# checkpointing reruns them), and a plan reads the offsets on the host. (group, cu_seqlens, rows key,
# {(causal, window_left): plan}) or None.
_plans = None


def _cached_plan(ring, causal, window_left, cu_seqlens, batch, local_seqlen, device):
    global _plans

    def plan():
        document_ids = _document_ids(cu_seqlens, batch, local_seqlen * ring.world_size, device)
        return ring_plan(ring.rank, ring.world_size, causal, window_left, document_ids)

    if cu_seqlens is not None and cu_seqlens.is_inference():  # no version counter: in-place edits go unseen
        return plan()
    version = None if cu_seqlens is None else cu_seqlens._version
    rows = (ring.world_size, ring.rank, batch, local_seqlen, device, version)
    if _plans is None or _plans[0] is not ring.group or _plans[1] is not cu_seqlens or _plans[2] != rows:
        _plans = (ring.group, cu_seqlens, rows, {})
    plans = _plans[3]
    if (causal, window_left) not in plans:
        plans[causal, window_left] = plan()
    return plans[causal, window_left]


def ring_flash_attn(q, k, v, group=None, causal=True, softmax_scale=None, cu_seqlens=None, window_size=(-1, -1)):
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
        window_size: (left, right) sliding window as flash_attn_func's; only causal ones (right is then
            folded to 0): a query sees itself and ``left`` keys before it.
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
    window_left, window_right = (int(w) for w in window_size)
    if (window_left, window_right) != (-1, -1) and (not causal or window_left < 0):
        raise ValueError(f"ring attention takes causal sliding windows (causal=True, window_size=(left >= 0, any)), "
                         f"got causal={causal}, window_size={tuple(window_size)}")
    ring = _Ring(group)
    plan = _cached_plan(ring, causal, window_left, cu_seqlens, q.shape[0], q.shape[1], q.device)
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
    """Refuse a model whose attention the ring cannot compute (score softcaps).

    Args:
        config: the model's ModelConfig.
    Raises:
        ConfigError: naming the model key.
    """
    if config.attn_softcap:
        raise ConfigError(f"parallel.context_parallel > 1 rings causal attention without softcap: model.attn_softcap="
                          f"{config.attn_softcap} is not supported; train it with parallel.context_parallel=1")


@contextlib.contextmanager
def context_parallel(group=None):
    """Inside, a model's full-sequence attention is ring attention over ``group``: feed it this rank's
    ``shard_batch``, and as cu_seqlens the whole rows' document boundaries (the same on every rank).
    Causal attention, sliding windows included, or full attention; no softcap."""
    def ring(q, k, v, causal, window_size, softcap, softmax_scale, cu_seqlens):
        if softcap:
            raise ValueError(f"context parallelism does not support softcap, got softcap={softcap}")
        return ring_flash_attn(q, k, v, group=group, causal=causal, softmax_scale=softmax_scale,
                               cu_seqlens=cu_seqlens, window_size=window_size)

    with route_attention(ring):
        yield
