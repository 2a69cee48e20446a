"""The backward's kernels compiled while the forward runs.

A fresh process's first forward + backward at a new specialisation spends seconds compiling its kernels,
one after another on the main thread. When a forward on CUDA has inputs that need gradients, and its
backward's specialisation has not been seen in this process, submit_backward hands the backward's launch
code to a background thread in launch.compile_only mode: each launch site compiles its kernel for the
same arguments and launches nothing, those compiles running concurrently with each other (Triton's
AsyncCompileMode) and with the forward's own, since Triton's compile releases the GIL for much of its work.
The backward waits for that job before its first launch (wait_for_backward), then finds its kernels
compiled. A job that fails or stalls costs nothing but time: the backward compiles what it lacks itself.

Off in the interpreter, under FLASHFORMER_COMPILE_AHEAD=0, during CUDA-graph capture, where q is larger
than MAX_INPUT_BYTES (the job allocates outputs of the backward's sizes), and where a backward kernel would
be autotuned (compile-only never times configs: the job stops there, launch.WouldAutotune).
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import logging
import threading

import torch

from . import settings
from .launch import WouldAutotune, compile_only, seqs_pad, specialisation
from .sizes import next_power_of_2, pad_head_dim

logger = logging.getLogger(__name__)

# The job allocates dq, dk, dv and the row statistics (fp32 dQ shares too, for the unordered forms) beside
# the live activations; past this q size that memory outweighs the seconds saved once per process.
MAX_INPUT_BYTES = 256 * 2**20
# A backward waits this long for its job, then compiles whatever is still missing itself.
WAIT_S = 120.0
# Specialisations remembered; past it the finished ones are forgotten (a later forward resubmits, and its
# job finds the kernels in Triton's cache).
MAX_KEYS = 1024
# Threads compiling one job's kernels concurrently (a backward has at most four).
COMPILE_THREADS = 4

_jobs: dict[tuple, concurrent.futures.Future] = {}
# The last job submitted: the worker runs them in turn, so once it is done every job is.
_latest: concurrent.futures.Future | None = None
_jobs_lock = threading.Lock()
_executors: dict[str, concurrent.futures.ThreadPoolExecutor] = {}
_executors_lock = threading.Lock()
_exit_hooked = False


def _executor(name, workers):
    """A thread pool made on first use: importing the kernels starts no threads."""
    global _exit_hooked
    with _executors_lock:
        if not _exit_hooked:
            # Python joins pool threads at exit only after they drain their queues: a process that ran forwards at
            # many shapes and never their backwards would compile every one of those backwards before exiting.
            # Hooks registered later run earlier, so this one cancels the queued work before that join. The hook
            # is CPython's (3.9 on); without it atexit's would run only after the join.
            getattr(threading, "_register_atexit", atexit.register)(cancel_pending)
            _exit_hooked = True
        if name not in _executors:
            _executors[name] = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix=f"flashformer-{name}")
        return _executors[name]


def cancel_pending():
    """Cancel every queued compile; compiles already running finish. Later work gets fresh pools."""
    with _executors_lock:
        for executor in _executors.values():
            executor.shutdown(wait=False, cancel_futures=True)
        _executors.clear()


def _contiguous_strides(shape):
    """The strides of a fresh tensor of ``shape`` (as launch.new_output's)."""
    strides = [1]
    for size in reversed(shape[1:]):
        strides.append(strides[-1] * size)
    return strides[::-1]


def backward_key(inputs, gluon):
    """What decides the backward kernels' specialisation for one forward's inputs.

    Args:
        inputs: the forward's arguments as interface._forward_impl takes them (q, k, v, cu_seqlens_q,
            cu_seqlens_k, alibi_slopes, dropout_seed, max_seqlen_q, max_seqlen_k, softmax_scale,
            window_left, window_right, softcap, dropout_p, deterministic).
        gluon: whether the Gluon path runs (interface.kernel_impl).
    """
    from .tuning import gluon_backward_form

    (q, k, v, cu_seqlens_q, _, alibi_slopes, _, max_seqlen_q, max_seqlen_k, _, window_left, window_right, softcap,
     dropout_p, deterministic) = inputs
    is_varlen = cu_seqlens_q is not None
    batch = cu_seqlens_q.numel() - 1 if is_varlen else q.shape[0]
    seqlen_q, seqlen_k = (max_seqlen_q, max_seqlen_k) if is_varlen else (q.shape[1], k.shape[1])
    head_dim_pad = pad_head_dim(q.shape[-1])
    form = gluon_backward_form(head_dim_pad, seqlen_k, window_left, window_right, deterministic) if gluon else None
    alibi = None if alibi_slopes is None else (alibi_slopes.dim(), specialisation(alibi_slopes.stride(0)))
    # The tl kernels (the preprocess beside the Gluon ones, the whole backward elsewhere) specialise their
    # lengths, window bounds and strides: the inputs', the fresh (contiguous) gradients' and lse's.
    lse_strides = (0, q.shape[0]) if is_varlen else (q.shape[-2] * seqlen_q, seqlen_q)
    ints = (seqlen_q, seqlen_k, batch, window_left, window_right, *q.stride(), *k.stride(), *v.stride(),
            *_contiguous_strides(q.shape), *_contiguous_strides(k.shape), *lse_strides)
    return (q.device.index, q.dtype, k.dtype, v.dtype, q.shape[-1], q.shape[-2] // k.shape[-2], window_left >= 0,
            window_right >= 0, softcap > 0.0, dropout_p > 0.0, alibi, is_varlen, seqs_pad(batch, is_varlen),
            bool(deterministic), gluon, form, next_power_of_2(max(seqlen_q, 1)), next_power_of_2(max(seqlen_k, 1)),
            tuple(specialisation(n) for n in ints))


def _shape_key(inputs, gluon):
    """What backward_key is a function of, as read straight off the inputs (shapes, strides, dtypes, flags),
    without forming the specialisations."""
    (q, k, v, cu_seqlens_q, _, alibi_slopes, _, max_seqlen_q, max_seqlen_k, _, window_left, window_right, softcap,
     dropout_p, deterministic) = inputs
    return (q.device, q.dtype, k.dtype, v.dtype, q.shape, k.shape, q.stride(), k.stride(), v.stride(),
            None if cu_seqlens_q is None else cu_seqlens_q.numel(), max_seqlen_q, max_seqlen_k, window_left,
            window_right, softcap > 0.0, dropout_p > 0.0,
            None if alibi_slopes is None else (alibi_slopes.dim(), alibi_slopes.stride(0)), bool(deterministic), gluon)


_keys_by_shape: dict[tuple, tuple] = {}


def cached_backward_key(inputs, gluon):
    """backward_key, kept per _shape_key: a training step's forwards repeat their shapes, and each key takes some
    forty specialisations to form (host time on every forward otherwise)."""
    shape_key = _shape_key(inputs, gluon)
    key = _keys_by_shape.get(shape_key)
    if key is None:
        if len(_keys_by_shape) >= MAX_KEYS:
            _keys_by_shape.clear()
        key = _keys_by_shape[shape_key] = backward_key(inputs, gluon)
    return key


def wanted(q, k):
    """Whether a forward on ``q`` and ``k`` (inputs that need gradients) should compile its backward ahead."""
    return (not settings.INTERPRETED and q.is_cuda and settings.compile_ahead_enabled() and q.numel() > 0
            and k.numel() > 0 and q.numel() * q.element_size() <= MAX_INPUT_BYTES
            and not torch.cuda.is_current_stream_capturing())


def submit_backward(inputs, gluon):
    """Compile the backward of a forward on ``inputs`` (as backward_key's) in the background, unless its
    specialisation was submitted before in this process. Call before the forward's launch, on the stream the
    backward will use."""
    global _latest
    q, k = inputs[:2]
    if not wanted(q, k):
        return
    key = cached_backward_key(inputs, gluon)
    if key in _jobs:
        return
    stream, worker = torch.cuda.current_stream(q.device), _executor("compile-ahead", 1)
    with _jobs_lock:
        if key in _jobs:
            return
        if len(_jobs) >= MAX_KEYS:
            for done in [seen for seen, job in _jobs.items() if job.done()]:
                del _jobs[done]
        try:
            _jobs[key] = _latest = worker.submit(_compile_backward, stream, inputs, gluon)
        except RuntimeError:  # the interpreter is exiting: the backward, if any, compiles its own kernels
            pass


def wait_for_backward(inputs, gluon):
    """Before a backward's first launch: wait (at most WAIT_S) for its specialisation's job, if one runs."""
    latest = _latest
    if latest is None or latest.done():
        return
    job = _jobs.get(cached_backward_key(inputs, gluon))
    if job is not None and not job.done():
        concurrent.futures.wait([job], timeout=WAIT_S)


def _concurrent_compiles():
    """Triton's AsyncCompileMode over a thread pool (its compiles finish, into the JIT caches, on exit), or
    nothing where this Triton lacks it (the compiles then run one after another, still off the main thread)."""
    try:
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:
        return contextlib.nullcontext()
    return AsyncCompileMode(_executor("compile", COMPILE_THREADS))


def _compile_backward(stream, inputs, gluon):
    """The backward's launch code in compile-only mode on the forward's inputs, with fresh outputs (nothing
    runs on them) on the forward's stream; a failure is the backward's to meet again, not this thread's."""
    from .flash_bwd import attention_backward
    from .flash_fwd import lse_shape

    (q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, dropout_seed, max_seqlen_q, max_seqlen_k, softmax_scale,
     window_left, window_right, softcap, dropout_p, deterministic) = inputs
    try:
        # Only compiles: the launchers stay for the backward's first launch to load. Triton names every launcher
        # module __triton_launcher, and CPython (as we read it) re-imports a launcher loaded before into the module
        # object of that name, so two threads loading launchers at once can hand one kernel another's launch
        # function ("function takes exactly 71 arguments (58 given)", seen on the H200 while the forward loaded its
        # own).
        with torch.cuda.device(q.device), torch.cuda.stream(stream), compile_only():
            try:
                with _concurrent_compiles():
                    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # as launch.new_output's
                    lse = torch.empty(lse_shape(q, cu_seqlens_q is not None), dtype=torch.float32, device=q.device)
                    attention_backward(out, None, q, k, v, out, lse, softmax_scale, window_left, window_right,
                                       softcap, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, deterministic,
                                       alibi_slopes=alibi_slopes, dropout_p=dropout_p, dropout_seed=dropout_seed,
                                       gluon=gluon)
            except WouldAutotune:  # the backward autotunes the rest itself
                pass
    except Exception as error:  # noqa: BLE001  (the backward compiles what this did not)
        logger.debug("compiling the backward ahead stopped: %r", error)
