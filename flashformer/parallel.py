"""Everything multi-process, applied to a single-device model from outside (torchtitan style).

    env = init_distributed(cfg.parallel, device)            # reads torchrun's RANK / WORLD_SIZE
    model = parallelize(model, cfg.parallel, env, activation_checkpointing="offload", compile=False)
    with gradient_sync(model, enabled=is_last_micro_batch): loss.backward()

Only two things of the model are assumed: ``model.blocks`` (an nn.ModuleList of the layers that
activation checkpointing, compilation and FSDP wrap one by one) and the root module.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
import sys
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.graph import save_on_cpu
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint

from .config import ConfigError


@dataclass
class ParallelConfig:
    """``mode``: ``ddp`` replicates the model (a single process simply runs it unwrapped), ``fsdp``
    shards parameters, gradients and optimizer state per block (FSDP2), ``none`` refuses to run
    under more than one process. ``backend``: ``auto`` is nccl on CUDA, gloo on CPU.
    ``context_parallel``: ranks per sequence; each holds a zigzag slice of every row and attention rings
    over them (flashformer.context_parallel); the world is (world / context_parallel) data-parallel x
    context_parallel, DDP or FSDP over all of it."""

    mode: Literal["none", "ddp", "fsdp"] = "ddp"
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    timeout_minutes: int = 30
    context_parallel: int = 1

    def validate(self) -> None:
        if self.timeout_minutes < 1:
            raise ConfigError(f"parallel.timeout_minutes must be >= 1, got {self.timeout_minutes}")
        if self.context_parallel < 1:
            raise ConfigError(f"parallel.context_parallel must be >= 1, got {self.context_parallel}")


@dataclass
class DistributedEnv:
    """This process's place in the job; world_size 1 without torchrun. Under context parallelism the
    ``context_parallel`` consecutive ranks of ``cp_group`` share each sequence, and data parallelism
    (the batch's rows) runs over ``dp_size`` such groups."""

    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    context_parallel: int = 1
    cp_group: dist.ProcessGroup | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def dp_rank(self) -> int:
        return self.rank // self.context_parallel

    @property
    def dp_size(self) -> int:
        return self.world_size // self.context_parallel


def init_distributed(cfg: ParallelConfig, device: torch.device) -> DistributedEnv:
    """Join the process group torchrun describes in the environment (nothing to do without it).

    Args:
        cfg: the parallel section of the training config.
        device: the device type to train on; on CUDA each process takes GPU ``LOCAL_RANK``.
    Raises:
        ConfigError: several processes with ``mode: none``; ``context_parallel`` > 1 without torchrun or
            not dividing its number of processes.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    if cfg.context_parallel > 1 and (world_size == 1 or world_size % cfg.context_parallel):
        raise ConfigError(f"parallel.context_parallel={cfg.context_parallel} needs torchrun with a multiple of "
                          f"{cfg.context_parallel} processes, got {world_size} (e.g. torchrun --nproc_per_node "
                          f"{cfg.context_parallel} -m flashformer.cli train ...)")
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    env = DistributedEnv(rank, local_rank, world_size, device, cfg.context_parallel)
    if not env.distributed:
        return env
    if cfg.mode == "none":
        raise ConfigError(f"parallel.mode=none cannot run {world_size} processes; use ddp or fsdp")
    backend = cfg.backend if cfg.backend != "auto" else ("nccl" if device.type == "cuda" else "gloo")
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(minutes=cfg.timeout_minutes))
    if cfg.context_parallel > 1:
        from torch.distributed.device_mesh import init_device_mesh

        # cp innermost: a sequence's ranks are neighbours (one node, the fastest links for the ring's P2P).
        mesh = init_device_mesh(device.type, (env.dp_size, cfg.context_parallel), mesh_dim_names=("dp", "cp"))
        env.cp_group = mesh.get_group("cp")
    return env


def shutdown_distributed() -> None:
    """Leave the process group, if one was joined.

    Garbage in reference cycles (activation-checkpointed blocks, the ring's saved state) can still hold the
    group and tensors its gloo threads keep; collected only in the interpreter's teardown, their release
    there aborts the process ("terminate called without an active exception"), so collect it first.
    """
    if dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


def barrier(env: DistributedEnv) -> None:
    """Wait for all ranks (no-op on one process)."""
    if env.distributed:
        dist.barrier()


def all_reduce(values: torch.Tensor, env: DistributedEnv, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """``values`` reduced over all ranks with ``op`` (a copy; the input is untouched)."""
    values = values.detach().clone()
    if env.distributed:
        dist.all_reduce(values, op=op)
    return values


def broadcast_from_main(value, env: DistributedEnv):
    """Rank 0's ``value`` (any picklable object) on every rank (all ranks call this; ``value`` itself alone)."""
    if not env.distributed:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def raise_on_every_rank(error: Exception | None, elsewhere: Exception, env: DistributedEnv) -> None:
    """Raise ``error`` on the rank where it happened and ``elsewhere`` on every other one (all ranks call
    this): one rank's failure must end them all, the others would wait for it in the next collective."""
    if env.distributed:
        failed = all_reduce(torch.tensor(float(error is not None), device=env.device), env, op=dist.ReduceOp.MAX)
        if failed.item() and error is None:
            raise elsewhere
    if error is not None:
        raise error


ACTIVATION_CHECKPOINTING = (False, True, "offload")


def apply_activation_checkpointing(model: nn.Module, offload: bool = False) -> None:
    """Recompute each block's activations in backward instead of storing them.

    Only each block's inputs (the residual stream) stay between forward and backward; with ``offload``
    they wait in host memory (pinned on CUDA) instead of on the device. The block's own ``forward`` is
    wrapped in place, so parameter names (and checkpoints) do not change.
    """
    for block in model.blocks:
        block.forward = _checkpointed(block.forward, offload)


def _checkpointed(forward, offload: bool):
    def run(*args, **kwargs):
        # The non-reentrant checkpoint saves its inputs through the saved-tensor hooks active around it
        # (its own hooks, which drop everything else, apply only inside the block): save_on_cpu here
        # moves exactly the inputs to the host.
        with save_on_cpu(pin_memory=True) if offload else contextlib.nullcontext():
            return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run


def parallelize(model: nn.Module, cfg: ParallelConfig, env: DistributedEnv,
                activation_checkpointing: bool | str = False, compile: bool = False) -> nn.Module:
    """Wrap ``model`` (already on ``env.device``) for training: checkpointing, compile, then DDP or FSDP2.

    Args:
        model: the single-device model; must have ``model.blocks``.
        cfg, env: parallel config and this process's place.
        activation_checkpointing: one of ACTIVATION_CHECKPOINTING: recompute block activations in backward;
            "offload" also keeps the block inputs in host memory.
        compile: ``torch.compile`` each block in place; not with "offload" (the saved-tensor hooks would
            run inside the compiled blocks).
    Returns:
        the module to call in training (``model`` itself for one process or FSDP, a DDP wrapper for DDP).
    """
    if activation_checkpointing not in ACTIVATION_CHECKPOINTING:
        raise ConfigError(f"activation_checkpointing={activation_checkpointing!r}: expected one of "
                          f"{list(ACTIVATION_CHECKPOINTING)}")
    if activation_checkpointing == "offload" and compile:
        raise ConfigError("activation_checkpointing=offload cannot be combined with compile=true: the host "
                          "offload's saved-tensor hooks do not trace into compiled blocks; set one of them off")
    if activation_checkpointing:
        apply_activation_checkpointing(model, offload=activation_checkpointing == "offload")
    if compile:
        for block in model.blocks:
            block.compile()
    if not env.distributed:
        return model
    if cfg.mode == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        # fully_shard's default mesh is on the machine's accelerator, which a CPU (gloo) run must not touch.
        mesh = init_device_mesh(env.device.type, (env.world_size,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    # Gradients as views of the all-reduce buckets: no copy into the buckets each step, one gradient copy
    # less in memory.
    return DistributedDataParallel(model, device_ids=[env.device.index] if env.device.type == "cuda" else None,
                                   gradient_as_bucket_view=True)


def gradient_sync(model: nn.Module, enabled: bool):
    """Context for one micro batch's forward + backward: reduce gradients across ranks only when ``enabled``
    (the last micro batch of a step); the others just accumulate locally."""
    if isinstance(model, DistributedDataParallel):
        return contextlib.nullcontext() if enabled else model.no_sync()
    if hasattr(model, "set_requires_gradient_sync"):  # an FSDP2 module
        model.set_requires_gradient_sync(enabled)
    return contextlib.nullcontext()


def clip_grad_norm(parameters: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """Clip the global gradient norm (over all ranks' shards) to ``max_norm``; return the norm before clipping,
    a 0-dim tensor on the gradients' device (reading it waits for the step, so callers read it when they log)."""
    norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm)
    # Only FSDP2's sharded gradients give a DTensor norm, and fully_shard has imported DTensor then: other runs
    # skip its import (over a second of every process's start-up).
    dtensor = sys.modules.get("torch.distributed.tensor")
    if dtensor is not None and isinstance(norm, dtensor.DTensor):
        norm = norm.full_tensor()
    return norm


# torch.distributed.checkpoint is imported where it is used: importing it costs about a second, which every
# `flashformer` command and every torchrun worker would otherwise pay at start-up.


def full_state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer,
                     trainable_only: bool = False) -> tuple[dict, dict]:
    """Unsharded (model, optimizer) state dicts on CPU, keyed by parameter name; a collective under FSDP
    (every rank must call it); under FSDP only rank 0's dicts are filled.

    Args:
        trainable_only: the model's dict holds only the parameters that train (LoRA's adapters): a frozen
            base is neither gathered nor copied.
    """
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=trainable_only)
    return get_model_state_dict(model, options=options), get_optimizer_state_dict(model, optimizer, options=options)


def load_model_state_dict(model: nn.Module, model_state: dict) -> None:
    """Load unsharded weights, keyed as ``full_state_dicts`` keys them, into a (possibly sharded) model."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, model_state, options=StateDictOptions(full_state_dict=True))


def load_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, optimizer_state: dict) -> None:
    """Load an optimizer dict from ``full_state_dicts`` into the optimizer of a (possibly wrapped or sharded) model."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, optimizer_state, options=StateDictOptions(full_state_dict=True))
