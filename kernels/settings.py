"""Every environment variable the kernels read, read here only (README.md lists them for users).

* ``TRITON_INTERPRET=1``: Triton's interpreter runs the kernels on CPU. Read once, at import, as
  Triton itself reads it when the kernels are defined.
* ``FLASHFORMER_KERNEL=auto|gluon|triton|torch``: forces interface.kernel_impl's choice. Read per
  call, so that a process (a test, a benchmark) can switch it.
* ``FLASHFORMER_AUTOTUNE=0``: launches the offline table does not cover take a default config
  instead of the autotuner. Read per call.
* ``FLASHFORMER_POISON=1``: outputs start NaN-filled, so that a test catches any element a kernel
  forgets to write. Read once, at import: a decoding step allocates four outputs, and an environment
  lookup costs ~2 µs (launch.POISON_OUTPUTS is the switch afterwards).
"""

from __future__ import annotations

import os

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
POISON_AT_IMPORT = os.environ.get("FLASHFORMER_POISON") == "1"


def forced_kernel() -> str:
    """FLASHFORMER_KERNEL, "auto" when unset."""
    return os.environ.get("FLASHFORMER_KERNEL", "auto")


def autotune_enabled() -> bool:
    """Whether FLASHFORMER_AUTOTUNE leaves the autotuner on (any value but "0")."""
    return os.environ.get("FLASHFORMER_AUTOTUNE", "1") != "0"
