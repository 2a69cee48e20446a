"""Context extension: rescale RoPE, fine-tune on packed long documents, measure what it bought.

    flashformer finetune-long runs/tiny --target-len 1024 --scaling linear --steps 200
    python scripts/finetune_long.py runs/tiny/ckpt-600 --target-len 1024 --scaling yarn batch_size=4

From a checkpoint (ours, a run directory, or a Hugging Face directory) trained at context L:

1. ``extended_model_config``: the model's config with RoPE scaled by ``factor = target / L`` and
   ``max_seq_len = target``; written as ``<run>/extended-init`` (same weights, new config).
2. ``long_context_train_config``: a TrainConfig from the checkpoint's run recipe (its config.yaml;
   defaults otherwise) with ``init_from=extended-init``, ``data.seq_len=target``,
   ``data.packing=packed`` (attention never crosses documents) and activation checkpointing, then
   ``flashformer.train.Trainer`` fine-tunes it: the same loop, checkpoints and metrics as ``train``.
3. Three models on the same held-out windows at each evaluated length: the original (RoPE as
   trained), the scaled one before fine-tuning (extended-init) and the fine-tuned one; perplexity
   and passkey retrieval (a 5-digit key hidden at several depths of filler text, scored by greedy
   decoding). Then the position-interpolation claim (Chen et al. 2023) as PASS / FAIL: the fine-tuned
   model at the target is no worse than the original at its own context L, while the original read
   at the target is more than CLAIM_DEGRADATION times worse. ``long_context_report.json``,
   ``long_context_report.md`` (table + verdict, also printed last) and ``perplexity_vs_length.png``
   land in the run directory.

Single process only: evaluation runs where the command runs, not under torchrun.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import random
import sys

import torch
import yaml
from tqdm.auto import tqdm

from .checkpoint import CheckpointError, from_pretrained, save_pretrained
from .config import ConfigError, config_to_dict
from .data import DataConfig, DataError, TokenCorpus, corpus_cache_dir, load_corpus, stdlib_source_files
from .generate import generate
from .model import ModelConfig, Transformer
from .tokenizer import TOKENIZER_FILE, load_tokenizer
from .train import (
    INTERRUPTED_EXIT_CODE,
    TRAINER_STATE_FILE,
    Trainer,
    TrainConfig,
    latest_checkpoint,
    load_train_config,
)

SCALINGS = ("linear", "dynamic", "yarn", "llama3", "ntk")
# Llama 3.1's published band edges: wavelengths above L / 1 are interpolated, below L / 4 kept.
LLAMA3_LOW_FREQ_FACTOR, LLAMA3_HIGH_FREQ_FACTOR = 1.0, 4.0
DEFAULT_PASSKEY_DEPTHS = (0.1, 0.5, 0.9)
REPORT_FILE = "long_context_report.json"
MARKDOWN_FILE = "long_context_report.md"
PLOT_FILE = "perplexity_vs_length.png"
EXTENDED_INIT_DIR = "extended-init"
PASSKEY_TRAIN_DIR = "passkey-train"
USAGE_ERROR_EXIT_CODE = 2
# The models every report compares: RoPE as trained, rescaled but not fine-tuned, rescaled + fine-tuned.
MODELS = ("original", "scaled", "finetuned")
# "Far worse" in the claim: the original model read at the target, against itself at its own context.
CLAIM_DEGRADATION = 2.0

# The passkey task of Mohtashami & Jaggi (2023, "Landmark Attention"), without its preamble so that
# short contexts still hold a prompt: filler sentences, the needle somewhere inside, the question.
FILLER_SENTENCES = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.",
                    "There and back again.")
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "What is the pass key? The pass key is"


# ----- the extended model -----


def extended_model_config(config: ModelConfig, target_len: int, scaling: str) -> ModelConfig:
    """``config`` with RoPE rescaled from its context ``max_seq_len`` (L) to ``target_len``.

    ``factor = target_len / L``. linear / yarn / llama3 become Hugging Face ``rope_scaling`` dicts
    (yarn and llama3 with ``original_max_position_embeddings = L``); ntk (static NTK-aware, which
    HF has no rope_type for) becomes ``rope_theta * factor ** (head_dim / (head_dim - 2))``.

    Args:
        config: the trained model's config.
        target_len: the new context length, > L.
        scaling: one of SCALINGS.
    Returns:
        A new ModelConfig with the scaling and ``max_seq_len = target_len``.
    Raises:
        ConfigError: unknown scaling, target not above L, no RoPE, RoPE already scaled, or dynamic.
    """
    if scaling not in SCALINGS:
        raise ConfigError(f"unknown scaling {scaling!r}: valid are {', '.join(SCALINGS)}")
    original_len = config.max_seq_len
    if target_len <= original_len:
        raise ConfigError(f"target length {target_len} must exceed the model's context {original_len}")
    if config.pos != "rope":
        raise ConfigError(f"the model uses pos={config.pos!r}; only RoPE models can be rescaled")
    if config.rope_scaling is not None:
        raise ConfigError(f"the model already has rope_scaling={config.rope_scaling}; extending a scaled "
                          "model again is not supported")
    if scaling == "dynamic":
        raise ConfigError("scaling 'dynamic' rescales only beyond max_seq_len (as in transformers), which "
                          "fine-tuning at the target sets to the target, so it would never engage; use 'ntk' "
                          "(its static form) or 'yarn'")
    factor = target_len / original_len
    if scaling == "ntk":
        grown_theta = config.rope_theta * factor ** (config.head_dim / (config.head_dim - 2))
        return dataclasses.replace(config, rope_theta=grown_theta, max_seq_len=target_len)
    rope_scaling = {"rope_type": scaling, "factor": factor}
    if scaling in ("yarn", "llama3"):
        rope_scaling["original_max_position_embeddings"] = original_len
    if scaling == "llama3":
        rope_scaling.update(low_freq_factor=LLAMA3_LOW_FREQ_FACTOR, high_freq_factor=LLAMA3_HIGH_FREQ_FACTOR)
    return dataclasses.replace(config, rope_scaling=rope_scaling, max_seq_len=target_len)


def save_extended_checkpoint(model: Transformer, config: ModelConfig, out_dir: str, tokenizer) -> None:
    """Write ``model``'s weights under the extended ``config`` (RoPE has no weights: nothing else changes).

    Args:
        model: the trained model.
        config: from ``extended_model_config``.
        out_dir: destination checkpoint directory (replaced).
        tokenizer: saved alongside, so fine-tuning and evaluation keep using it.
    """
    with torch.device("meta"):
        extended = Transformer(config)
    extended.load_state_dict(model.state_dict(), assign=True)
    save_pretrained(extended, out_dir, tokenizer=tokenizer)


def resolve_checkpoint(path: str) -> str:
    """The checkpoint directory ``path`` names: itself, or a run directory's latest ``ckpt-<step>``.

    Raises:
        CheckpointError: ``path`` is not a directory.
    """
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint directory {path} not found")
    return latest_checkpoint(path) or path


def _run_recipe(path: str) -> dict | None:
    """The config.yaml of the run ``path`` is (a run directory) or belongs to (one of its checkpoints), or None."""
    run_dir = os.path.dirname(os.path.abspath(path)) if os.path.isfile(os.path.join(path, TRAINER_STATE_FILE)) else path
    recipe = os.path.join(run_dir, "config.yaml")
    if not os.path.isfile(recipe):
        return None
    with open(recipe, encoding="utf-8") as f:
        return yaml.safe_load(f)


def long_context_train_config(checkpoint_path: str, extended_config: ModelConfig, scaling: str,
                              out_dir: str | None, steps: int, lr: float | None, warmup_steps: int | None,
                              overrides=()) -> TrainConfig:
    """The fine-tuning TrainConfig: the checkpoint's run recipe (defaults without one) made long.

    Args:
        checkpoint_path: what the user named (a run directory or a checkpoint).
        extended_config: the model config to train (recorded; the Trainer reads it from init_from).
        scaling: its name, part of the run name ``<recipe name>-<scaling><target>``.
        out_dir: the fine-tuning run directory (None: runs/<run name>); init_from is its ``extended-init``.
        steps: optimizer steps.
        lr: peak learning rate; None: a tenth of the recipe's (fine-tuning moves trained weights).
        warmup_steps: None: a tenth of the steps.
        overrides: ``key=value`` strings applied last, e.g. ``batch_size=4``.
    Raises:
        ConfigError: an invalid override or value.
    """
    base = config_to_dict(load_train_config(_run_recipe(checkpoint_path)))
    lr = base["optim"]["lr"] / 10 if lr is None else lr
    name = f"{base['name']}-{scaling}{extended_config.max_seq_len}"
    out_dir = out_dir or os.path.join("runs", name)
    base.update(name=name, out_dir=out_dir, steps=steps,
                resume=False, init_from=os.path.join(out_dir, EXTENDED_INIT_DIR), activation_checkpointing=True,
                model=config_to_dict(extended_config))
    base["optim"].update(lr=lr, min_lr=lr / 10, warmup_steps=steps // 10 if warmup_steps is None else warmup_steps)
    base["data"].update(seq_len=extended_config.max_seq_len, packing="packed")
    return load_train_config(base, overrides)


# ----- passkey retrieval -----


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


# ----- perplexity at a length -----


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


# ----- report -----


def extension_claim(rows: list[dict], original_len: int, target_len: int) -> dict | None:
    """Position interpolation's claim on the report's rows, or None when L or the target was not evaluated.

    Returns:
        The perplexities it compares, ``finetuned_no_worse`` (fine-tuned at the target <=
        original at L), ``original_degrades`` (original at the target > CLAIM_DEGRADATION x original
        at L) and ``passed`` (both). Also, outside ``passed``, ``finetuned_uses_context``: fine-tuned at the
        target <= fine-tuned at L. Fine-tuning also trains on more tokens, which alone can lower the
        perplexity at every length; this one compares the fine-tuned model with itself.
    """
    by_length = {row["length"]: row for row in rows}
    if original_len not in by_length or target_len not in by_length:
        return None
    reference = by_length[original_len]["ppl_original"]
    finetuned, unextended = by_length[target_len]["ppl_finetuned"], by_length[target_len]["ppl_original"]
    finetuned_short = by_length[original_len]["ppl_finetuned"]
    claim = {"ppl_original_at_original": reference, "ppl_finetuned_at_target": finetuned,
             "ppl_original_at_target": unextended, "ppl_finetuned_at_original": finetuned_short,
             "finetuned_no_worse": finetuned <= reference,
             "original_degrades": unextended > CLAIM_DEGRADATION * reference,
             "finetuned_uses_context": finetuned <= finetuned_short}
    return {**claim, "passed": claim["finetuned_no_worse"] and claim["original_degrades"]}


def _model_labels(scaling: str) -> dict[str, str]:
    return {"original": "original", "scaled": f"{scaling} (no fine-tune)", "finetuned": f"{scaling} + fine-tune"}


def markdown_report(report: dict) -> str:
    """Perplexity and passkey accuracy of every model at every length as a markdown table, then the
    claim's PASS / FAIL line."""

    def accuracy(value):
        return "n/a" if value is None else f"{value:.0%}"

    labels = _model_labels(report["scaling"]).values()
    header = [*(f"ppl {label}" for label in labels), *(f"passkey {label}" for label in labels)]
    lines = [f"| length | {' | '.join(header)} |", "|---:" * (len(header) + 1) + "|"]
    for row in report["lengths"]:
        cells = [*(f"{row[f'ppl_{m}']:.3f}" for m in MODELS), *(accuracy(row[f"passkey_{m}"]) for m in MODELS)]
        lines.append(f"| {row['length']} | {' | '.join(cells)} |")
    original_len, target_len, claim = report["original_length"], report["target_length"], report["claim"]
    if claim is None:
        verdict = (f"claim not checked: the evaluated lengths must include the original context {original_len} "
                   f"and the target {target_len}")
    else:
        ratio = claim["ppl_original_at_target"] / claim["ppl_original_at_original"]
        verdict = (f"{'PASS' if claim['passed'] else 'FAIL'}: {_model_labels(report['scaling'])['finetuned']} @ "
                   f"{target_len}: ppl {claim['ppl_finetuned_at_target']:.3f} "
                   f"{'<=' if claim['finetuned_no_worse'] else '>'} original @ {original_len}: ppl "
                   f"{claim['ppl_original_at_original']:.3f} (needs <=); original @ {target_len}: ppl "
                   f"{claim['ppl_original_at_target']:.3f} = {ratio:.1f}x original @ {original_len} "
                   f"(needs > {CLAIM_DEGRADATION:g}x). Beside the claim, the fine-tuned model @ {target_len} against "
                   f"itself @ {original_len}: ppl {claim['ppl_finetuned_at_target']:.3f} "
                   f"{'<=' if claim['finetuned_uses_context'] else '>'} {claim['ppl_finetuned_at_original']:.3f}")
    return "\n".join(lines) + "\n\n" + verdict


def plot_perplexity(report: dict, path: str) -> str | None:
    """Perplexity (left) and passkey accuracy (right) against evaluated length, one line per model;
    None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        print("matplotlib is not installed: no perplexity plot (pip install matplotlib)")
        return None
    rows, original_len = report["lengths"], report["original_length"]
    lengths = [row["length"] for row in rows]
    labels = _model_labels(report["scaling"])
    labels["original"] = "original (RoPE as trained)"
    fig, (ppl_ax, passkey_ax) = plt.subplots(1, 2, figsize=(12, 4))
    for model, style in zip(MODELS, ("-", "--", "-")):
        ppl_ax.plot(lengths, [row[f"ppl_{model}"] for row in rows], style, marker="o", label=labels[model])
        passkey_ax.plot(lengths, [math.nan if row[f"passkey_{model}"] is None else row[f"passkey_{model}"]
                                  for row in rows], style, marker="o", label=labels[model])
    if report["claim"] is not None:  # the bar the fine-tuned model must stay under at the target
        ppl_ax.axhline(report["claim"]["ppl_original_at_original"], color="gray", linestyle="--", linewidth=0.8,
                       label=f"original @ {original_len}")
    for ax in (ppl_ax, passkey_ax):
        ax.axvline(original_len, color="gray", linestyle=":", label="original context")
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [str(n) for n in lengths])
        ax.set_xlabel("evaluated context length (tokens)")
        ax.grid(alpha=0.3)
    ppl_ax.set_yscale("log")  # an unextended model's perplexity beyond its context can be orders larger
    ppl_ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    low, high = ppl_ax.get_ylim()
    # Label the minor ticks only when the axis spans less than a decade; over several they pile up.
    ppl_ax.yaxis.set_minor_formatter(matplotlib.ticker.ScalarFormatter() if high / low < 10
                                     else matplotlib.ticker.NullFormatter())
    ppl_ax.set_ylabel("held-out perplexity")
    ppl_ax.legend()
    passkey_ax.set_ylim(-0.05, 1.05)
    passkey_ax.set_ylabel("passkey accuracy")
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


# ----- the command -----


def _eval_lengths(requested, original_len: int, target_len: int) -> list[int]:
    """The requested lengths, or L, 2L, 4L and the target (those up to the target)."""
    if requested:
        if any(n < 1 for n in requested):
            raise ConfigError(f"--eval-lengths must be positive, got {requested}")
        return sorted(set(requested))
    return sorted({n for n in (original_len, 2 * original_len, 4 * original_len, target_len) if n <= target_len})


def finetune_long(args: argparse.Namespace) -> dict | None:
    """Extend, evaluate, fine-tune, evaluate again; every input is checked before any training.

    Args:
        args: ``main``'s parsed arguments.
    Returns:
        The report (also written as JSON and markdown), or None when training was interrupted.
    """
    checkpoint = resolve_checkpoint(args.checkpoint)
    original = from_pretrained(checkpoint)
    original_len = original.config.max_seq_len
    extended_config = extended_model_config(original.config, args.target_len, args.scaling)
    if args.eval_windows < 1 or args.passkey_trials < 1:
        raise ConfigError(f"--eval-windows and --passkey-trials must be >= 1, got {args.eval_windows}, "
                          f"{args.passkey_trials}")
    if any(not 0.0 <= depth <= 1.0 for depth in args.passkey_depths):
        raise ConfigError(f"--passkey-depths must be in [0, 1], got {args.passkey_depths}")
    lengths = _eval_lengths(args.eval_lengths, original_len, args.target_len)
    cfg = long_context_train_config(args.checkpoint, extended_config, args.scaling, args.out_dir, args.steps,
                                    args.lr, args.warmup_steps, args.overrides)
    original.attn_backend = cfg.model.attn_backend
    # Named explicitly (not left to the Trainer) so that the held-out corpus below is cached under
    # this tokenizer, not under the byte-level default.
    if cfg.data.tokenizer is None and os.path.isfile(os.path.join(checkpoint, TOKENIZER_FILE)):
        cfg.data.tokenizer = os.path.join(checkpoint, TOKENIZER_FILE)
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    held_out_data = cfg.data
    if args.passkey_train_fraction:
        cfg.data = mix_in_passkey_documents(cfg.data, tokenizer, args.passkey_train_fraction, original_len,
                                            os.path.join(cfg.run_dir, PASSKEY_TRAIN_DIR), cfg.seed)
    save_extended_checkpoint(original, extended_config, cfg.init_from, tokenizer)
    trainer = Trainer(cfg)
    windows = held_out_windows(load_corpus(held_out_data, tokenizer)[1], lengths, args.eval_windows)
    prompts = {n: passkey_prompts(tokenizer, n, args.passkey_depths, args.passkey_trials, cfg.seed) for n in lengths}

    def evaluate(model: Transformer, label: str) -> dict[int, dict]:
        return evaluate_long_context(model.to(trainer.device), tokenizer, windows, prompts, cfg.micro_batch_size,
                                     trainer.bf16, label)

    def load(path: str) -> Transformer:
        return from_pretrained(path, device=trainer.device, attn_backend=cfg.model.attn_backend)

    results = {"original": evaluate(original, "original")}
    del original  # its memory is the fine-tuning's
    results["scaled"] = evaluate(load(cfg.init_from), "scaled")
    result = trainer.fit()
    if result.interrupted:
        return None
    finetuned_dir = latest_checkpoint(trainer.run_dir)
    results["finetuned"] = evaluate(load(finetuned_dir), "finetuned")
    rows = [{"length": n, **{f"{metric}_{model}": results[model][n][metric]
                             for metric in ("ppl", "passkey", "passkey_by_depth") for model in MODELS}}
            for n in lengths]
    report = {
        "checkpoint": checkpoint,
        "run_dir": trainer.run_dir,
        "finetuned_checkpoint": finetuned_dir,
        "scaling": args.scaling,
        "rope_scaling": extended_config.rope_scaling,
        "rope_theta": extended_config.rope_theta,
        "original_length": original_len,
        "target_length": args.target_len,
        "steps": result.step,
        "train_loss": result.train_loss,
        "eval_windows": len(next(iter(windows.values()))),
        "passkey_train_fraction": args.passkey_train_fraction,
        "passkey_depths": list(args.passkey_depths),
        "passkey_prompts_per_length": {n: len(p) for n, p in prompts.items()},
        "lengths": rows,
        "claim": extension_claim(rows, original_len, args.target_len),
    }
    with open(os.path.join(trainer.run_dir, REPORT_FILE), "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)
    with open(os.path.join(trainer.run_dir, MARKDOWN_FILE), "w", encoding="utf-8") as f:
        f.write(markdown_report(report) + "\n")
    plot_perplexity(report, os.path.join(trainer.run_dir, PLOT_FILE))
    return report


def main(argv: list[str] | None = None) -> int:
    """``flashformer finetune-long CHECKPOINT --target-len N``: extend the context, report original / scaled /
    fine-tuned."""
    parser = argparse.ArgumentParser(prog="flashformer finetune-long", description=main.__doc__)
    parser.add_argument("checkpoint", help="our checkpoint or run directory, or a Hugging Face directory")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="training overrides applied last, e.g. batch_size=4 micro_batch_size=2")
    parser.add_argument("--target-len", type=int, required=True, help="the new context length")
    parser.add_argument("--scaling", default="linear", choices=SCALINGS, help="RoPE scaling (default: linear)")
    parser.add_argument("--steps", type=int, default=200, help="fine-tuning optimizer steps")
    parser.add_argument("--lr", type=float, default=None, help="peak learning rate (default: a tenth of the recipe's)")
    parser.add_argument("--warmup-steps", type=int, default=None, help="default: a tenth of --steps")
    parser.add_argument("--out-dir", default=None, help="run directory (default: runs/<recipe name>-<scaling><target>)")
    parser.add_argument("--eval-lengths", type=int, nargs="+", default=None,
                        help="lengths to evaluate (default: L, 2L, 4L and the target, up to the target)")
    parser.add_argument("--eval-windows", type=int, default=8, help="held-out windows per length")
    parser.add_argument("--passkey-depths", type=float, nargs="+", default=list(DEFAULT_PASSKEY_DEPTHS))
    parser.add_argument("--passkey-trials", type=int, default=4, help="passkey prompts per depth and length")
    parser.add_argument("--passkey-train-fraction", type=float, default=0.0,
                        help="share of training tokens that are passkey examples (at most the original length)")
    args = parser.parse_intermixed_args(argv)  # overrides may follow the options
    if any("=" not in override for override in args.overrides):
        parser.error(f"overrides look like key=value, got {[o for o in args.overrides if '=' not in o]}")
    try:
        report = finetune_long(args)
    except (ConfigError, DataError, CheckpointError) as error:
        print(f"flashformer finetune-long: error: {error}", file=sys.stderr)
        return USAGE_ERROR_EXIT_CODE
    if report is None:
        return INTERRUPTED_EXIT_CODE
    print(f"report: {os.path.join(report['run_dir'], REPORT_FILE)}")
    print(markdown_report(report))
    return 0
