"""Token caches -> deterministic, resumable training batches (fixed rows or packed documents).

    train, held_out = data.load_corpus(cfg.data, tokenizer)
    batches = TrainBatches(train, cfg.data, global_batch=32, micro_batch=8)
    for micro_batch in batches.next_step(): ...                 # batches.position goes into checkpoints
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from .data import DataConfig, DataError, TokenCorpus

IGNORE_INDEX = -100  # a target without a loss (chat data's non-assistant tokens): cross_entropy's default


@dataclass
class Batch:
    """One micro batch. input_ids, targets, position_ids: (batch, seq_len) int64 (targets IGNORE_INDEX where a
    token has no loss); cu_seqlens: int32 (n_segments + 1,) document boundaries over the flattened
    batch*seq_len tokens (packed only; under context parallelism, where each rank holds a slice of the rows,
    those of the whole rows)."""

    input_ids: torch.Tensor
    targets: torch.Tensor
    position_ids: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | None = None
    max_seqlen: int | None = None

    def to(self, device) -> Batch:
        """The batch with its tensors on ``device``."""
        return dataclasses.replace(
            self,
            **{
                f.name: getattr(self, f.name).to(device, non_blocking=True)
                for f in dataclasses.fields(self)
                if isinstance(getattr(self, f.name), torch.Tensor)
            },
        )

    def model_kwargs(self) -> dict:
        """Keyword arguments for ``model(input_ids, **kwargs)``."""
        return {"position_ids": self.position_ids, "cu_seqlens": self.cu_seqlens, "max_seqlen": self.max_seqlen}


def _rows(corpus: TokenCorpus, starts: np.ndarray, seq_len: int, packed: bool) -> Batch:
    """The batch of windows ``corpus.tokens[s : s + seq_len + 1]`` for s in ``starts``."""
    windows = np.stack([np.asarray(corpus.tokens[s : s + seq_len + 1], dtype=np.int64) for s in starts])
    windows = torch.from_numpy(windows)
    # clone, not contiguous(): a single row's slices are contiguous views sharing the window's memory, and
    # masking the targets would then write IGNORE_INDEX into the input ids.
    batch = Batch(input_ids=windows[:, :-1].clone(), targets=windows[:, 1:].clone())
    if corpus.loss_mask is not None:
        learned = np.stack([np.asarray(corpus.loss_mask[s + 1 : s + seq_len + 1], dtype=bool) for s in starts])
        batch.targets[~torch.from_numpy(learned)] = IGNORE_INDEX
    if not packed:
        return batch
    # Segments start at every row start and at every document start inside a row; an EOS closes its
    # document, so its target (the next document's first token) is predicted from the document it ends.
    boundaries, position_ids = [], np.empty((len(starts), seq_len), dtype=np.int64)
    for row, start in enumerate(starts):
        first, last = np.searchsorted(corpus.doc_starts, [start + 1, start + seq_len], side="left")
        row_starts = np.concatenate([[0], corpus.doc_starts[first:last] - start])
        lengths = np.diff(np.append(row_starts, seq_len))
        position_ids[row] = np.arange(seq_len) - np.repeat(row_starts, lengths)
        boundaries.append(row_starts + row * seq_len)
    boundaries.append([len(starts) * seq_len])
    cu_seqlens = np.concatenate(boundaries).astype(np.int32)
    batch.position_ids = torch.from_numpy(position_ids)
    batch.cu_seqlens = torch.from_numpy(cu_seqlens)
    batch.max_seqlen = int(np.diff(cu_seqlens).max())
    return batch


def num_windows(corpus: TokenCorpus, seq_len: int) -> int:
    """How many rows of seq_len + 1 tokens (overlapping by one, so each token is a target once) fit."""
    return max(0, (corpus.num_tokens - 1) // seq_len)


class TrainBatches:
    """Deterministic, resumable stream of training micro batches.

    Row ``i`` of the run (counting over all ranks, steps and epochs) is window
    ``permutation(seed, epoch)[i % num_windows]``; ``position`` (rows consumed) is the whole
    state. Each optimizer step takes the next ``global_batch`` rows; rank r's micro batch m
    holds rows ``m * micro_batch * world_size + r * micro_batch + [0, micro_batch)``, so the
    global batch is the same for any number of ranks.
    """

    def __init__(self, corpus: TokenCorpus, cfg: DataConfig, global_batch: int, micro_batch: int, seed: int,
                 rank: int = 0, world_size: int = 1, position: int = 0):
        if global_batch % (micro_batch * world_size):
            raise DataError(f"batch_size {global_batch} is not a multiple of micro_batch_size {micro_batch} "
                            f"x {world_size} ranks")
        self.corpus, self.seq_len, self.packed = corpus, cfg.seq_len, cfg.packing == "packed"
        self.global_batch, self.micro_batch, self.seed = global_batch, micro_batch, seed
        self.rank, self.world_size, self.position = rank, world_size, position
        self.num_windows = num_windows(corpus, cfg.seq_len)
        if self.num_windows < 1:
            raise DataError(f"the training corpus ({corpus.num_tokens} tokens) is shorter than one row "
                            f"of seq_len={cfg.seq_len}")
        self._epoch, self._order = -1, None

    @property
    def grad_accum_steps(self) -> int:
        return self.global_batch // (self.micro_batch * self.world_size)

    def _window_starts(self, rows: range) -> np.ndarray:
        starts = []
        for row in rows:
            epoch, index = divmod(row, self.num_windows)
            if epoch != self._epoch:
                self._epoch = epoch
                self._order = np.random.default_rng([self.seed, epoch]).permutation(self.num_windows)
            starts.append(int(self._order[index]) * self.seq_len)
        return np.asarray(starts, dtype=np.int64)

    def next_step(self) -> list[Batch]:
        """This rank's micro batches (grad_accum_steps of them) for the next optimizer step."""
        batches = []
        for micro in range(self.grad_accum_steps):
            first = self.position + (micro * self.world_size + self.rank) * self.micro_batch
            starts = self._window_starts(range(first, first + self.micro_batch))
            batches.append(_rows(self.corpus, starts, self.seq_len, self.packed))
        self.position += self.global_batch
        return batches


def eval_batches(corpus: TokenCorpus, cfg: DataConfig, num_rows: int, micro_batch: int,
                 rank: int = 0, world_size: int = 1) -> list[Batch]:
    """This rank's share of the fixed eval set, in micro batches.

    The eval set is the first ``num_rows`` windows of ``corpus`` in order (fewer if the corpus is
    short); rank r takes every world_size-th row, so the set does not depend on the number of ranks.
    Under FSDP every rank must run the same forwards: a share one row short ends with a filler row
    whose targets are all IGNORE_INDEX, which adds nothing to the loss or its token count.
    """
    total = min(num_windows(corpus, cfg.seq_len), num_rows)
    if total < 1:
        raise DataError(f"the eval corpus ({corpus.num_tokens} tokens) is shorter than one row of "
                        f"seq_len={cfg.seq_len}")
    rows = np.arange(rank, total, world_size)
    fillers = -(-total // world_size) - len(rows)
    rows = np.concatenate([rows, np.zeros(fillers, dtype=rows.dtype)])
    batches = [
        _rows(corpus, rows[i : i + micro_batch] * cfg.seq_len, cfg.seq_len, cfg.packing == "packed")
        for i in range(0, len(rows), micro_batch)
    ]
    if fillers:
        batches[-1].targets[-fillers:] = IGNORE_INDEX
    return batches
