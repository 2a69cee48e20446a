"""Every environment variable the kernels read, read here only (README.md lists them for users).

* ``TRITON_INTERPRET=1``: Triton's interpreter runs the kernels on CPU. Read once, at import, as
  Triton itself reads it when the kernels are defined.
* ``FLASHFORMER_KERNEL=auto|gluon|triton|torch``: forces interface.kernel_impl's choice. Read per
  call, so that a process (a test, a benchmark) can switch it.
* ``FLASHFORMER_AUTOTUNE=0``: launches the offline table does not cover take a default config
  instead of the autotuner. Read per call.
* ``FLASHFORMER_COMPILE_AHEAD=0``: a forward whose inputs need gradients no longer compiles its backward's
  kernels in a background thread (compile_ahead.py). Read per call.
* ``FLASHFORMER_DIRECT_LAUNCH=0``: every launch goes through Triton's own launch path (argument binding,
  specialisation keys, hooks) instead of launch.CompiledLaunch's direct call of its C launcher after the
  first. Read once, at import.
* ``FLASHFORMER_POISON=1``: outputs start NaN-filled, so that a test catches any element a kernel
  forgets to write. Read once, at import: a decoding step allocates four outputs, and an environment
  lookup costs ~2 µs (launch.POISON_OUTPUTS is the switch afterwards).
"""

from __future__ import annotations

import os

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
POISON_AT_IMPORT = os.environ.get("FLASHFORMER_POISON") == "1"
DIRECT_LAUNCH = os.environ.get("FLASHFORMER_DIRECT_LAUNCH", "1") != "0"


def _major_minor(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


def check_interpreter_numpy(triton_version: str, numpy_version: str) -> None:
    """Triton before 3.8 interprets a loop bound by calling int() on a one-element array, which numpy 2.4
    made an error: name the pin here rather than fail inside the first interpreted kernel."""
    if _major_minor(triton_version) < (3, 8) and _major_minor(numpy_version) >= (2, 4):
        raise RuntimeError(f"TRITON_INTERPRET=1 with triton {triton_version} needs numpy<2.4 (found "
                           f"{numpy_version}): pip install \"numpy<2.4\", or triton>=3.8")


if INTERPRETED:
    import numpy
    import triton

    check_interpreter_numpy(triton.__version__, numpy.__version__)


def forced_kernel() -> str:
    """FLASHFORMER_KERNEL, "auto" when unset."""
    return os.environ.get("FLASHFORMER_KERNEL", "auto")


def autotune_enabled() -> bool:
    """Whether FLASHFORMER_AUTOTUNE leaves the autotuner on (any value but "0")."""
    return os.environ.get("FLASHFORMER_AUTOTUNE", "1") != "0"


def compile_ahead_enabled() -> bool:
    """Whether FLASHFORMER_COMPILE_AHEAD leaves compile-ahead on (any value but "0")."""
    return os.environ.get("FLASHFORMER_COMPILE_AHEAD", "1") != "0"
