"""The run directory a Trainer writes to, and the checkpoints a run starts from.

    run = RunDirectory(cfg, env)
    run.open()                             # created, writable, locked, leftovers of killed writes cleaned
    resume_from, state = run.resume_checkpoint(cfg)
    ...
    run.close()                            # the lock goes; a run that never started leaves no directory
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref

from ..checkpoint import resolve_checkpoint_dir
from ..config import ConfigError, config_to_dict
from ..parallel import DistributedEnv, barrier, raise_on_every_rank
from ..weights import CheckpointError, latest_checkpoint
from .config import TrainConfig, resume_changes, resume_refusal, saved_run_config
from .state import LOCK_FILE, RunDirLocked, RunLock, clean_stale_writes, read_trainer_state


class RunDirectory:
    """``out_dir`` while one run trains in it: its lock is held by rank 0 from ``open`` to ``close``.

    Args:
        path: the run directory (``cfg.run_dir``); created by ``open`` if missing.
        env: the process group (rank 0 locks, cleans and may remove the directory).
    """

    def __init__(self, path: str, env: DistributedEnv):
        self.path, self.env = path, env
        self.created = not os.path.exists(path)
        self.lock = None

    def open(self) -> None:
        """Create the directory, check that it is writable, lock it, and clean what killed writes left there.

        Raises:
            ConfigError: not writable; RunDirLocked (a ConfigError): another live process trains there.
        """
        try:
            os.makedirs(self.path, exist_ok=True)
            with tempfile.TemporaryFile(dir=self.path):
                pass
        except OSError as error:
            where = f" ({error.filename})" if error.filename and error.filename != self.path else ""
            raise ConfigError(f"out_dir {self.path!r} is not writable: {error.strerror or error}{where}; choose "
                              f"another out_dir= (or name=, for runs/<name>)") from None
        refused = None
        if self.env.is_main:
            try:
                self.lock = RunLock(self.path).acquire()
                weakref.finalize(self, self.lock.release)  # a Trainer dropped without close() lets go too
            except RunDirLocked as error:
                refused = error
        raise_on_every_rank(refused, RunDirLocked(f"{self.path} is in use by another run (rank 0 says by whom)"),
                            self.env)
        if self.env.is_main:
            for name in clean_stale_writes(self.path):
                print(f"{self.path}: cleaned up {name}, left by an interrupted write")
        barrier(self.env)

    def close(self, started: bool = True) -> None:
        """Release the lock (idempotent); with ``started=False``, also remove a directory that ``open``
        created and nothing but the lock went into."""
        if self.lock is not None:
            self.lock.release()
            self.lock = None
        if not started and self.created and self.env.is_main:
            try:
                if set(os.listdir(self.path)) <= {LOCK_FILE}:
                    shutil.rmtree(self.path, ignore_errors=True)
            except OSError:
                pass

    def resume_checkpoint(self, cfg: TrainConfig) -> tuple[str | None, dict | None]:
        """(the checkpoint to resume from, its trainer state), or (None, None) for a fresh start.

        Raises:
            ConfigError: checkpoints there without ``cfg.resume``, or a resumed config that changes what
                cannot change.
        """
        latest = latest_checkpoint(self.path)
        if latest is not None and not cfg.resume:
            raise ConfigError(
                f"{self.path} already holds checkpoints ({os.path.basename(latest)}): continue with "
                f"`flashformer train --resume {self.path}` (or resume=true), or choose another out_dir=/name=")
        if cfg.resume and latest is None and self.env.is_main:
            print(f"resume: no checkpoint in {self.path} yet, starting from scratch")
        if not cfg.resume or latest is None:
            return None, None
        state = read_trainer_state(latest)
        changes = resume_changes(saved_run_config(state["config"]), config_to_dict(cfg),
                                 compare_model=cfg.init_from is None)
        if changes:
            raise ConfigError(resume_refusal(changes, self.path))
        return latest, state

    def how_to_continue(self, overrides: str = "", when: str = "") -> str:
        """Which checkpoint survived a failed run, and the command that continues from it."""
        command = f"`flashformer train --resume {self.path}{overrides}`"
        latest = latest_checkpoint(self.path)
        if latest is None:
            return f"no checkpoint had been written yet: {command} starts the run again{when}"
        return f"{latest} is intact: continue from it with {command}{when}"


def init_checkpoint(cfg: TrainConfig) -> str | None:
    """The directory ``init_from`` names: a checkpoint, a run directory's latest checkpoint, or a hub id's
    snapshot; None without init_from.

    Raises:
        ConfigError: naming init_from, when it names none of these.
    """
    if cfg.init_from is None:
        return None
    try:
        return resolve_checkpoint_dir(cfg.init_from, cfg.init_revision)
    except CheckpointError as error:
        raise ConfigError(f"init_from: {error}") from None
