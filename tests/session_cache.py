"""Test data that one session builds once, whichever pytest-xdist worker asks for it first."""

import fcntl
import os
import shutil


def built_once(tmp_path_factory, name, build):
    """A directory that ``build`` fills once per test session. pytest-xdist's workers share it: the first to
    take its lock builds it, the others wait and reuse it (worksteal may hand one module's tests to both).

    Args:
        tmp_path_factory: pytest's session-scoped factory.
        name: the directory's name, unique to what it holds.
        build: called with an empty directory to fill; the directory appears under ``name`` only when it returns.
    """
    root = tmp_path_factory.getbasetemp()
    if "PYTEST_XDIST_WORKER" in os.environ:
        root = root.parent  # the session's directory, above each worker's own
    directory = root / name
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not directory.is_dir():
            partial = root / f"{name}.partial"  # a failed build leaves no directory that looks finished
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir()
            build(partial)
            partial.rename(directory)
    return directory
