"""Test-session setup.

Without a GPU the Triton kernels run in Triton's interpreter, which must be switched on before
triton is first imported. The interpreter is slow, so the default path for the whole session is the
PyTorch one; tests of the Triton path ask for it with the ``triton_path`` fixture. Without a GPU the
session also runs on one CPU thread.
"""

import os
import sys
import zlib

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("FLASHFORMER_KERNEL", "torch")
    # The tests' tensors are tiny: a second OpenMP thread buys nothing, and where another process holds
    # the other core its spin-waits made a test up to eight times slower (CI has 2 cores). The variable
    # carries the same choice into the subprocesses the tests start.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

import triton  # noqa: E402  (after TRITON_INTERPRET is set)

from flashformer.kernels import interface, launch  # noqa: E402


def patch_each_launch_once():
    """Triton 3.6's interpreter patches triton.language's builtins when a kernel launches, then again at every
    call of a @triton.jit helper (tile_ops.mma, online_softmax_step, ...), although the launch's patches still
    hold: the re-patching (inspect.getmembers over tl, tl.tensor, tl.math) took over a quarter of the
    interpreted kernel tests' CPU time. Here a helper call patches only the language modules this launch has
    not patched yet; what runs is the same interpreted code."""
    import inspect

    import triton.language as tl
    from triton.runtime import interpreter

    patched = set()  # ids of the language modules patched in the running launch

    def language_modules(fn):
        return {id(value) for value in fn.__globals__.values() if inspect.ismodule(value) and value in (tl, tl.core)}

    launch_grid = interpreter.GridExecutor.__call__

    def launch_patching_once(self, *args, **kwargs):
        patched.update(language_modules(self.fn))  # what the launch itself patches
        try:
            return launch_grid(self, *args, **kwargs)
        finally:
            patched.clear()

    def call_helper(self, *args, **kwargs):
        modules = language_modules(self.fn)
        if not modules <= patched:
            interpreter._patch_lang(self.fn)
            patched.update(modules)
        try:
            return self.rewrite()(*args, **kwargs)
        except Exception as error:
            raise interpreter.InterpreterError(repr(error)) from error

    interpreter.GridExecutor.__call__ = launch_patching_once
    interpreter.InterpretedFunction.__call__ = call_helper


# Only on the Triton whose interpreter was read for this (its helper call is exactly the lines above, plus
# the re-patching); another version runs its interpreter unchanged.
if os.environ.get("TRITON_INTERPRET") == "1" and triton.__version__.startswith("3.6."):
    patch_each_launch_once()

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The Triton implementations every kernel test runs over: the portable tl kernels everywhere, and on an
# sm_90 GPU with a tested Triton also the Gluon path (Hopper kernels where written, tl for the rest).
KERNEL_PATHS = ["triton"] + (["gluon"] if DEVICE == "cuda" and interface.hopper_gluon_available(0) else [])


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: one worker per core this process may use. On a GPU machine at most 8: each worker
    holds a CUDA context, and there the tests wait on the GPU, not on a core."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return min(cores, 8) if torch.cuda.is_available() else cores


def pytest_runtest_logreport(report):
    """Name each failure the moment it is reported: a run that a time limit cuts short (a GPU session's
    call) never reaches pytest's closing summary, so without this its failures go unnamed."""
    if report.failed and "PYTEST_XDIST_WORKER" not in os.environ:  # xdist's workers report to the controller
        print(f"\nFAILED {report.nodeid} ({report.when})", file=sys.stderr, flush=True)


@pytest.fixture
def device():
    return DEVICE


@pytest.fixture(params=KERNEL_PATHS)
def triton_path(request, monkeypatch):
    """Route flash_attn_* through the Triton kernels (each of KERNEL_PATHS), with outputs NaN-poisoned
    before launch."""
    monkeypatch.setenv("FLASHFORMER_KERNEL", request.param)
    monkeypatch.setattr(launch, "POISON_OUTPUTS", True)
    return request.param


@pytest.fixture(autouse=True)
def seed_per_test(request):
    """Every test draws its own random inputs (seeded by its id), the same on every run: a failure
    reproduces, and a tolerance near its edge (the 2x rule in bf16) cannot make CI flaky."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))
