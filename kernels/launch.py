"""Launch mechanics shared by the kernels: TMA scratch memory, output buffers (NaN-poisoned for tests),
strides and grids, reused per-stream temporaries, direct launches through Triton's C launcher, and the
compile-only mode in which a launch site compiles its kernel and launches nothing (compile_ahead.py).

Which tile shapes a launch uses is tuning.py's choice.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading

import torch
import triton
from triton.runtime._allocation import _allocator, NullAllocator

from .settings import DIRECT_LAUNCH, INTERPRETED, POISON_AT_IMPORT
from .sizes import cdiv, next_power_of_2


_COMPILE_ONLY = threading.local()


class WouldAutotune(RuntimeError):
    """A launch in compile-only mode reached the autotuner, which would time configs on real launches."""


@contextlib.contextmanager
def compile_only():
    """Within the block, on this thread, ``launcher`` compiles each kernel for its arguments (into Triton's
    caches; under Triton's AsyncCompileMode, on its threads) and launches nothing."""
    previous = getattr(_COMPILE_ONLY, "active", False)
    _COMPILE_ONLY.active = True
    try:
        yield
    finally:
        _COMPILE_ONLY.active = previous


def launcher(kernel, grid):
    """``kernel[grid]``, or within compile_only() its compile for the same arguments (Triton's warmup).
    A kernel with fixed meta-parameters launches through its CompiledLaunch (Triton's C launcher called
    directly once compiled), where the host time of Triton's launch path would otherwise decide a short
    call's time.

    Args:
        kernel: a @triton.jit or @gluon.jit function; an autotuner raises WouldAutotune in compile-only mode.
        grid: the launch grid, a tuple or a function of the meta-parameters.
    """
    autotuner = isinstance(kernel, triton.runtime.Autotuner)
    if not getattr(_COMPILE_ONLY, "active", False):
        if autotuner or INTERPRETED or not DIRECT_LAUNCH:
            return kernel[grid]
        direct = _DIRECT.get(kernel)
        if direct is None:
            direct = _DIRECT[kernel] = CompiledLaunch(kernel)
        return functools.partial(direct, grid)
    if autotuner:
        raise WouldAutotune(f"{kernel.base_fn.__name__} autotunes here")
    return lambda *args, **meta: kernel.warmup(*args, grid=grid, **meta)


def _torch_allocator(size, alignment, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


def ensure_allocator(device):
    """In-kernel tensor descriptors need scratch memory from an allocator (a per-thread setting)."""
    if device.type == "cuda" and isinstance(_allocator.get(), NullAllocator):
        triton.set_allocator(_torch_allocator)


@functools.cache
def sm_count(device_index):
    """SMs of a GPU: asked once, since the query costs microseconds on every launch."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def as_descriptor_compatible(t):
    """``t`` itself when TMA can address it (unit last stride, 16-byte aligned strides and base),
    else a contiguous copy (a fresh one: ``contiguous()`` would return a contiguous view with an unaligned
    base as it is). Slices of a fused qkv tensor with head_dim % 8 == 0 need no copy."""
    itemsize = t.element_size()
    *outer, last = t.stride()
    # A plain loop: this runs on every decoding step, where a generator's setup costs more than the checks.
    ok = last == 1 and t.data_ptr() % 16 == 0
    for s in outer:
        ok = ok and s > 0 and (s * itemsize) % 16 == 0
    return t if ok else t.clone(memory_format=torch.contiguous_format)


# Tests turn this on (FLASHFORMER_POISON=1 at import, or set the attribute).
POISON_OUTPUTS = POISON_AT_IMPORT


def new_output(like, shape=None, dtype=None):
    """An uninitialised output buffer; NaN-filled when POISON_OUTPUTS is set, so that tests catch any
    element a kernel forgets to write."""
    out = torch.empty(like.shape if shape is None else shape, dtype=dtype or like.dtype, device=like.device)
    if POISON_OUTPUTS:
        out.fill_(float("nan"))
    return out


_INT32 = range(-2**31, 2**31)
_UINT64_FROM = 2**63  # Triton types an int from here on as u64
# Signatures one CompiledLaunch keeps (a few per model; bounded for a long-lived server).
MAX_COMPILED_LAUNCHES = 1024


def specialisations(args):
    """What Triton 3.6 compiles each argument's variant on: a tensor's dtype and 16-byte alignment; an int's
    width, divisibility by 16 and == 1; else its type (a float is always fp32). For a kernel that declares
    none of them unspecialised this is exactly its key; where it does, equal keys still mean equal variants.
    One comprehension, not a call per argument: every direct launch forms this for its 20-40 arguments."""
    return [(a.dtype, a.data_ptr() % 16 == 0) if type(a) is torch.Tensor
            else (a in _INT32, a >= _UINT64_FROM, a % 16 == 0, a == 1) if type(a) is int
            else type(a) for a in args]


def specialisation(arg):
    """specialisations of one argument."""
    return specialisations((arg,))[0]


class CompiledLaunch:
    """Launches of ``kernel`` that reuse its compiled form and call Triton's C launcher directly: no
    per-call argument binding, launch-metadata dict, hook calls or allocator callback (see _DirectLaunch).
    The first launch of each signature goes through Triton (and compiles, or loads from its cache); so
    does every launch in the interpreter.

    Call as ``launch(grid, *args, **constexprs_and_options)``, like ``kernel[grid](...)``: the kernel's
    runtime arguments positional, its constexprs and launch options by keyword; a callable grid gets the
    keyword arguments. The signature of such a call is its arguments' specialisations, so any kernel
    qualifies; launch_keyed takes a signature the caller already knows instead.
    """

    def __init__(self, kernel):
        self.kernel = kernel
        self.compiled = {}

    def __call__(self, grid, *args, **meta):
        if INTERPRETED:
            self.kernel[grid](*args, **meta)
            return
        if callable(grid):
            grid = grid(meta)
        self.launch_keyed((tuple(meta.values()), *specialisations(args)), grid, *args, **meta)

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
            self.compiled[device, signature] = _DirectLaunch(compiled, self._constexprs(len(args), meta))

    def _constexprs(self, positional, meta):
        """The values of the kernel's arguments after the positional ones, in order (a default where the
        call left one out), as its compiled form's launcher takes them."""
        params = list(inspect.signature(self.kernel.fn).parameters.values())[positional:]
        return tuple(meta[p.name] if p.name in meta else p.default for p in params)


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


# The CompiledLaunch of each kernel launched through launcher().
_DIRECT = {}
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
