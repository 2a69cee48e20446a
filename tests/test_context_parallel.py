"""Ring attention across real processes (gloo, CPU) against flash_attn_func on the full sequence."""

import json
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flashformer import context_parallel
from flashformer.attention import attention
from flashformer.batches import IGNORE_INDEX, Batch
from flashformer.context_parallel import (ring_flash_attn, shard_batch, zigzag_merge, zigzag_shard,
                                          zigzag_unshard)
from flashformer.kernels import (cu_seqlens_from_lengths, flash_attn_func, flash_attn_varlen_func,
                                force_kernel_impl, launch, position_ids_from_cu_seqlens)
from flashformer.model import ModelConfig, Transformer
from flashformer.parallel import shutdown_distributed
from flashformer.train.step import lm_loss, shard_micro_batch, step_divisor

ATOL = 2e-5


def contiguous_shard(x, rank, world_size):
    return x.chunk(world_size, dim=1)[rank]


def check_ring_matches_full(group, causal, batch, seqlen, heads_q, heads_kv, head_dim, tag):
    """Full-sequence attention on every rank, then this rank's slice through the ring."""
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    generator = torch.Generator().manual_seed(seqlen + heads_kv)  # identical on every rank
    q, k, v, grad_out = (torch.randn(batch, seqlen, heads, head_dim, generator=generator)
                         for heads in (heads_q, heads_kv, heads_kv, heads_q))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    out_full = flash_attn_func(*full, causal=causal)
    out_full.backward(grad_out)

    # Causal needs the zigzag layout; non-causal runs on a plain contiguous split.
    shard = zigzag_shard if causal else contiguous_shard
    local = [shard(t, rank, world_size).requires_grad_() for t in (q, k, v)]
    out_local = ring_flash_attn(*local, group=group, causal=causal)
    out_local.backward(shard(grad_out, rank, world_size))

    expected = [out_full, *(t.grad for t in full)]
    for name, ours, ref in zip(("out", "dq", "dk", "dv"), [out_local, *(t.grad for t in local)], expected):
        torch.testing.assert_close(ours, shard(ref.detach(), rank, world_size), atol=ATOL, rtol=0,
                                   msg=lambda m: f"{tag} rank {rank}/{world_size} {name}: {m}")
    if causal:
        torch.testing.assert_close(zigzag_unshard(out_local.detach(), group), out_full.detach(),
                                   atol=ATOL, rtol=0)


def packed_rows(seqlen):
    """cu_seqlens of two packed rows of seqlen tokens (chunks of seqlen / (2 * world_size)): a one-token
    document, documents across chunk and rank boundaries, and a row that is one document (both chunks of
    every rank, and the gap between them)."""
    rows = [[1, 12, 3, seqlen - 16], [seqlen]]
    return cu_seqlens_from_lengths([length for row in rows for length in row])


def check_packed_ring_matches_varlen(group, causal, seqlen, heads_q, heads_kv, head_dim, tag, packed=True,
                                     window_left=-1):
    """Ring attention over packed documents (or whole rows) equals flash_attn_varlen_func over the whole
    rows, with the same window: output and every gradient, each rank's zigzag slice."""
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    batch = 2
    cu_seqlens = packed_rows(seqlen) if packed else cu_seqlens_from_lengths([seqlen] * batch)
    generator = torch.Generator().manual_seed(seqlen + heads_q + window_left)
    q, k, v, grad_out = (torch.randn(batch, seqlen, heads, head_dim, generator=generator)
                         for heads in (heads_q, heads_kv, heads_kv, heads_q))
    full = [t.flatten(0, 1).clone().requires_grad_() for t in (q, k, v)]
    window_size = (window_left, -1)
    out_full = flash_attn_varlen_func(*full, cu_seqlens, cu_seqlens, causal=causal, window_size=window_size)
    out_full.backward(grad_out.flatten(0, 1))

    local = [zigzag_shard(t, rank, world_size).requires_grad_() for t in (q, k, v)]
    out_local = ring_flash_attn(*local, group=group, causal=causal, cu_seqlens=cu_seqlens if packed else None,
                                window_size=window_size)
    out_local.backward(zigzag_shard(grad_out, rank, world_size))
    expected = [out_full, *(t.grad for t in full)]
    for name, ours, ref in zip(("out", "dq", "dk", "dv"), [out_local, *(t.grad for t in local)], expected):
        ref = zigzag_shard(ref.detach().view(batch, seqlen, *ref.shape[1:]), rank, world_size)
        torch.testing.assert_close(ours, ref, atol=ATOL, rtol=0,
                                   msg=lambda m: f"{tag} rank {rank}/{world_size} {name}: {m}")


def check_causal_blocks_balanced_and_skipped(group, seqlen):
    """Record the blocks the forward computes: one causal diagonal block, then world - 1
    non-causal blocks of half the area each, on every rank alike (the fully masked ones skipped)."""
    blocks = []
    kernel = context_parallel.flash_attn_varlen_func

    def recording_kernel(q, k, v, *args, causal, **kwargs):
        blocks.append((q.shape[0], k.shape[0], causal))
        return kernel(q, k, v, *args, causal=causal, **kwargs)

    context_parallel.flash_attn_varlen_func = recording_kernel
    try:
        world_size = dist.get_world_size(group)
        local_seqlen = seqlen // world_size
        q = torch.randn(1, local_seqlen, 2, 16)
        with torch.no_grad():
            ring_flash_attn(q, q, q, group=group, causal=True)
    finally:
        context_parallel.flash_attn_varlen_func = kernel
    half_area = local_seqlen * local_seqlen // 2
    assert blocks[0] == (local_seqlen, local_seqlen, True)
    assert len(blocks) == world_size
    assert all(not causal and rows * cols == half_area for rows, cols, causal in blocks[1:]), blocks


def check_model_step_matches_full(group, pos, **model_fields):
    """A model's loss and gradients with each rank holding a zigzag slice of the sequence (ring
    attention, gradients averaged over the group) equal those of the whole sequence on one rank."""
    world_size = dist.get_world_size(group)
    torch.manual_seed(0)  # the same weights and tokens on every rank
    model = Transformer(ModelConfig(family="custom", vocab_size=64, d_model=64, n_layer=2, n_head=4, n_kv_head=2,
                                    d_ff=96, max_seq_len=64, pos=pos, **model_fields))
    input_ids = torch.randint(0, 64, (2, 8 * world_size))
    targets = torch.randint(0, 64, (2, 8 * world_size))
    params = list(model.parameters())
    full_loss = model(input_ids, targets=targets)
    full_grads = torch.autograd.grad(full_loss, params)

    ids, local_targets, positions = shard_batch(input_ids, targets, group)
    with context_parallel.context_parallel(group):
        loss = model(ids, position_ids=positions, targets=local_targets)
    grads = torch.autograd.grad(loss, params)  # the backward's ring runs outside the context too
    for value in (loss.detach(), *grads):
        dist.all_reduce(value, group=group)
        value /= world_size
    torch.testing.assert_close(loss, full_loss.detach(), atol=1e-5, rtol=0)
    for param_name, ours, ref in zip([n for n, _ in model.named_parameters()], grads, full_grads):
        torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-4, msg=lambda m: f"{pos} {param_name}: {m}")


def check_sharded_batch_loss_counts_the_whole_rows_targets(group, packed, **model_fields):
    """shard_micro_batch where the slices hold different numbers of targets (rank 0's first chunk ignored
    whole): divided by step_divisor, the ranks' losses and gradients average to the whole rows' mean over
    their targets; with packed documents, to the one process's varlen model (positions restarting per
    document)."""
    world_size = dist.get_world_size(group)
    torch.manual_seed(0)
    model = Transformer(ModelConfig(family="custom", vocab_size=64, d_model=32, n_layer=2, n_head=2, d_ff=64,
                                    max_seq_len=64, **model_fields))
    seqlen = 16 * world_size
    input_ids = torch.randint(0, 64, (2, seqlen))
    targets = torch.randint(0, 64, (2, seqlen))
    targets[:, :4] = IGNORE_INDEX
    targets[1, 5] = IGNORE_INDEX
    whole = Batch(input_ids, targets)
    if packed:
        whole.cu_seqlens = packed_rows(seqlen)
        whole.position_ids = position_ids_from_cu_seqlens(whole.cu_seqlens).view(2, seqlen)
    params = list(model.parameters())
    full_loss = lm_loss(model, whole)
    full_grads = torch.autograd.grad(full_loss, params)

    local = shard_micro_batch(whole, group)

    def mean_over_ranks(count):
        dist.all_reduce(count, group=group)
        return count / world_size

    with context_parallel.context_parallel(group):
        loss = lm_loss(model, local, divisor=step_divisor([local], mean_over_ranks))
    grads = torch.autograd.grad(loss, params)
    for value in (loss.detach(), *grads):
        dist.all_reduce(value, group=group)
        value /= world_size
    torch.testing.assert_close(loss, full_loss.detach(), atol=1e-5, rtol=0)
    for ours, ref in zip(grads, full_grads):
        torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-4)


def check_context_parallel_rejects_what_the_ring_cannot_do(group):
    q = torch.randn(1, 8, 2, 16)
    with context_parallel.context_parallel(group):
        with pytest.raises(ValueError, match=r"causal sliding windows .* got causal=False, window_size=\(4, 4\)"):
            attention(q, q, q, backend="flash", causal=False, window_size=(4, 4))
        with pytest.raises(ValueError, match="softcap=30.0"):
            attention(q, q, q, backend="flash", softcap=30.0)
        # cu_seqlens bounds the whole rows' tokens, world_size times this rank's.
        with pytest.raises(ValueError, match="cu_seqlens must start at 0 and end at the token count"):
            attention(q, q, q, backend="flash", cu_seqlens=torch.tensor([0, 8], dtype=torch.int32))


def join(rank, world_size, store_path):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size)
    return dist.group.WORLD


def run_on_triton_kernels(rank, world_size, store_path, window_left):
    """The Triton kernels (in the interpreter), outputs NaN-poisoned: their backward takes the merged
    (out, lse), their empty segments must leave nothing unwritten, and a window's offsets are theirs too."""
    world = join(rank, world_size, store_path)
    launch.POISON_OUTPUTS = True
    try:
        with force_kernel_impl("triton"):
            check_packed_ring_matches_varlen(world, True, 24, 2, 1, 16, f"packed causal MQA, window {window_left}, "
                                             f"Triton", window_left=window_left)
    finally:
        shutdown_distributed()


def run_rank(rank, world_size, store_path):
    world = join(rank, world_size, store_path)
    try:
        seqlen = 16 * world_size
        check_ring_matches_full(world, True, 2, seqlen, 4, 4, 16, "causal MHA")
        check_ring_matches_full(world, True, 1, 2 * seqlen, 4, 2, 32, "causal GQA")
        check_ring_matches_full(world, False, 2, seqlen, 4, 1, 16, "non-causal MQA")
        check_causal_blocks_balanced_and_skipped(world, seqlen)
        check_model_step_matches_full(world, "rope")
        check_model_step_matches_full(world, "learned")
        check_model_step_matches_full(world, "rope", sliding_window=6, layer_types=["sliding", "full"])
        check_packed_ring_matches_varlen(world, True, seqlen, 4, 2, 16, "packed causal GQA")
        check_packed_ring_matches_varlen(world, False, seqlen, 2, 2, 8, "packed non-causal, head_dim 8")
        # Windows within a chunk, into the chunk before, and across a whole chunk into the next.
        for window_left in (3, 11, 20):
            check_packed_ring_matches_varlen(world, True, seqlen, 2, 1, 16, f"packed, window {window_left}",
                                             window_left=window_left)
            check_packed_ring_matches_varlen(world, True, seqlen, 2, 1, 16, f"rows, window {window_left}",
                                             packed=False, window_left=window_left)
        check_sharded_batch_loss_counts_the_whole_rows_targets(world, packed=False)
        check_sharded_batch_loss_counts_the_whole_rows_targets(world, packed=True)
        check_sharded_batch_loss_counts_the_whole_rows_targets(world, packed=True, sliding_window=10,
                                                               layer_types=["sliding", "full"])
        check_context_parallel_rejects_what_the_ring_cannot_do(world)
        if world_size == 4:
            # Two independent rings of two ranks each: peers are named through the group.
            pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
            check_ring_matches_full(pairs[rank // 2], True, 1, 32, 4, 2, 16, "causal GQA, subgroup")
    finally:
        shutdown_distributed()


# Four processes (two rings of two ranks) on a 2-core CI machine cost what all the rest of the file does.
@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_ring_attention_matches_full_sequence(world_size, tmp_path):
    mp.spawn(run_rank, args=(world_size, str(tmp_path / "store")), nprocs=world_size, join=True)


# The windowed case (more calls per ring step) doubles the interpreter's minute or so on a busy 2-core machine.
@pytest.mark.parametrize("window_left", [-1, pytest.param(9, marks=pytest.mark.slow)])
def test_packed_ring_attention_on_the_triton_kernels(window_left, tmp_path, monkeypatch):
    # gloo rings CPU tensors, so the kernels run in the interpreter on a GPU machine too (NCCL's ring on
    # the GPU kernels is scripts/multi_gpu_check.sh's); spawned processes read the variable at their start.
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    mp.spawn(run_on_triton_kernels, args=(2, str(tmp_path / "store"), window_left), nprocs=2, join=True)


def test_zigzag_layout_round_trip():
    x = torch.arange(2 * 24 * 3).view(2, 24, 3)
    shards = [zigzag_shard(x, rank, 3) for rank in range(3)]
    # Rank 0 holds the first and the last of 6 chunks of 4 tokens.
    assert shards[0][0, :, 0].tolist() == [0, 3, 6, 9, 60, 63, 66, 69]
    assert torch.equal(zigzag_merge(shards), x)
    with pytest.raises(ValueError, match="divisible"):
        zigzag_shard(x, 0, 5)


def test_ring_needs_an_initialized_group():
    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(RuntimeError, match="initialized"):
        ring_flash_attn(q, q, q)


def test_context_parallel_step_script(tmp_path):
    """scripts/context_parallel_step.py under torchrun (2 gloo processes): its --check is exact against the
    whole sequence, and its timed steps train (the loss falls)."""
    from test_distributed import launch

    def torchrun(*args):
        launch([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
                "scripts/context_parallel_step.py", "configs/models/tiny-llama.yaml", "--device", "cpu", *args], True)

    torchrun("--seqlen", "64", "--check", "--out", str(tmp_path / "check.json"))
    check = json.loads((tmp_path / "check.json").read_text())
    assert check["loss_abs_diff"] < 1e-5 and check["max_grad_rel_diff"] < 1e-4, check
    torchrun("--seqlen", "128", "--steps", "4", "--set", "d_model=32", "head_dim=16", "n_head=2", "n_kv_head=1",
             "--out", str(tmp_path / "steps.json"))
    steps = json.loads((tmp_path / "steps.json").read_text())
    assert steps["ranks"] == 2 and steps["losses"][-1] < steps["losses"][0], steps
