"""Tile-shape policy of the attention kernels: the autotune space per kernel and head size, the offline
table measured by scripts/tune_attention.py (tuned_configs.json), and pick_kernel, which chooses between
a forced config, the interpreter's, the table's, a default and the autotuner for each launch.
"""

from __future__ import annotations

import functools
import json
import math
import os

import torch
import triton

from .settings import autotune_enabled
from .sizes import WIDE_HEAD_DIM

# Block sizes when the kernels run in Triton's interpreter (CPU): a fixed config, small enough to
# keep numpy tiles cheap, with BLOCK_M != BLOCK_N so that tests exercise the two tilings.
INTERPRETER_CONFIGS = {
    "fwd": {"BLOCK_M": 64, "BLOCK_N": 32},
    "bwd_dkdv": {"BLOCK_M": 32, "BLOCK_N": 64},
    "bwd_dq": {"BLOCK_M": 64, "BLOCK_N": 32},
    "bwd_fused": {"BLOCK_M": 32, "BLOCK_N": 64},
}


# The autotune space per kernel on CUDA, as (BLOCK_M, BLOCK_N, num_warps, num_stages[, maxnreg]), for
# head_dim <= 128 (pruned for shared memory per head_dim below).
# maxnreg 128: Triton 3.6 waits on every matmul inside one program (wgmma.wait_group 0 only), so the
# tensor cores idle while that program's softmax runs; a second program on the SM can fill them.
# Capping 8 warps at 128 registers fits two programs where 136-146 registers fit one, with no spill at
# head_dim 128 (98-115 KB of shared memory; the 3-stage dQ shape spills 20 B without a causal mask).
# It pays at short lengths, where one program's loop is too short to keep the tensor cores busy.
_SHAPES = {
    "fwd": [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (128, 32, 4, 3),
            (128, 64, 8, 2, 128)],
    # dK/dV plus each tile's dQ share: one more (BLOCK_M, HEAD_DIM) product live per step, so smaller
    # query tiles than bwd_dkdv (at head_dim 128, 32 x 64 and 16 x 128 spill nothing).
    "bwd_fused": [(32, 128, 8, 2), (64, 128, 8, 2), (32, 64, 8, 2), (64, 64, 8, 2), (16, 128, 8, 2), (32, 128, 8, 3),
                  (16, 64, 8, 2), (32, 64, 4, 2)],
    # The last two of bwd_dkdv and three of bwd_dq spill nothing at head_dim 128 (the 64 x 32 dQ shapes
    # fit two programs per SM), where the 128 x 32 / 4 warps / 3 stages dQ shape spills 364 B: the tuner
    # weighs the spill against the number of resident programs.
    "bwd_dkdv": [(64, 128, 8, 2), (32, 128, 4, 3), (64, 64, 4, 3), (32, 64, 4, 2), (64, 128, 8, 3), (64, 64, 4, 4),
                 (128, 128, 8, 2), (32, 64, 8, 2), (64, 64, 8, 2), (64, 64, 8, 3), (32, 128, 8, 3)],
    "bwd_dq": [(128, 64, 8, 2), (128, 32, 4, 3), (64, 64, 4, 3), (64, 32, 4, 2), (128, 64, 8, 3), (64, 64, 4, 4),
               (128, 128, 8, 2), (64, 32, 8, 2), (64, 64, 8, 2), (128, 32, 8, 2), (64, 32, 4, 3), (64, 32, 8, 3),
               (128, 32, 8, 3), (128, 32, 8, 2, 128), (128, 32, 8, 3, 128)],
}
# head_dim 256 has its own: of the shapes above, only one forward fits its shared memory, and the
# backward ones spill. Each of these compiles for sm_90 into <= 227 KB of shared memory with at most
# ~0.8 KB of spill per thread (compiled on CPU through tests/hopper_compile.py); 8 warps hold the dK/dV
# accumulators (4 warps spill 7-8 KB).
_WIDE_SHAPES = {
    "fwd": [(64, 32, 4, 2), (64, 32, 8, 3), (64, 64, 4, 3), (64, 64, 8, 2), (128, 32, 8, 2), (128, 64, 8, 2)],
    "bwd_fused": [(16, 64, 8, 2), (32, 64, 8, 2)],
    "bwd_dkdv": [(16, 64, 8, 2), (32, 64, 8, 2), (64, 64, 8, 2)],
    "bwd_dq": [(64, 16, 8, 2), (64, 32, 4, 2), (64, 32, 8, 2), (64, 64, 8, 2), (128, 16, 8, 2), (128, 32, 8, 2)],
}


def _shape(config):
    shape = (config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], config.num_warps, config.num_stages)
    return shape + (config.maxnreg,) if config.maxnreg else shape


def config_from_shape(shape):
    """Launch meta-parameters of a (BLOCK_M, BLOCK_N, num_warps, num_stages[, maxnreg]) shape."""
    config = {"BLOCK_M": shape[0], "BLOCK_N": shape[1], "num_warps": shape[2], "num_stages": shape[3]}
    return {**config, "maxnreg": shape[4]} if len(shape) > 4 else config


def shape_of_config(config):
    """config_from_shape's inverse: the offline table's entry for launch meta-parameters."""
    shape = (config["BLOCK_M"], config["BLOCK_N"], config["num_warps"], config["num_stages"])
    return shape + (config["maxnreg"],) if "maxnreg" in config else shape


def _gpu_configs(kind):
    """Every candidate of one kernel on CUDA, both head_dim classes (prune_configs picks per launch)."""
    shapes = _SHAPES[kind] + [shape for shape in _WIDE_SHAPES[kind] if shape not in _SHAPES[kind]]
    return [triton.Config({"BLOCK_M": shape[0], "BLOCK_N": shape[1]}, num_warps=shape[2], num_stages=shape[3],
                          maxnreg=shape[4] if len(shape) > 4 else None) for shape in shapes]


def prune_configs(kind, configs, named_args, **kwargs):
    """The candidates of ``kind`` for this launch's head_dim: head_dim 256's own list, else the
    shapes whose staged tiles fit Hopper's 227 KB of shared memory; none capped in registers for a paged
    forward (row_pointer_config)."""
    if kwargs.get("IS_PAGED", named_args.get("IS_PAGED")):
        configs = [config for config in configs if not config.maxnreg] or configs
    head_dim = named_args["HEAD_DIM_PAD"] if "HEAD_DIM_PAD" in named_args else kwargs["HEAD_DIM_PAD"]
    if head_dim > WIDE_HEAD_DIM:
        kept = [config for config in configs if _shape(config) in _WIDE_SHAPES[kind]]
    else:
        budget = 200 * 1024
        kept = [config for config in configs if _shape(config) in _SHAPES[kind]
                and (config.kwargs["BLOCK_M"] + config.kwargs["BLOCK_N"]) * head_dim * 2 * config.num_stages <= budget]
    return kept or configs[-1:]


def tuned(kernel, kind, extra_key=(), reset_to_zero=()):
    """The CUDA launcher of ``kernel``: autotuned per shape bucket (and ``extra_key`` arguments),
    results cached on disk. ``reset_to_zero`` names the buffers the kernel adds into: the autotuner
    runs every candidate many times on the caller's tensors, so they are zeroed before each run and
    before the real one."""
    return triton.autotune(
        configs=_gpu_configs(kind),
        key=["seqlen_q_bucket", "seqlen_k_bucket", "HEAD_DIM", "GROUP", "LEFT_BOUNDED", "RIGHT_BOUNDED",
             "HAS_SOFTCAP", "IS_VARLEN", *extra_key],
        prune_configs_by={"early_config_prune": functools.partial(prune_configs, kind)},
        reset_to_zero=list(reset_to_zero) or None,
        cache_results=True,
    )(kernel)


def _default_gpu_config(kind, head_dim_pad):
    """One sensible CUDA config per kernel, for FLASHFORMER_AUTOTUNE=0 (e.g. wide test sweeps, where
    compiling every autotune candidate for every specialisation would dominate)."""
    wide = head_dim_pad > WIDE_HEAD_DIM
    if kind == "fwd":
        return {"BLOCK_M": 64 if wide else 128, "BLOCK_N": 32 if wide else 64, "num_warps": 4 if wide else 8,
                "num_stages": 2 if wide else 3}
    if kind == "bwd_dkdv":
        return {"BLOCK_M": 32, "BLOCK_N": 64 if wide else 128, "num_warps": 8, "num_stages": 2}
    if kind == "bwd_fused":
        return {"BLOCK_M": 16 if wide else 32, "BLOCK_N": 64 if head_dim_pad >= 128 else 128, "num_warps": 8,
                "num_stages": 2}
    return {"BLOCK_M": 64 if wide else 128, "BLOCK_N": 32 if wide else 64, "num_warps": 8, "num_stages": 2}


# Configs measured offline by scripts/tune_attention.py (long timing runs per shape; the autotuner's
# short runs picked differently from run to run for sub-millisecond shapes). Per GPU name, kernel and
# "d<HEAD_DIM_PAD>-<causal|full>", a map from seqlen bucket to [BLOCK_M, BLOCK_N, num_warps, num_stages] (and
# maxnreg where the pick caps registers); beside the kernels, the GPU's "capability" ("9.0").
TUNED_CONFIGS_PATH = os.path.join(os.path.dirname(__file__), "tuned_configs.json")
# A config per kernel kind that overrides every other choice (scripts/tune_attention.py sets it).
FORCED_CONFIGS: dict[str, dict] = {}


def table_for(tables, device_name, capability):
    """The offline table a GPU launches with: its own entries, and for each (kernel, head_dim and mask,
    length) it has not measured, the entry of the first table measured on another GPU of the same compute
    capability ("9.0"). The candidates' fit (shared memory, registers) and their ranking come from the SM,
    which an H100 and an H200 share, so an H100 takes the H200's tiles rather than autotuning every new
    shape from scratch, and a sweep cut short (one head_dim, a few lengths) adds to them, not replaces them."""
    own = tables.get(device_name, {})
    sibling = sibling_table(tables, device_name, capability)[1]
    merged = {**sibling, **own}
    for kind in set(sibling) & set(own):
        if isinstance(own[kind], dict):
            families = set(sibling[kind]) | set(own[kind])
            merged[kind] = {family: {**sibling[kind].get(family, {}), **own[kind].get(family, {})}
                            for family in families}
    return merged


def sibling_table(tables, device_name, capability):
    """(name, table) of the first table measured on another GPU of ``capability``, or (None, {})."""
    return next(((name, table) for name, table in tables.items()
                 if name != device_name and table.get("capability") == capability), (None, {}))


def device_capability(device_index=None):
    """A CUDA device's compute capability as the offline table records it ("9.0")."""
    return "{}.{}".format(*torch.cuda.get_device_capability(device_index))


@functools.lru_cache(maxsize=None)
def _measured_table(device_index):
    if not os.path.exists(TUNED_CONFIGS_PATH):
        return {}
    with open(TUNED_CONFIGS_PATH) as f:
        tables = json.load(f)
    name = torch.cuda.get_device_name(device_index)
    return table_for(tables, name, device_capability(device_index))


# From this length on the measured picks stop changing with it (8k and 16k agree in the table), so the
# longest measured bucket also serves longer sequences.
LONG_SEQLEN_BUCKET = 16384


def measured_config(device, kind, head_dim_pad, causal, seqlen_bucket):
    """The offline-measured config for this shape, or None. The nearest seqlen bucket (log scale) serves
    within a factor of 2; a table cut short (say at 1k) must not pick the tiles of a 16k launch."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return config_in_table(_measured_table(index), kind, head_dim_pad, causal, seqlen_bucket)


def config_in_table(table, kind, head_dim_pad, causal, seqlen_bucket):
    """measured_config's lookup in one GPU's ``table``."""
    entries = table.get(kind, {}).get(f"d{head_dim_pad}-{'causal' if causal else 'full'}")
    if not entries:
        return None
    nearest = min(entries, key=lambda bucket: abs(math.log2(int(bucket)) - math.log2(seqlen_bucket)))
    longest_beyond = int(nearest) >= LONG_SEQLEN_BUCKET and seqlen_bucket > int(nearest)
    if abs(math.log2(int(nearest)) - math.log2(seqlen_bucket)) > 1 and not longest_beyond:
        return None
    return config_from_shape(entries[nearest])


def table_mask(window_right):
    """The offline table's mask family for a launch: "causal" where the keys are bounded on the right
    (causal or a window), so that query tiles differ in length, else "full". The table times plain masks
    only; windows and softcap take their family's tiles rather than the autotuner's sweep, whose compiles
    (seconds per candidate) a first call at a new shape must not wait for."""
    return "causal" if window_right >= 0 else "full"


def pick_kernel(device, kind, kernel, tuned_kernel, head_dim_pad, mask, seqlen_bucket):
    """(launcher, fixed meta-parameters) for one launch.

    Args:
        mask: the offline table's mask family, "causal" or "full" (table_mask).
        seqlen_bucket: the power of two at or above the query length.
    Order: a forced config (tuning runs); the interpreter's fixed config; the offline table; the
    default config when FLASHFORMER_AUTOTUNE=0 or below AUTOTUNE_MIN_SEQLEN; otherwise the autotuner.
    """
    if kind in FORCED_CONFIGS:
        return kernel, dict(FORCED_CONFIGS[kind])
    if device.type != "cuda":
        return kernel, dict(INTERPRETER_CONFIGS[kind])
    config = measured_config(device, kind, head_dim_pad, mask == "causal", seqlen_bucket)
    if config is not None:
        return kernel, config
    if not autotunes(seqlen_bucket):
        return kernel, _default_gpu_config(kind, head_dim_pad)
    return tuned_kernel, {}


def row_pointer_config(config):
    """``config`` for a kernel that reads its key rows through pointers (the paged forward) instead of TMA: no
    register cap. The capped picks (two programs per SM) fit the TMA form's ~140 registers; row pointers and their
    masks take ~215 at head_dim 128, and under a 128 cap spill 884 B (sm_90 compile)."""
    return {name: value for name, value in config.items() if name != "maxnreg"}


# Shorter launches than this (query length's power of two) that the offline table does not cover take
# the default config: their kernels run in tens of microseconds, while autotuning compiles and times
# every candidate of up to three kernels, seconds for each new shape, to choose among configs a few
# percent apart.
AUTOTUNE_MIN_SEQLEN = 2048


def autotunes(seqlen_bucket):
    """Whether a launch the offline table does not cover goes through the autotuner."""
    return autotune_enabled() and seqlen_bucket >= AUTOTUNE_MIN_SEQLEN


# The Hopper Gluon forward (flash_fwd_hopper.py): its shapes per padded head_dim and where it runs.
# (BLOCK_N, NUM_STAGES, CONSUMERS) per padded head_dim: two stages of K and V tiles plus the 64-row Q
# tiles within Hopper's 227 KB of shared memory (scripts/bench_gluon_forward.py measured the alternatives).
# At head_dim 64 three consumers (192 rows per K/V tile) beat two by 1.05-1.10x at 4k-16k tokens.
GLUON_FORWARD_CONFIGS = {64: (128, 2, 3), 128: (128, 2, 2), 256: (64, 2, 2)}
# Where the Gluon forward is the faster one on the H200 (BENCHMARKS.md), as the shortest query length per
# padded head_dim: 1.03-1.17x the tl kernel at head_dim 128 and 1.14-1.38x at 256 over 1k-16k tokens; at 64
# the persistent form is 1.11-1.32x tl from 1k (shorter lengths are unmeasured, so tl keeps them).
GLUON_FORWARD_FROM_SEQLEN = {64: 1024, 128: 1, 256: 1}
# Packed sequences (varlen) run the Gluon forward one tile per program (its persistent schedule needs the lengths on
# the host). That form read 1.03-1.17x tl at head_dim 128 and 1.14-1.38x at 256 from 1k tokens, but 0.77-0.99x at
# 64 (BENCHMARKS.md, the Gluon forward's tile shapes), so tl keeps varlen at head_dim 64.
GLUON_VARLEN_FORWARD_FROM_SEQLEN = {128: 1, 256: 1}
# The same for the Gluon backward (flash_bwd_hopper): at head_dim 128 and 256 faster than the tl kernels at every
# length measured (1.23-1.68x at 4k and 16k); at 64 (BLOCK_M 128) 1.03-1.12x from 4k but 0.86-0.96x at 512-1k and
# 0.98-1.02x at 2k, causal and not (two attention grids, one before it took 64, BENCHMARKS.md), so tl keeps the
# shorter lengths there.
GLUON_BACKWARD_FROM_SEQLEN = {64: 4096, 128: 1, 256: 1}
# Key lengths below which the persistent grid wins, per (padded head_dim, causal): with few K/V tiles per
# query tile a program's own costs (launch, descriptors, barriers, the first loads, the ring's fill and drain)
# weigh, and a persistent program hides them behind its previous tile. Measured on the H200 (BENCHMARKS.md):
# without a mask, at head_dim 128 1.12-1.17x the one-tile grid at 1k and 1.04x / 1.03x / 0.99x at 2k / 4k / 8k
# (rounds alternating the two on a GPU at its power limit), at 256 1.04x / 1.02x / 1.00x / 1.00x at
# 1k / 2k / 4k / 16k, at 64 ahead or level to 16k; causal, with the host's balanced schedule, 1.35x at 1k and
# 1.06x at 4k at 128 (0.99x at 16k), 1.20x / 1.01x / 1.04x at 1k / 4k / 16k at 256.
GLUON_PERSISTENT_BELOW_SEQLEN = {(64, False): float("inf"), (64, True): float("inf"), (128, False): 8192,
                                 (128, True): 16384, (256, False): float("inf"), (256, True): float("inf")}


def gluon_forward_config(head_dim_pad, seqlen_k, causal):
    """(BLOCK_N, NUM_STAGES, CONSUMERS, persistent) for one launch, from the H200's measurements.

    Args:
        causal: whether the keys are bounded on the right (causal or a right window), so that query
            tiles differ in length.
    """
    block_n, num_stages, consumers = GLUON_FORWARD_CONFIGS[head_dim_pad]
    persistent = seqlen_k < GLUON_PERSISTENT_BELOW_SEQLEN.get((head_dim_pad, causal), 0)
    if persistent and head_dim_pad == 64 and (causal or seqlen_k < 2048):
        # 128-row tiles: a causal launch's tiles then vary less in length, and at 1k the 192-row blocks'
        # ragged last block wastes a tenth of the work (two consumers 1.06-1.42x three there).
        consumers = 2
    return block_n, num_stages, consumers, persistent


# Where a persistent Gluon forward with two sets of Q blocks overlaps one tile's end with the next's start
# (flash_fwd_hopper's OVERLAP_TILES), as the shortest key length per (padded head_dim, causal). Against the same
# kernel taking its tiles in turn on the H200 (BENCHMARKS.md, medians of three alternating rounds): at head_dim 128
# 0.98x at 1k and 1.02-1.05x at 2k-4k, causal and not; at 64 without a mask 1.00-1.03x from 1k. Causal at 64 it
# reads 0.94x / 0.98x / 1.00x at 1k / 2k / 4k, so those tiles run in turn.
GLUON_OVERLAP_TILES_FROM_SEQLEN = {(64, False): 1, (128, False): 2048, (128, True): 2048}


def gluon_overlaps_tiles(head_dim_pad, seqlen_k, causal):
    """Whether a persistent Gluon forward overlaps its tile boundaries, where two sets of Q blocks fit.

    Args:
        causal: whether the keys are bounded on the right, as in gluon_forward_config.
    """
    return seqlen_k >= GLUON_OVERLAP_TILES_FROM_SEQLEN.get((head_dim_pad, causal), float("inf"))


# Where the Gluon forward's consumers issue their products in rotation (flash_fwd_hopper_tile.wait_turn), as
# (padded head_dim, consumers) of a persistent launch. Against the same kernel with its consumers at their own pace
# on the H200 (BENCHMARKS.md, medians of three alternating rounds): at head_dim 128 +1-5% at 1k-16k causal and 1k-8k
# unmasked; at 64 with three consumers +0-6% unmasked (4k +6%) and +4-14% causal. Elsewhere it reads level or
# behind: the one-tile kernel at 128 (-2.6% to +1.3%), two consumers at 64 (-1.5% to +1.7%).
GLUON_TURNS = {(128, 2), (64, 3)}


def gluon_consumers_take_turns(head_dim_pad, consumers, persistent):
    """Whether the Gluon forward's consumers take turns on the tensor cores (GLUON_TURNS)."""
    return persistent and (head_dim_pad, consumers) in GLUON_TURNS


# Where the fused Gluon backward, its dQ shares reduced in arrival order with dQ's columns split between
# the consumers ("fused-split"), beat the two Gluon kernels on the H200, as the shortest key length per
# (padded head_dim, causal); the policy for deterministic=False only. At head_dim 128: 1.03-1.07x from 2k
# keys without a mask, 1.04x from 8k causal (level at 4k, 0.92-0.98x at 1k). At head_dim 64 the tl
# kernels beat every Gluon form; the ordered (deterministic) fused forms trail the two kernels everywhere.
GLUON_UNORDERED_FUSED_FROM_SEQLEN = {(128, False): 2048, (128, True): 8192}


GLUON_BACKWARD_FORMS = ("two-kernel", "fused", "fused-split")


def checked_gluon_form(gluon_form):
    """``gluon_form`` (None or one of GLUON_BACKWARD_FORMS), or a ValueError naming it."""
    if gluon_form is not None and gluon_form not in GLUON_BACKWARD_FORMS:
        raise ValueError(f"gluon_form must be None or one of {GLUON_BACKWARD_FORMS}, got {gluon_form!r}")
    return gluon_form


def gluon_backward_form(head_dim_pad, seqlen_k, window_left, window_right, deterministic):
    """The Gluon backward's form for one launch: "fused-split" or "two-kernel" (flash_bwd_hopper).

    Args:
        window_left, window_right: the launch's window bounds (-1: unbounded); only the measured masks,
            none and causal (0 on the right), take the fused form.
        deterministic: whether dQ must come out bit-identical run to run (the fused form's order varies).
    """
    if deterministic or window_left >= 0 or window_right > 0:
        return "two-kernel"
    from_seqlen = GLUON_UNORDERED_FUSED_FROM_SEQLEN.get((head_dim_pad, window_right == 0), float("inf"))
    return "fused-split" if seqlen_k >= from_seqlen else "two-kernel"


# Where deterministic=False's tl form (the dK/dV kernel also reducing dQ's fp32 shares into memory) ran
# slower than the two deterministic kernels, as (compute capability major, padded head_dim): on the H200 at
# head_dim 64, 0.65-0.81x of them from 512 to 16k tokens, causal and not. There deterministic=False takes
# the two kernels, whose bit-identical result is one of the results it allows.
TL_REDUCED_DQ_SLOWER = {(9, 64)}


def tl_reduced_dq_pays(device: torch.device, head_dim_pad: int) -> bool:
    """Whether deterministic=False should take the tl backward's reduced-dQ form on ``device`` (True
    where it was not measured slower; the interpreter always takes it, so CI runs it)."""
    if device.type != "cuda":
        return True
    return (torch.cuda.get_device_capability(device)[0], head_dim_pad) not in TL_REDUCED_DQ_SLOWER
