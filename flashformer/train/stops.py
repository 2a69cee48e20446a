"""How a run ends early: stop signals, non-finite losses, and the exit codes that say which.

    with StopRequests() as stop:      # SIGINT / SIGTERM set stop.signal; the loop checkpoints and stops
        ...
"""

from __future__ import annotations

import contextlib
import math
import signal
import sys
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

INTERRUPTED_EXIT_CODE = 128 + signal.SIGINT  # the shell's code for a process ended by a signal: 128 + its number
NONFINITE_EXIT_CODE = 3


class NonFiniteLossError(RuntimeError):
    """More steps in a row than ``max_nonfinite_skips`` had a NaN or infinite loss or gradient norm;
    nothing after the last checkpoint was saved."""


class Interrupted(BaseException):
    """SIGINT / SIGTERM while a run was set up (tokenizing, loading): it stops with nothing to save.

    A BaseException, as KeyboardInterrupt is: the writes it interrupts clean up after themselves, and no
    ``except Exception`` swallows it.
    """

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name} before the first step: nothing to save")
        self.exit_code = 128 + signum


@contextlib.contextmanager
def interrupts_raise():
    """Inside the block SIGINT and SIGTERM raise Interrupted (SIGTERM would otherwise end the process
    at once, leaving a half-written token cache and an empty run directory behind). Code that swallows it
    does not keep the run going: datasets catches everything while it hashes a transform for its cache
    fingerprint, so a signal that lands there is raised again when the block ends."""
    received = []

    def interrupt(signum, frame):
        received.append(signum)
        raise Interrupted(signum)

    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
        if received:
            raise Interrupted(received[0])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@dataclass
class TrainResult:
    """What a run ended with; losses are None where none was computed, stop_signal where a signal stopped it."""

    step: int
    train_loss: float | None
    eval_loss: float | None
    interrupted: bool
    run_dir: str
    stop_signal: int | None = None

    @property
    def exit_code(self) -> int:
        """0, or 128 + the signal that stopped the run (130 for Ctrl-C, 143 for SIGTERM), as a shell reports it."""
        return 128 + self.stop_signal if self.stop_signal else 0


class StopRequests:
    """Turns SIGINT / SIGTERM into a signal number the loop checks between steps; a second Ctrl-C aborts."""

    def __init__(self):
        self.signal = 0
        self._previous = {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.signal and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signal = signum
        tqdm.write(f"{signal.Signals(signum).name}: saving a checkpoint after this step (with several "
                   "processes, the next), then exiting (Ctrl-C again aborts)", file=sys.stderr)

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class StepFlags:
    """A step's [stop signal, non-finite loss or grad norm], maxed over the ranks, read when the host
    waits anyway or one step late.

    Reading a device value waits for everything queued before it. A pinned copy behind an event lets
    the host wait for the step the flags belong to, while the GPU runs the step queued after it.
    """

    def __init__(self, step: int, flags: torch.Tensor, loss: torch.Tensor, grad_norm: torch.Tensor):
        self.step, self.loss, self.grad_norm = step, loss, grad_norm
        self.event = None
        if flags.is_cuda:
            self.flags = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
            self.flags.copy_(flags, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.flags = flags

    def read(self) -> tuple[int, bool]:
        if self.event is not None:
            self.event.synchronize()
        return int(self.flags[0]), bool(self.flags[1])

    def problem(self) -> str:
        """What was not finite, e.g. "the loss is nan" (once ``read`` said something was)."""
        values = {"loss": self.loss.item(), "gradient norm": self.grad_norm.item()}
        bad = " and ".join(f"the {name} is {value}" for name, value in values.items() if not math.isfinite(value))
        return bad or "another rank's loss or gradient norm is not finite"


class SkippedSteps:
    """Counts the steps that changed nothing for a NaN / inf loss or gradient norm: all of a run's, and
    those in a row; more than ``limit`` in a row stop the run.

    Args:
        limit: ``max_nonfinite_skips``.
    """

    def __init__(self, limit: int):
        self.limit, self.total, self.in_a_row = limit, 0, 0  # a resumed run sets total to its checkpoint's

    def count(self, flags: StepFlags, skipped: bool, advice) -> str | None:
        """Count the step of ``flags`` (skipped or not); returns the warning of a skipped one.

        Raises:
            NonFiniteLossError: past the limit, naming the step and what was not finite, then ``advice()``.
        """
        if not skipped:
            self.in_a_row = 0
            return None
        self.total += 1
        self.in_a_row += 1
        if self.in_a_row > self.limit:
            in_a_row = f" ({self.in_a_row} steps in a row, max_nonfinite_skips={self.limit})" if self.limit else ""
            raise NonFiniteLossError(f"step {flags.step}: {flags.problem()}{in_a_row}, so training stopped. {advice()}")
        return (f"warning: step {flags.step}: {flags.problem()}: skipped (no update), {self.in_a_row} in a row "
                f"(max_nonfinite_skips={self.limit})")
