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

import torch
import torch.distributed as dist

from flashformer.attention import route_attention
from flashformer.config import ConfigError
from flashformer.kernels import flash_attn_func
from flashformer.kernels.checks import autocast_inputs

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


def _block_plan(step, ring, causal, local_seqlen):
    """Which queries attend which keys of the K/V block held at ``step``, and whether causally.

    Returns (query slice, key slice, block_causal); the fully masked quarters of a causal block
    are sliced away, never computed. The K/V held at ``step`` came from rank
    ``source = rank - step``. In the zigzag layout (chunks rank, 2W-1-rank against source,
    2W-1-source): the own block is causal as a whole; from an earlier source, every query sees
    that source's first chunk and nothing of its second; from a later source, only this rank's
    second chunk sees anything, and sees all of it. Every non-diagonal step thus costs the same
    (all queries x half the keys, or half the queries x all keys) on every rank.
    """
    everything = slice(0, local_seqlen)
    if not causal:
        return everything, everything, False
    source = (ring.rank - step) % ring.world_size
    half = local_seqlen // 2
    if source == ring.rank:
        return everything, everything, True
    if source < ring.rank:
        return everything, slice(0, half), False
    return slice(half, local_seqlen), everything, False


def _exp_shift(lse):
    """lse with -inf replaced by 0: rows that see no key keep weight exp(-inf - 0) = 0, not NaN."""
    return torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)


def _merge_block(out, lse, block_out, block_lse):
    """Fold one block's (out, lse) into the running (out, lse), in place, exactly.

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


def _ring_forward(q, k, v, ring, causal, softmax_scale):
    batch, local_seqlen, heads_q, _ = q.shape
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full((batch, heads_q, local_seqlen), -torch.inf, dtype=torch.float32, device=q.device)
    kv = torch.stack([k, v])  # one message per step instead of two
    for step in range(ring.world_size):
        last = step + 1 == ring.world_size
        if not last:
            next_kv, requests = ring.start_shift(kv, KV_TAG)
        q_rows, k_rows, block_causal = _block_plan(step, ring, causal, local_seqlen)
        block_out, block_lse = flash_attn_func(q[:, q_rows], kv[0][:, k_rows], kv[1][:, k_rows],
                                               causal=block_causal, softmax_scale=softmax_scale,
                                               return_lse=True)
        _merge_block(out[:, q_rows], lse[:, :, q_rows], block_out, block_lse)
        if not last:
            _finish(requests)
            kv = next_kv
    return out.to(q.dtype), lse


def _block_grads(q, k, v, grad_out, lse, grad_dot_out, causal, softmax_scale):
    """dq, dk, dv of one block, where the block's scores are normalized by the global softmax.

    The kernels' backward only knows the block's own (out, lse), so recompute them and feed
    the chain rule of the merge into flash_attn_func's autograd: with w = exp(lse_block - lse),
    out = sum_blocks w * out_block, hence d/d out_block = w * grad_out and
    d/d lse_block = w * (grad_out . out_block - grad_out . out). The kernel then forms exactly
    p_global * (grad_out . v - grad_out . out), the global-softmax gradient of these scores.

    Args:
        q: (batch, seqlen_q, heads_q, head_dim); k, v: (batch, seqlen_k, heads_kv, head_dim).
        grad_out: (batch, seqlen_q, heads_q, head_dim); lse: (batch, heads_q, seqlen_q) global,
            fp32; grad_dot_out: (batch, seqlen_q, heads_q) fp32, rowwise grad_out . out (global).
    """
    with torch.enable_grad():
        inputs = [t.detach().requires_grad_() for t in (q, k, v)]
        block_out, block_lse = flash_attn_func(*inputs, causal=causal, softmax_scale=softmax_scale,
                                               return_lse=True)
        share = torch.exp(block_lse.detach() - _exp_shift(lse))  # (batch, heads_q, seqlen_q)
        grad_block_out = grad_out.float() * share.transpose(1, 2).unsqueeze(-1)
        grad_dot_block_out = (grad_out.float() * block_out.detach().float()).sum(-1)
        grad_block_lse = share * (grad_dot_block_out - grad_dot_out).transpose(1, 2)
        return torch.autograd.grad((block_out, block_lse), inputs,
                                   (grad_block_out.to(block_out.dtype), grad_block_lse))


def _ring_backward(grad_out, q, k, v, out, lse, ring, causal, softmax_scale):
    local_seqlen = q.shape[1]
    grad_dot_out = (grad_out.float() * out.float()).sum(-1)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    kv = torch.stack([k, v])
    # dK/dV of the K/V block held now; it travels with the block and is home after a full turn.
    dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
    dkv_requests = []
    for step in range(ring.world_size):
        last = step + 1 == ring.world_size
        if not last:
            next_kv, kv_requests = ring.start_shift(kv, KV_TAG)
        q_rows, k_rows, block_causal = _block_plan(step, ring, causal, local_seqlen)
        block_dq, block_dk, block_dv = _block_grads(
            q[:, q_rows], kv[0][:, k_rows], kv[1][:, k_rows], grad_out[:, q_rows], lse[:, :, q_rows],
            grad_dot_out[:, q_rows], block_causal, softmax_scale)
        dq[:, q_rows] += block_dq
        _finish(dkv_requests)  # the dK/dV that belongs to this step's block has arrived
        dkv[0][:, k_rows] += block_dk
        dkv[1][:, k_rows] += block_dv
        if ring.world_size > 1:
            dkv, dkv_requests = ring.start_shift(dkv, GRAD_KV_TAG)
        if not last:
            _finish(kv_requests)
            kv = next_kv
    _finish(dkv_requests)
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class _RingFlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring, causal, softmax_scale):
        out, lse = _ring_forward(q, k, v, ring, causal, softmax_scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.params = (ring, causal, softmax_scale)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _ring_backward(grad_out, q, k, v, out, lse, *ctx.params)
        return dq, dk, dv, None, None, None


def ring_flash_attn(q, k, v, group=None, causal=True, softmax_scale=None):
    """Exact attention over a sequence split across the ranks of ``group``; differentiable.

    Every rank of ``group`` must call it with the same shapes. Equals flash_attn_func on the full
    sequence, restricted to this rank's queries.

    Args:
        q: (batch, local_seqlen, heads_q, head_dim); k, v: (batch, local_seqlen, heads_kv,
            head_dim), heads_q a multiple of heads_kv (GQA). For causal=True the tokens must be in
            the zigzag layout (``zigzag_shard``) and local_seqlen even; for causal=False any split.
        group: the context-parallel process group (default: the whole world).
        softmax_scale: defaults to head_dim ** -0.5.
    Returns:
        out (batch, local_seqlen, heads_q, head_dim), like q.
    """
    if not dist.is_initialized():
        raise RuntimeError("ring_flash_attn needs torch.distributed to be initialized")
    if q.dim() != 4 or k.shape != v.shape or q.shape[:2] != k.shape[:2]:
        raise ValueError(f"q, k, v must be (batch, local_seqlen, heads, head_dim) with one local_seqlen, "
                         f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if causal and q.shape[1] % 2:
        raise ValueError(f"causal ring attention needs the zigzag layout: local_seqlen {q.shape[1]} must be even")
    # The backward runs outside autocast: fix the dtype here so both passes compute alike.
    q, k, v = autocast_inputs(q, k, v)
    return _RingFlashAttention.apply(q, k, v, _Ring(group), causal, softmax_scale)


def shard_batch(input_ids, targets, group=None):
    """This rank's (input_ids, targets, position_ids): the zigzag slice of every (batch, seqlen) row,
    with each token's true position (RoPE and learned positions need it). seqlen must be divisible by
    2 * the group's size."""
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
    return tuple(zigzag_shard(t, rank, world_size) for t in (input_ids, targets, positions))


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
    ``shard_batch``. Plain causal or full attention only (no window, no softcap, no packed documents)."""
    def ring(q, k, v, causal, window_size, softcap, softmax_scale):
        if tuple(window_size) != (-1, -1) or softcap:
            raise ValueError(f"context parallelism supports plain causal or full attention, got "
                             f"window_size={tuple(window_size)}, softcap={softcap}")
        return ring_flash_attn(q, k, v, group=group, causal=causal, softmax_scale=softmax_scale)

    with route_attention(ring):
        yield
