"""A run directory's durable state: checkpoints, RNG states, and the lock that keeps one run in it.

    with RunLock(run_dir):                 # one process trains in a run directory at a time
        clean_stale_writes(run_dir)        # what killed checkpoint / file writes left behind
        latest = latest_checkpoint(run_dir)

A checkpoint ``ckpt-<step>/`` holds the weights as ``save_pretrained`` writes them (under LoRA only the
adapters, as ``lora.write_adapter_files`` writes them) plus ``trainer_state.pt`` (optimizer, scheduler,
RNG states, data position, step, config).
"""

from __future__ import annotations

import json
import os
import pickle
import random
import re
import shutil
import socket
import sys
import time

import numpy as np
import torch

from ..fileio import atomic_directory
from ..lora import LoRAConfig, load_adapter_weights, read_adapter, write_adapter_files
from ..parallel import load_model_state_dict
from ..weights import CHECKPOINT_NAME, CheckpointError, checkpoint_steps, read_weights, write_pretrained_files
from ..config import ConfigError

try:
    import fcntl
except ImportError:  # Windows: no flock; runs there go unlocked
    fcntl = None

TRAINER_STATE_FILE = "trainer_state.pt"
LOCK_FILE = ".lock"
# atomic_directory / atomic_write_file build ".<final name>.<random>.tmp" beside their target, and move a
# replaced directory aside as ".<final name>.<random>.old" until the new one is in place.
_TEMPORARY_NAME = re.compile(r"^\.(.+)\.[A-Za-z0-9_]+\.(tmp|old)$")


class RunDirLocked(ConfigError):
    """Another live process trains in this run directory."""


class RunLock:
    """An exclusive ``flock`` on ``<run_dir>/.lock`` while a process trains there.

    The kernel drops the lock when the process ends, however it ends, so a killed run never leaves a
    stale lock. Re-entrant within one process (finetune-long holds it around the Trainer, which takes
    it too); the file stays (deleting it would let two processes lock two different files).

    Args:
        run_dir: an existing directory.
    Raises:
        RunDirLocked: on ``acquire``, naming the holder's pid, host and command.
    """

    _held: dict[str, list] = {}  # real path -> [file descriptor, holders in this process]

    def __init__(self, run_dir: str):
        self.run_dir = run_dir
        self.path = os.path.join(run_dir, LOCK_FILE)
        self._key = None

    def acquire(self) -> RunLock:
        key = os.path.realpath(self.path)
        if key in RunLock._held:
            RunLock._held[key][1] += 1
        else:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                if fcntl is not None:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_holder(fd)
                os.close(fd)
                raise RunDirLocked(_locked_message(self.run_dir, holder)) from None
            os.ftruncate(fd, 0)
            os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                     "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                                     "command": " ".join(sys.argv)}).encode())
            RunLock._held[key] = [fd, 1]
        self._key = key
        return self

    def release(self) -> None:
        """Give the lock up (the last holder in this process closes the file, which unlocks it)."""
        if self._key is None:
            return
        held = RunLock._held[self._key]
        held[1] -= 1
        if held[1] == 0:
            del RunLock._held[self._key]
            os.close(held[0])
        self._key = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _read_holder(fd: int) -> dict:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        return json.loads(os.read(fd, 65536).decode() or "{}")
    except (OSError, ValueError):
        return {}


def _locked_message(run_dir: str, holder: dict) -> str:
    pid, host = holder.get("pid", "?"), holder.get("host", "?")
    where = "this host" if host == socket.gethostname() else f"host {host}"
    return (f"{run_dir} is in use by another run: pid {pid} on {where} (started {holder.get('started', '?')}: "
            f"{holder.get('command', '?')}). Wait for it to finish, or stop it (`kill {pid}` saves a checkpoint) "
            f"and then resume with `flashformer train --resume {run_dir}`; or train elsewhere with another "
            f"out_dir=/name=")


def clean_stale_writes(run_dir: str) -> list[str]:
    """Remove the temporaries of writes that a kill interrupted; call it holding the run's lock.

    A checkpoint moved aside (``.ckpt-N.*.old``) whose replacement never arrived is the complete
    previous ``ckpt-N``: it is moved back instead.

    Returns:
        The names removed or restored.
    """
    cleaned = []
    for name in sorted(os.listdir(run_dir)):
        match = _TEMPORARY_NAME.match(name)
        if match is None:
            continue
        path, final = os.path.join(run_dir, name), os.path.join(run_dir, match.group(1))
        if match.group(2) == "old" and CHECKPOINT_NAME.match(match.group(1)) and not os.path.exists(final):
            os.replace(path, final)
        elif os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.remove(path)
        cleaned.append(name)
    return cleaned


def write_checkpoint(path: str, model, tokenizer, state: dict, lora: LoRAConfig | None = None,
                     base_dir: str | None = None, adapters: dict | None = None) -> None:
    """Write weights, tokenizer and ``state`` as the checkpoint directory ``path``, atomically.

    Args:
        path: ``<run_dir>/ckpt-<step>``; replaced if it exists.
        model: the unsharded Transformer (under ``lora`` the adapted one, possibly sharded: only its config is read).
        tokenizer: saved beside the weights (generation and fine-tuning reuse it).
        state: the trainer state (``trainer_state.pt``).
        lora, base_dir, adapters: for a model adapted with ``lora``: only its adapters are written (the
            ``adapters`` tensors, whole), with a record of the base checkpoint ``base_dir``.
    Raises:
        fileio.WriteError: the disk refused the write (full, a file-size limit, read-only); nothing of the
            new checkpoint is left behind and an older one is untouched.
    """
    with atomic_directory(path) as tmp:
        if lora is not None:
            write_adapter_files(adapters, model.config, tmp, lora, base_dir)
            tokenizer.save(tmp)
        else:
            write_pretrained_files(model, tmp, tokenizer=tokenizer)
        # Through a Python file: its OSError (a full disk) stays in the chain of the error torch.save raises,
        # where a path's C++ stream would report only "file write failed".
        with open(os.path.join(tmp, TRAINER_STATE_FILE), "wb") as f:
            torch.save(state, f)


def load_checkpoint_weights(model, checkpoint: str, adapters_only: bool = False) -> None:
    """Copy the weights of ``checkpoint`` (a ``write_checkpoint`` directory) into the model training now.

    Args:
        model: the unwrapped Transformer, under FSDP sharded in place; its shapes are the checkpoint's.
        adapters_only: a LoRA run's checkpoint: only the adapters (and trained norms) are in it.
    """
    if adapters_only:
        load_adapter_weights(model, read_adapter(checkpoint)[1], checkpoint)
    else:
        load_model_state_dict(model, read_weights(checkpoint))


def prune_checkpoints(run_dir: str, keep: int) -> None:
    """Delete all but the newest ``keep`` checkpoints (the trainer saves only finite ones)."""
    for old in checkpoint_steps(run_dir)[:-keep]:
        shutil.rmtree(os.path.join(run_dir, f"ckpt-{old}"), ignore_errors=True)


def read_trainer_state(checkpoint: str) -> dict:
    """The ``trainer_state.pt`` of a checkpoint directory, on CPU; CheckpointError naming the file, and
    the older checkpoint to fall back to, when it is missing or unreadable."""
    path = os.path.join(checkpoint, TRAINER_STATE_FILE)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError) as error:
        run_dir = os.path.dirname(os.path.abspath(checkpoint))
        older = [step for step in checkpoint_steps(run_dir) if f"ckpt-{step}" != os.path.basename(checkpoint)]
        fallback = (f"; remove {checkpoint} to resume from ckpt-{older[-1]}" if older else
                    "; no older checkpoint in the run to fall back to")
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise CheckpointError(f"{path} is unreadable ({reason}){fallback}") from None


def capture_rng() -> dict:
    """Every RNG state training draws from, in a form ``torch.load(weights_only=True)`` accepts."""
    numpy_state = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "python": random.getstate(),
        "numpy": {"key": torch.from_numpy(numpy_state[1].astype(np.int64)), "rest": list(numpy_state[2:])},
    }


def restore_rng(state: dict) -> None:
    """Undo ``capture_rng``."""
    torch.set_rng_state(state["torch"])
    if state["cuda"]:
        torch.cuda.set_rng_state_all(state["cuda"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    np.random.set_state(("MT19937", state["numpy"]["key"].numpy().astype(np.uint32), *state["numpy"]["rest"]))


def seed_everything(seed: int) -> None:
    """Seed Python's, numpy's and torch's generators."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
