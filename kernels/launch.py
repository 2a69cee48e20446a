"""Launch plumbing shared by the kernels: layouts, TMA scratch memory and block-size choice."""

from __future__ import annotations

import functools
import json
import math
import os
import threading

import torch
import triton
from triton.runtime._allocation import _allocator, NullAllocator

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

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
# maxnreg 128 (session 8, CPU compile survey; not yet timed): Triton 3.6 waits on every matmul inside
# one program (wgmma.wait_group 0 only), so the tensor cores idle while that program's softmax runs;
# a second program on the SM can fill them. Capping 8 warps at 128 registers fits two programs where
# 136-146 registers fit one, with no spill at head_dim 128 (98-115 KB of shared memory; the 3-stage dQ
# shape spills 20 B without a causal mask).
_SHAPES = {
    "fwd": [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (128, 32, 4, 3),
            (128, 64, 8, 2, 128)],
    # dK/dV plus each tile's dQ share: one more (BLOCK_M, HEAD_DIM) product live per step, so smaller
    # query tiles than bwd_dkdv (at head_dim 128, 32 x 64 and 16 x 128 spill nothing).
    "bwd_fused": [(32, 128, 8, 2), (64, 128, 8, 2), (32, 64, 8, 2), (64, 64, 8, 2), (16, 128, 8, 2), (32, 128, 8, 3),
                  (16, 64, 8, 2), (32, 64, 4, 2)],
    # The last two of bwd_dkdv and three of bwd_dq (session 5): no spill at head_dim 128 (the 64 x 32 dQ
    # shapes fit two programs per SM), where session 4's dQ pick for causal 512-1024 (128 x 32, 4 warps,
    # 3 stages) spills 364 B (compile survey, docs/perf-notes.md "Session 5").
    "bwd_dkdv": [(64, 128, 8, 2), (32, 128, 4, 3), (64, 64, 4, 3), (32, 64, 4, 2), (64, 128, 8, 3), (64, 64, 4, 4),
                 (128, 128, 8, 2), (32, 64, 8, 2), (64, 64, 8, 2), (64, 64, 8, 3), (32, 128, 8, 3)],
    "bwd_dq": [(128, 64, 8, 2), (128, 32, 4, 3), (64, 64, 4, 3), (64, 32, 4, 2), (128, 64, 8, 3), (64, 64, 4, 4),
               (128, 128, 8, 2), (64, 32, 8, 2), (64, 64, 8, 2), (128, 32, 8, 2), (64, 32, 4, 3), (64, 32, 8, 3),
               (128, 32, 8, 3), (128, 32, 8, 2, 128), (128, 32, 8, 3, 128)],
}
# head_dim 256 has its own: of the shapes above, only one forward fits its shared memory, and the
# backward ones spill. Each of these compiles for sm_90 into <= 227 KB of shared memory with at most
# ~0.8 KB of spill per thread (survey on CPU through tests/hopper_compile.py, docs/perf-notes.md
# "Session 5"); 8 warps hold the dK/dV accumulators (4 warps spill 7-8 KB).
_WIDE_SHAPES = {
    "fwd": [(64, 32, 4, 2), (64, 32, 8, 3), (64, 64, 4, 3), (64, 64, 8, 2), (128, 32, 8, 2), (128, 64, 8, 2)],
    "bwd_fused": [(16, 64, 8, 2), (32, 64, 8, 2)],
    "bwd_dkdv": [(16, 64, 8, 2), (32, 64, 8, 2), (64, 64, 8, 2)],
    "bwd_dq": [(64, 16, 8, 2), (64, 32, 4, 2), (64, 32, 8, 2), (64, 64, 8, 2), (128, 16, 8, 2), (128, 32, 8, 2)],
}
WIDE_HEAD_DIM = 128  # HEAD_DIM_PAD above this takes _WIDE_SHAPES


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
    shapes whose staged tiles fit Hopper's 227 KB of shared memory."""
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
    wide = head_dim_pad > 128
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
# maxnreg where the pick caps registers).
TUNED_CONFIGS_PATH = os.path.join(os.path.dirname(__file__), "tuned_configs.json")
# A config per kernel kind that overrides every other choice (scripts/tune_attention.py sets it).
FORCED_CONFIGS: dict[str, dict] = {}


@functools.lru_cache(maxsize=None)
def _measured_table(device_index):
    if not os.path.exists(TUNED_CONFIGS_PATH):
        return {}
    with open(TUNED_CONFIGS_PATH) as f:
        return json.load(f).get(torch.cuda.get_device_name(device_index), {})


# Past this length the measured picks no longer change with it (8k and 16k agree in the table), so the
# longest measured bucket also serves longer sequences.
LONG_SEQLEN_BUCKET = 16384


def measured_config(device, kind, head_dim_pad, causal, seqlen_bucket):
    """The offline-measured config for this shape, or None. The nearest seqlen bucket (log scale) serves
    within a factor of 2; a table cut short (say at 1k) must not pick the tiles of a 16k launch."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    entries = _measured_table(index).get(kind, {}).get(
        f"d{head_dim_pad}-{'causal' if causal else 'full'}")
    if not entries:
        return None
    nearest = min(entries, key=lambda bucket: abs(math.log2(int(bucket)) - math.log2(seqlen_bucket)))
    longest_beyond = int(nearest) >= LONG_SEQLEN_BUCKET and seqlen_bucket > int(nearest)
    if abs(math.log2(int(nearest)) - math.log2(seqlen_bucket)) > 1 and not longest_beyond:
        return None
    return config_from_shape(entries[nearest])


def table_mask(window_left, window_right, softcap):
    """The offline table's mask name for these options: "causal", "full", or None (not covered)."""
    if window_left >= 0 or softcap > 0.0:
        return None
    return "causal" if window_right == 0 else "full" if window_right < 0 else None


def pick_kernel(device, kind, kernel, tuned_kernel, head_dim_pad, mask=None, seqlen_bucket=1):
    """(launcher, fixed meta-parameters) for one launch.

    Args:
        mask: "causal" or "full" for shapes the offline table covers (no window, no softcap), else None.
        seqlen_bucket: the power of two at or above the query length.
    Order: a forced config (tuning runs); the interpreter's fixed config; the offline table; the
    default config when FLASHFORMER_AUTOTUNE=0; otherwise the autotuner.
    """
    if kind in FORCED_CONFIGS:
        return kernel, dict(FORCED_CONFIGS[kind])
    if device.type != "cuda":
        return kernel, dict(INTERPRETER_CONFIGS[kind])
    if mask is not None:
        config = measured_config(device, kind, head_dim_pad, mask == "causal", seqlen_bucket)
        if config is not None:
            return kernel, config
    if os.environ.get("FLASHFORMER_AUTOTUNE", "1") == "0":
        return kernel, _default_gpu_config(kind, head_dim_pad)
    return tuned_kernel, {}


def _torch_allocator(size, alignment, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


def ensure_allocator(device):
    """In-kernel tensor descriptors need scratch memory from an allocator (a per-thread setting)."""
    if device.type == "cuda" and isinstance(_allocator.get(), NullAllocator):
        triton.set_allocator(_torch_allocator)


def as_descriptor_compatible(t):
    """``t`` itself when TMA can address it (unit last stride, 16-byte aligned strides and base),
    else a contiguous copy. Slices of a fused qkv tensor with head_dim % 8 == 0 need no copy."""
    itemsize = t.element_size()
    *outer, last = t.stride()
    # A plain loop: this runs on every decoding step, where a generator's setup costs more than the checks.
    ok = last == 1 and t.data_ptr() % 16 == 0
    for s in outer:
        ok = ok and s > 0 and (s * itemsize) % 16 == 0
    return t if ok else t.contiguous()


# Tests turn this on (FLASHFORMER_POISON=1 at import, or set the attribute); read once here because
# an environment lookup costs ~2 µs and a decoding step allocates four outputs.
POISON_OUTPUTS = os.environ.get("FLASHFORMER_POISON") == "1"


def new_output(like, shape=None, dtype=None):
    """An uninitialised output buffer; NaN-filled when POISON_OUTPUTS is set, so that tests catch any
    element a kernel forgets to write."""
    out = torch.empty(like.shape if shape is None else shape, dtype=dtype or like.dtype, device=like.device)
    if POISON_OUTPUTS:
        out.fill_(float("nan"))
    return out


_INT32 = range(-2**31, 2**31)
# Signatures one CompiledLaunch keeps (a few per model; bounded for a long-lived server).
MAX_COMPILED_LAUNCHES = 1024


class CompiledLaunch:
    """Launches of ``kernel`` that reuse its compiled form and call Triton's C launcher directly,
    where batch-1 decoding is host-bound: no per-call argument binding, launch-metadata dict, hook
    calls or allocator callback (see _DirectLaunch).

    Only for kernels whose compiled code depends on nothing but the constexprs, the launch options
    and the arguments' types: every int argument declared ``do_not_specialize`` (Triton would
    otherwise specialise on == 1 and divisibility by 16), and every pointer either declared
    ``do_not_specialize_on_alignment`` or 16-byte aligned on every call by construction. The
    first launch of each key goes through Triton (and compiles); so does every launch in the
    interpreter.

    Call as ``launch(grid, *args, **constexprs_and_options)``, like ``kernel[grid](...)``.
    """

    def __init__(self, kernel):
        self.kernel = kernel
        self.compiled = {}

    def __call__(self, grid, *args, **meta):
        if INTERPRETED:
            self.kernel[grid](*args, **meta)
            return
        # An int's entry says whether it fits int32, which decides its type in Triton's signature.
        signature = (tuple(meta.values()),
                     *[a.dtype if type(a) is torch.Tensor else a in _INT32 if type(a) is int else type(a) for a in args])
        self.launch_keyed(signature, grid, *args, **meta)

    def launch_keyed(self, signature, grid, *args, **meta):
        """As calling this object, with ``signature`` standing for the constexprs, options and argument
        types: a caller that already knows them (decode.py's plans) skips working them out again. Equal
        signatures must mean equal specialisations."""
        if INTERPRETED:
            self.kernel[grid](*args, **meta)
            return
        device = torch.cuda.current_device()
        launch = self.compiled.get((device, signature))
        if launch is not None:
            launch(device, grid + (1,) * (3 - len(grid)), args)
            return
        compiled = self.kernel[grid](*args, **meta)
        if hasattr(compiled, "__getitem__"):  # a Triton whose launch returns no CompiledKernel: JIT always
            if len(self.compiled) >= MAX_COMPILED_LAUNCHES:
                self.compiled.clear()
            self.compiled[device, signature] = _DirectLaunch(
                compiled, tuple(meta[name] for name in self.kernel.arg_names[len(args):]))


# Triton versions whose C launcher _DirectLaunch calls directly (its argument order is theirs).
DIRECT_LAUNCH_TRITON = "3.6."


def _no_hook(hook):
    """Whether a launch hook setting calls nothing (None, or Triton 3.6's HookChain with no hooks)."""
    return not getattr(hook, "calls", hook)


class _DirectLaunch:
    """One compiled kernel's launches through Triton's C launcher (Triton 3.6's CudaLauncher.launch),
    skipping its Python wrapper: the stream is read from torch in one call, and the descriptor
    scratch that in-kernel TMA descriptors need comes from reused_buffers instead of an allocator
    callback. A Triton whose launcher lacks these attributes, launch hooks (a profiler's), or profiling
    scratch take the compiled kernel's own path.
    """

    def __init__(self, compiled, constexprs):
        self.compiled, self.constexprs = compiled, constexprs
        compiled._init_handles()
        launcher = compiled._run
        needed = ("launch", "global_scratch_size", "global_scratch_align", "profile_scratch_size", "num_ctas",
                  "launch_cooperative_grid", "launch_pdl")
        self.c_launch = None
        # The launcher's positional protocol is Triton 3.6's: another version takes the compiled kernel's
        # own path (correct, just slower) until its protocol is checked. torch's allocations are 512-byte
        # aligned, which covers any scratch alignment up to that.
        if (triton.__version__.startswith(DIRECT_LAUNCH_TRITON) and all(hasattr(launcher, name) for name in needed)
                and not launcher.profile_scratch_size and 512 % max(1, launcher.global_scratch_align) == 0):
            self.c_launch = launcher.launch
            self.scratch_bytes = launcher.global_scratch_size * launcher.num_ctas
            self.flags = (launcher.launch_cooperative_grid, launcher.launch_pdl)

    def __call__(self, device, grid, args):
        runtime = triton.knobs.runtime
        if self.c_launch is None or not (_no_hook(runtime.launch_enter_hook) and _no_hook(runtime.launch_exit_hook)):
            self.compiled[grid](*args, *self.constexprs)
            return
        scratch = None
        if self.scratch_bytes:
            (scratch,) = reused_buffers(device, "descriptor scratch", torch.uint8,
                                        ((grid[0] * grid[1] * grid[2] * self.scratch_bytes,),))
        stream = torch._C._cuda_getCurrentRawStream(device)
        self.c_launch(*grid, stream, self.compiled.function, *self.flags, scratch, None,
                      self.compiled.packed_metadata, None, None, None, *args, *self.constexprs)


_REUSED = {}
MAX_REUSED = 256


def reused_buffers(device, purpose, dtype, shapes):
    """Uninitialised buffers of ``shapes`` on CUDA device index ``device`` for one launch's temporaries
    (never results the caller keeps), handed out again to the next call with the same purpose and
    shapes on the same stream from the same thread (two threads could interleave their launches), whose
    kernels run after this one's in stream order: no allocation per decoding step. Fresh buffers during CUDA-graph capture, where the graph's memory pool must own
    them. NaN under POISON_OUTPUTS, as new_output.
    """
    if torch.cuda.is_current_stream_capturing():
        buffers = [torch.empty(shape, dtype=dtype, device=device) for shape in shapes]
    else:
        key = (device, torch._C._cuda_getCurrentRawStream(device), threading.get_ident(), purpose)
        entry = _REUSED.get(key)
        if entry is None or entry[0] != (dtype, shapes):
            # Replacing (or forgetting) buffers frees them safely: torch's allocator hands their memory
            # out again on this stream only, behind the kernels already queued there.
            if len(_REUSED) >= MAX_REUSED:  # threads and streams that come and go leave entries behind
                _REUSED.clear()
            entry = _REUSED[key] = ((dtype, shapes), [torch.empty(shape, dtype=dtype, device=device)
                                                      for shape in shapes])
        buffers = entry[1]
    if POISON_OUTPUTS and dtype.is_floating_point:
        for buffer in buffers:
            buffer.fill_(float("nan"))
    return buffers


def seq_strides(t, is_varlen):
    """(batch, seq, head) strides; a varlen tensor (total, heads, dim) has no batch stride."""
    return (0,) + t.stride()[:2] if is_varlen else t.stride()[:3]


def cdiv(a, b):
    """ceil(a / b) for host code: triton.cdiv is a constexpr function, ~2 µs per call from Python, and a
    launch makes several such calls."""
    return -(-a // b)


def next_power_of_2(n):
    """The smallest power of two >= n (1 for n <= 1), for host code (see cdiv)."""
    return 1 << (n - 1).bit_length() if n > 1 else 1


# CUDA caps grid dimensions y and z at 65535 (x at 2**31 - 1).
MAX_GRID_YZ = 65535


def tile_grid(block, seqlen, rows, batch, heads, is_varlen):
    """The launch grid of a kernel with one program per (tile, head) (see tile_ops.program_tile):
    dense (tiles of seqlen, heads, batch); varlen (a bound on the packed tiles of ``rows`` rows in
    ``batch`` sequences, heads, 1). Heads and batch get their own dimensions, each capped at
    MAX_GRID_YZ, where their product would pass that cap at 8192 sequences of 8 heads."""
    if heads > MAX_GRID_YZ or (not is_varlen and batch > MAX_GRID_YZ):
        raise ValueError(f"{'heads' if heads > MAX_GRID_YZ else 'batch'} = {max(heads, batch)} exceeds the "
                         f"{MAX_GRID_YZ} a CUDA grid dimension holds"
                         + ("" if heads > MAX_GRID_YZ else "; pack the sequences for flash_attn_varlen_func"))
    if is_varlen:
        return (cdiv(rows, block) + batch, heads, 1)
    return (cdiv(seqlen, block), heads, batch)


def seqs_pad(batch, is_varlen):
    """SEQS_PAD of tile_ops.program_tile: the sequences' vector size (a power of two) for varlen."""
    return max(2, next_power_of_2(batch)) if is_varlen else 1


def upcast_dot(dtype):
    """Whether tile products must go through fp32 (only bf16 in the interpreter; see tile_ops.mma)."""
    return INTERPRETED and dtype == torch.bfloat16


def dot_precision(dtype):
    """fp32 inputs get exact fp32 products (tf32 would lose ~3 digits); 16-bit types ignore it."""
    return "ieee" if dtype == torch.float32 else "tf32"
