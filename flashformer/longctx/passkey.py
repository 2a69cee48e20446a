"""Passkey retrieval (Mohtashami & Jaggi 2023): prompts with a 5-digit key hidden in filler text,
greedy-decoding accuracy, and passkey examples mixed into the fine-tuning data.

    prompts = passkey_prompts(tokenizer, length=1024, depths=(0.1, 0.5, 0.9), trials=4, seed=0)
    accuracy = passkey_accuracy(model, tokenizer, prompts)        # {depth: fraction correct}
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import random
import warnings

import torch
from tqdm.auto import tqdm

from ..data import DataConfig, DataError, corpus_cache_dir, load_corpus, stdlib_source_files
from ..generate import generate
from ..model import Transformer

DEFAULT_PASSKEY_DEPTHS = (0.1, 0.5, 0.9)
PASSKEY_TRAIN_DIR = "passkey-train"

# The passkey task of Mohtashami & Jaggi (2023, "Landmark Attention"), without its preamble so that
# short contexts still hold a prompt: filler sentences, the needle somewhere inside, the question.
FILLER_SENTENCES = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.",
                    "There and back again.")
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "What is the pass key? The pass key is"


@dataclasses.dataclass
class PasskeyPrompt:
    """A passkey question. ``prompt_ids`` + ``answer_ids`` fit the requested length; the needle
    (the sentence stating the key) starts at token ``needle_start`` of the prompt."""

    passkey: str
    depth: float
    text: str
    prompt_ids: list[int]
    answer_ids: list[int]
    needle_start: int


def passkey_min_length(tokenizer, passkey: str) -> int:
    """Tokens of the shortest passkey prompt + answer: the needle and the question, no filler."""
    return (len(tokenizer.encode(NEEDLE.format(key=passkey))) + len(tokenizer.encode(f" {QUESTION}"))
            + len(tokenizer.encode(f" {passkey}")))


def build_passkey_prompt(tokenizer, length: int, depth: float, passkey: str) -> PasskeyPrompt:
    """Filler sentences with the needle placed so that ``depth`` of the prompt precedes it, then
    the question ending in "The pass key is"; the answer is `` <passkey>``.

    Args:
        tokenizer: has ``encode(str) -> list[int]``.
        length: token budget of prompt + answer.
        depth: in [0, 1]: the fraction of the prompt's tokens before the needle (as close as whole
            filler sentences allow).
        passkey: the digits to hide.
    Raises:
        ValueError: depth outside [0, 1], or ``length`` too short for the needle and the question.
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    needle = NEEDLE.format(key=passkey)
    answer_ids = tokenizer.encode(f" {passkey}")
    fixed_len = passkey_min_length(tokenizer, passkey)
    if fixed_len > length:
        raise ValueError(f"a passkey prompt needs at least {fixed_len} tokens, got length {length}")
    sentence_lens = [len(tokenizer.encode(f" {s}")) for s in FILLER_SENTENCES]
    fillers, filler_lens, used = [], [], fixed_len
    while used + sentence_lens[len(fillers) % len(FILLER_SENTENCES)] <= length:
        index = len(fillers) % len(FILLER_SENTENCES)
        fillers.append(FILLER_SENTENCES[index])
        filler_lens.append(sentence_lens[index])
        used += sentence_lens[index]
    prompt_len = used - len(answer_ids)
    prefix_lens = list(itertools.accumulate(filler_lens, initial=0))
    before = min(range(len(fillers) + 1), key=lambda n: abs(prefix_lens[n] - depth * prompt_len))
    while True:
        prefix = " ".join(fillers[:before])
        text = " ".join([*fillers[:before], needle, *fillers[before:], QUESTION])
        prompt_ids = tokenizer.encode(text)
        if len(prompt_ids) + len(answer_ids) <= length:
            break
        if not fillers:
            raise ValueError(f"a passkey prompt does not fit length {length}")
        # A subword tokenizer may split the joined text into more tokens than its pieces: drop a filler.
        fillers.pop()
        before = min(before, len(fillers))
    return PasskeyPrompt(passkey, depth, text, prompt_ids, answer_ids, len(tokenizer.encode(prefix)))


def passkey_prompts(tokenizer, length: int, depths, trials: int, seed: int) -> list[PasskeyPrompt]:
    """``trials`` prompts per depth with random 5-digit keys; the same arguments give the same prompts.

    Returns [] when ``length`` cannot hold a passkey prompt.
    """
    rng = random.Random(f"passkey-eval-{seed}-{length}")
    keys = [[str(rng.randint(10_000, 99_999)) for _ in range(trials)] for _ in depths]
    if any(passkey_min_length(tokenizer, key) > length for depth_keys in keys for key in depth_keys):
        return []
    return [build_passkey_prompt(tokenizer, length, depth, key) for depth, depth_keys in zip(depths, keys)
            for key in depth_keys]


@torch.no_grad()
def passkey_accuracy(model: Transformer, tokenizer, prompts: list[PasskeyPrompt],
                     desc: str = "passkey") -> dict[float, float]:
    """Per depth, the fraction of prompts whose greedy continuation (as many tokens as the answer)
    decodes to exactly the passkey.

    Args:
        model: the model to query.
        tokenizer: decodes the continuation.
        prompts: from ``passkey_prompts``.
        desc: label of the progress bar.
    """
    correct: dict[float, list[bool]] = {}
    for prompt in tqdm(prompts, desc=desc, unit="prompt", leave=False):
        with warnings.catch_warnings():  # prompts past the original model's context are the experiment
            warnings.filterwarnings("ignore", message="generating .* past the")
            output = generate(model, torch.tensor(prompt.prompt_ids), len(prompt.answer_ids), temperature=0)
        continuation = tokenizer.decode(output[0, len(prompt.prompt_ids):].tolist())
        correct.setdefault(prompt.depth, []).append(continuation.strip() == prompt.passkey)
    return {depth: sum(hits) / len(hits) for depth, hits in correct.items()}


def write_passkey_documents(directory: str, tokenizer, num_tokens: int, max_length: int, seed: int) -> int:
    """Write passkey examples (prompt + answer, at most ``max_length`` tokens, random depth and length)
    as one single-line .txt document each, until they hold ``num_tokens`` tokens.

    Args:
        directory: created if needed; its previous passkey files are replaced.
        tokenizer: measures the examples.
        num_tokens: total tokens to write.
        max_length: the longest example (the model's original context).
        seed: makes the examples reproducible.
    Returns:
        The number of documents written.
    Raises:
        ValueError: ``max_length`` cannot hold a passkey example.
    """
    rng = random.Random(f"passkey-train-{seed}")
    os.makedirs(directory, exist_ok=True)
    for name in os.listdir(directory):
        if name.startswith("passkey-") and name.endswith(".txt"):
            os.remove(os.path.join(directory, name))
    written = count = 0
    while written < num_tokens:
        passkey = str(rng.randint(10_000, 99_999))
        shortest = passkey_min_length(tokenizer, passkey)
        if shortest > max_length:
            raise ValueError(f"a passkey example needs {shortest} tokens, more than the original context {max_length}")
        example = build_passkey_prompt(tokenizer, rng.randint(shortest, max_length), rng.random(), passkey)
        with open(os.path.join(directory, f"passkey-{count:06d}.txt"), "w", encoding="utf-8") as f:
            f.write(f"{example.text} {example.passkey}")
        written += len(example.prompt_ids) + len(example.answer_ids)
        count += 1
    return count


def mix_in_passkey_documents(data: DataConfig, tokenizer, fraction: float, max_length: int, directory: str,
                             seed: int) -> DataConfig:
    """``data`` with passkey examples added to its training files so that they make up ``fraction``
    of the training tokens. The examples come after the original files, so every original document
    keeps its index and with it its side of data.py's every-n-th-document held-out split.

    Args:
        data: a ``stdlib`` source or text ``files``.
        tokenizer: the model's.
        fraction: in (0, 1).
        max_length: the longest example: the model's original context.
        directory: where the examples are written.
        seed: makes the examples reproducible.
    Raises:
        DataError: a source the examples (.txt documents) cannot join, a corpus held out by its tail,
            a bad fraction, or a max_length too short for a passkey example.
    """
    if not 0.0 < fraction < 1.0:
        raise DataError(f"--passkey-train-fraction must be in (0, 1), got {fraction}")
    if data.source == "stdlib":
        mixed = dataclasses.replace(data, source="files", train_files=stdlib_source_files(data.stdlib_max_bytes),
                                    text_sample_by="document")
    elif data.source == "files":
        mixed = dataclasses.replace(data, train_files=list(data.train_files))
    else:
        raise DataError(f"--passkey-train-fraction needs data.source stdlib or files, got {data.source!r}")
    mixed.train_files.append(os.path.join(directory, "passkey-*.txt"))
    base_train = load_corpus(data, tokenizer)[0]
    if base_train.num_docs == 1 and not data.eval_files:
        # Too few documents: data.py held out the tail of the token stream. With the examples added
        # it would hold out whole documents instead, and train on the text evaluated as held out.
        raise DataError("--passkey-train-fraction needs a corpus of many documents (or data.eval_files): this one "
                        "is split by its tail, which adding documents would change")
    try:
        write_passkey_documents(directory, tokenizer, math.ceil(base_train.num_tokens * fraction / (1 - fraction)),
                                max_length, seed)
    except ValueError as error:
        raise DataError(f"--passkey-train-fraction: {error}") from None
    try:
        corpus_cache_dir(mixed)
    except DataError as error:
        raise DataError(f"--passkey-train-fraction adds .txt documents, so data.train_files must be text: {error}"
                        ) from None
    return mixed
