"""Crash-safe file writes: a reader (or a resumed run after a crash) sees either the previous complete
file / directory or the new complete one, never a mixture.

The bottom of flashformer's import layers (it imports nothing of ours): configs, data caches,
tokenizers and checkpoints all write through it. A write the operating system refuses (a full disk, a
file-size limit, a read-only disk) raises WriteError, which names the path and the error.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import shutil
import tempfile

# The errors of a write that no retry fixes, and what usually causes each.
_WRITE_FAILURES = {
    errno.ENOSPC: "the disk is full",
    errno.EDQUOT: "the disk quota is used up",
    errno.EFBIG: "the file outgrew the file-size limit (`ulimit -f`) or the file system's",
    errno.EROFS: "the file system is read-only",
    errno.EIO: "the disk reported an I/O error",
}


class WriteError(OSError):
    """The operating system refused a write; the message names the path, the error and its usual cause.

    Args:
        message: the whole message (``str`` of the error).
        errno: the operating system's error number.
    """

    def __init__(self, message: str, errno: int | None = None):
        super().__init__(message)
        self.errno = errno


def _os_error(error: BaseException | None) -> OSError | None:
    """The operating system's error behind ``error``: itself, one it was raised over (torch.save raises a
    RuntimeError over its file's OSError), or the "(os error N)" in the message of safetensors' Rust writer."""
    while error is not None:
        if isinstance(error, OSError) and not isinstance(error, WriteError):
            return error
        number = re.search(r"\(os error (\d+)\)", str(error))
        if number:
            return OSError(int(number.group(1)), os.strerror(int(number.group(1))))
        error = error.__cause__ or error.__context__
    return None


def raise_write_error(path, error: BaseException) -> None:
    """Raise ``error`` as a WriteError naming ``path`` when the operating system refused a write (one of
    _WRITE_FAILURES); return otherwise, for the caller to re-raise ``error`` itself.

    Args:
        path: the file or directory being written.
        error: what the write raised.
    """
    cause = _os_error(error)
    if cause is None or cause.errno not in _WRITE_FAILURES:
        return
    raise WriteError(f"could not write {os.fspath(path)}: {cause.strerror} ({errno.errorcode[cause.errno]}: "
                     f"{_WRITE_FAILURES[cause.errno]})", cause.errno) from error


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


# mkstemp's flags: O_BINARY (Windows only) keeps the C runtime from translating newlines in what is written.
_NEW_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)


def _create_beside(directory, final_name, create):
    """A fresh ``.<final_name>.<random>.tmp`` entry in ``directory``, made by ``create(path)`` (os.mkdir, or an
    exclusive os.open), as (path, what create returned). The name is fixed before the entry exists, so that an
    interrupt landing as it is made (a signal handler that raises: train.stops) still finds it to remove, where
    mkstemp / mkdtemp would raise it with the name unknown to their caller."""
    while True:
        path = os.path.join(directory, f".{final_name}.{secrets.token_hex(4)}.tmp")
        try:
            return path, create(path)
        except FileExistsError:  # another writer's name: not ours to remove
            continue
        except BaseException:
            if os.path.lexists(path):  # made before the interrupt landed
                (os.rmdir if os.path.isdir(path) else os.remove)(path)
            raise


def atomic_write_file(path, write_fn) -> None:
    """Write a file so that ``path`` holds either its old content or the complete new one.

    Args:
        path: destination file.
        write_fn: called with a binary file object opened on a temporary file in the same directory.
    Raises:
        WriteError: the operating system refused the write (``path`` keeps its old content).
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    tmp_path, fd = _create_beside(directory, os.path.basename(path),
                                  lambda name: os.open(name, _NEW_FILE_FLAGS, 0o600))
    try:
        with os.fdopen(fd, "wb") as f:
            write_fn(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_path, path)
    except BaseException as error:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp_path)
        raise_write_error(path, error)
        raise
    _fsync_directory(directory)


@contextlib.contextmanager
def atomic_directory(final_dir, keep_existing=False):
    """Build a directory next to ``final_dir`` and move it into place only if the block succeeds.

    Yields the temporary directory path. On success its files are fsynced and it replaces
    ``final_dir`` (an existing one is first renamed aside, then deleted, so a crash leaves either
    the old or the new directory under a recognisable name). On an exception it is removed; an error
    of the operating system refusing a write is raised as a WriteError naming ``final_dir``.

    Args:
        keep_existing: for content named by its own key (a token cache), where a ``final_dir`` that exists
            by the end holds what this block built: another process that built it first wins, this build is
            discarded, and readers of ``final_dir`` never see it missing.
    """
    final_dir = os.path.abspath(os.fspath(final_dir))
    parent = os.path.dirname(final_dir)
    os.makedirs(parent, exist_ok=True)
    tmp_dir, _ = _create_beside(parent, os.path.basename(final_dir), lambda name: os.mkdir(name, 0o700))
    try:
        yield tmp_dir
        for root, _, files in os.walk(tmp_dir):
            for name in files:
                with open(os.path.join(root, name), "rb") as f:
                    os.fsync(f.fileno())
            _fsync_directory(root)
        if keep_existing:
            try:
                os.rename(tmp_dir, final_dir)  # refused (ENOTEMPTY / EEXIST) where another build landed first
            except OSError as error:
                if error.errno not in (errno.ENOTEMPTY, errno.EEXIST) or not os.path.isdir(final_dir):
                    raise
                shutil.rmtree(tmp_dir, ignore_errors=True)
            _fsync_directory(parent)
            return
        old_dir = None
        if os.path.exists(final_dir):
            old_dir = tempfile.mkdtemp(prefix=f".{os.path.basename(final_dir)}.", suffix=".old", dir=parent)
            os.rmdir(old_dir)
            os.replace(final_dir, old_dir)
        os.replace(tmp_dir, final_dir)
        _fsync_directory(parent)
        if old_dir is not None:
            shutil.rmtree(old_dir, ignore_errors=True)
    except BaseException as error:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise_write_error(final_dir, error)
        raise

