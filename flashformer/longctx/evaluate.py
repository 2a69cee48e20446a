"""Perplexity against evaluated length on held-out windows, and the per-length evaluation of one model.

    windows = held_out_windows(eval_corpus, lengths=[256, 512, 1024], count=8)
    results = evaluate_long_context(model, tokenizer, windows, prompts, batch_size=4, bf16=False, label="scaled")
"""

from __future__ import annotations

import math

import torch
from tqdm.auto import tqdm

from ..data import DataError, TokenCorpus
from ..model import Transformer
from .passkey import PasskeyPrompt, passkey_accuracy


def held_out_windows(corpus: TokenCorpus, lengths, count: int) -> dict[int, torch.Tensor]:
    """Per length n, ``count`` windows of n + 1 tokens from held-out documents: the first n + 1 tokens
    of the same chunks (consecutive, non-overlapping ``max(lengths) + 1``-token pieces that never
    cross a document boundary), so every length reads the same text.

    Args:
        corpus: the held-out split.
        lengths: context lengths to evaluate.
        count: windows wanted; fewer when the documents do not hold that many chunks.
    Returns:
        {n: (windows, n + 1) int64}.
    Raises:
        DataError: no held-out document has max(lengths) + 1 tokens.
    """
    chunk = max(lengths) + 1
    starts = []
    for doc_start, doc_end in zip(corpus.doc_starts[:-1], corpus.doc_starts[1:]):
        starts.extend(range(int(doc_start), int(doc_end) - chunk + 1, chunk))
        if len(starts) >= count:
            break
    if not starts:
        raise DataError(f"no held-out document has {chunk} tokens; evaluate shorter lengths or add long documents")
    chunks = torch.stack([torch.from_numpy(corpus.tokens[s : s + chunk].astype("int64")) for s in starts[:count]])
    return {n: chunks[:, : n + 1] for n in lengths}


@torch.no_grad()
def perplexity(model: Transformer, windows: torch.Tensor, batch_size: int, bf16: bool = False,
               desc: str = "perplexity") -> float:
    """exp(mean next-token cross-entropy) over every token of ``windows`` (num_windows, n + 1).

    Args:
        model: the model to score.
        windows: token windows; each predicts its last n tokens from the ones before.
        batch_size: windows per forward.
        bf16: run under bf16 autocast (as training did); the loss is fp32 either way.
        desc: label of the progress bar.
    """
    device = model.embed.weight.device
    total = 0.0
    for batch in tqdm(windows.split(batch_size), desc=desc, unit="batch", leave=False):
        batch = batch.to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            # Windows of equal length: the mean of batch means weighted by rows is the token mean.
            total += model.loss(batch[:, :-1], batch[:, 1:]).item() * len(batch)
    return math.exp(total / len(windows))


def evaluate_long_context(model: Transformer, tokenizer, windows: dict[int, torch.Tensor],
                          prompts: dict[int, list[PasskeyPrompt]], batch_size: int, bf16: bool,
                          label: str) -> dict[int, dict]:
    """Perplexity and passkey accuracy of ``model`` at every length of ``windows``.

    Args:
        model: the model to evaluate.
        tokenizer: decodes passkey answers.
        windows: from ``held_out_windows``.
        prompts: {length: passkey prompts}, for every length of ``windows``.
        batch_size: windows per forward.
        bf16: perplexity under bf16 autocast.
        label: prefix of the progress bars (one of MODELS).
    Returns:
        {length: {"ppl": float, "passkey": float or None (no prompt fits), "passkey_by_depth": {depth: float}}}.
    """
    model.eval()
    results = {}
    for length, length_windows in windows.items():
        by_depth = passkey_accuracy(model, tokenizer, prompts[length], desc=f"{label} passkey @ {length}")
        results[length] = {
            "ppl": perplexity(model, length_windows, batch_size, bf16, desc=f"{label} perplexity @ {length}"),
            "passkey": sum(by_depth.values()) / len(by_depth) if by_depth else None,
            "passkey_by_depth": by_depth,
        }
    return results
