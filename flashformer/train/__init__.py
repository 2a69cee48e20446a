"""Training: ``flashformer train CONFIG.yaml key=value ...``.

    cfg = load_train_config("configs/tiny.yaml", ["optim.lr=3e-4"])
    result = train(cfg)

config.py   the recipe (TrainConfig and its sections), overrides, what may change on resume
step.py     one optimizer step (shared with context parallelism and the memory sweep), the schedule
loop.py     the Trainer: setup, the loop, evaluation, checkpoints
run_dir.py  the run directory (created, locked, cleaned) and the checkpoints a run starts from
stops.py    how a run ends early: stop signals, non-finite losses, exit codes
state.py    the run directory: checkpoints, RNG states, its lock, leftovers of killed writes
metrics.py  metrics.jsonl (append-only), loss.png
"""

from .config import OptimConfig, SampleConfig, TrainConfig, load_train_config
from .loop import CHUNKED_LOSS_MIN_SEQ_LEN, Trainer, train
from .metrics import METRICS_FILE, abridged, plot_losses, read_metrics
from ..weights import latest_checkpoint
from .state import LOCK_FILE, TRAINER_STATE_FILE, RunDirLocked, RunLock
from .step import lm_loss, lr_factor, train_step
from .stops import INTERRUPTED_EXIT_CODE, NONFINITE_EXIT_CODE, Interrupted, NonFiniteLossError, TrainResult

__all__ = [
    "CHUNKED_LOSS_MIN_SEQ_LEN", "INTERRUPTED_EXIT_CODE", "Interrupted", "LOCK_FILE", "METRICS_FILE",
    "NONFINITE_EXIT_CODE", "NonFiniteLossError", "OptimConfig", "RunDirLocked", "RunLock", "SampleConfig",
    "TRAINER_STATE_FILE", "TrainConfig", "TrainResult", "Trainer", "abridged", "latest_checkpoint", "lm_loss",
    "load_train_config", "lr_factor", "plot_losses", "read_metrics", "train", "train_step",
]
