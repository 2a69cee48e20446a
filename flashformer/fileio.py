"""Crash-safe file writes: a reader (or a resumed run after a crash) sees either the previous complete
file / directory or the new complete one, never a mixture.

The bottom of flashformer's import layers (it imports nothing of ours): configs, data caches,
tokenizers and checkpoints all write through it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile


def _fsync_directory(path) -> None:
    """Persist a rename inside ``path`` (a no-op where directories cannot be opened, e.g. Windows)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_file(path, write_fn) -> None:
    """Write a file so that ``path`` holds either its old content or the complete new one.

    Args:
        path: destination file.
        write_fn: called with a binary file object opened on a temporary file in the same directory.
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp_path = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            write_fn(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_path, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp_path)
        raise
    _fsync_directory(directory)


@contextlib.contextmanager
def atomic_directory(final_dir):
    """Build a directory next to ``final_dir`` and move it into place only if the block succeeds.

    Yields the temporary directory path. On success its files are fsynced and it replaces
    ``final_dir`` (an existing one is first renamed aside, then deleted, so a crash leaves either
    the old or the new directory under a recognisable name). On an exception it is removed.
    """
    final_dir = os.path.abspath(os.fspath(final_dir))
    parent = os.path.dirname(final_dir)
    os.makedirs(parent, exist_ok=True)
    tmp_dir = tempfile.mkdtemp(prefix=f".{os.path.basename(final_dir)}.", suffix=".tmp", dir=parent)
    try:
        yield tmp_dir
        for root, _, files in os.walk(tmp_dir):
            for name in files:
                with open(os.path.join(root, name), "rb") as f:
                    os.fsync(f.fileno())
            _fsync_directory(root)
        old_dir = None
        if os.path.exists(final_dir):
            old_dir = tempfile.mkdtemp(prefix=f".{os.path.basename(final_dir)}.", suffix=".old", dir=parent)
            os.rmdir(old_dir)
            os.replace(final_dir, old_dir)
        os.replace(tmp_dir, final_dir)
        _fsync_directory(parent)
        if old_dir is not None:
            shutil.rmtree(old_dir, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
