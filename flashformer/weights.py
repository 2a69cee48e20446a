"""Our checkpoint files: safetensors weights (one file, or shards with an index) and config.json.

The writer and reader below the model: ``Transformer.save_pretrained`` calls ``save_pretrained`` here,
and checkpoint.from_pretrained, which builds models, reads through ``read_weights``.
"""

from __future__ import annotations

import os
import re

from .fileio import atomic_directory

FORMATS = ("flashformer", "hf")
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
COMPILED_PREFIX = "_orig_mod."  # torch.compile's wrapper prefixes every key with it
# A LoRA adapter checkpoint (lora.py): adapter tensors, and a config naming the LoRA setup and the base.
ADAPTER_FILE = "adapter.safetensors"
ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_FORMAT = "flashformer-lora"
# A run directory's checkpoints: ckpt-<step>, each moved into place only once complete.
CHECKPOINT_NAME = re.compile(r"^ckpt-(\d+)$")


class CheckpointError(ValueError):
    """A checkpoint is missing, unreadable, or does not match the model it describes."""


def latest_checkpoint(run_dir: str) -> str | None:
    """The complete ``ckpt-<step>`` directory of ``run_dir`` with the highest step, or None.

    Checkpoints are moved into place only once complete, so a half-written one is never returned.
    """
    steps = checkpoint_steps(run_dir)
    return os.path.join(run_dir, f"ckpt-{steps[-1]}") if steps else None


def checkpoint_steps(run_dir: str) -> list[int]:
    """The steps of ``run_dir``'s checkpoints, ascending ([] when it does not exist)."""
    if not os.path.isdir(run_dir):
        return []
    return sorted(int(m.group(1)) for m in map(CHECKPOINT_NAME.match, os.listdir(run_dir)) if m)


def _shard_plan(tensors: dict, max_shard_bytes: int) -> list[list[str]]:
    """Greedy, in order: start a new shard when the next tensor would overflow the current one."""
    shards, current, current_bytes = [], [], 0
    for name, tensor in tensors.items():
        size = tensor.numel() * tensor.element_size()
        if current and current_bytes + size > max_shard_bytes:
            shards.append(current)
            current, current_bytes = [], 0
        current.append(name)
        current_bytes += size
    return shards + [current] if current else shards


def write_pretrained_files(model, directory, format: str = "flashformer",
                           max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, tokenizer=None) -> None:
    """Write weights (+ index when sharded), config.json and the tokenizer into an existing directory.

    Not atomic by itself: save_pretrained wraps it in atomic_directory; a caller assembling a larger
    checkpoint (e.g. with optimizer state) may call it inside its own atomic_directory.
    """
    import json

    from safetensors.torch import save_file

    from .config import config_to_dict
    from .hf import config_to_hf, state_dict_to_hf

    if format not in FORMATS:
        raise ValueError(f"format={format!r}: expected one of {', '.join(map(repr, FORMATS))}")
    if not isinstance(max_shard_bytes, int) or max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be a positive int, got {max_shard_bytes!r}")
    model = getattr(model, "_orig_mod", model)
    tensors = {name.removeprefix(COMPILED_PREFIX): t.detach().cpu().contiguous()
               for name, t in model.state_dict().items()}
    cfg = model.config
    if format == "hf":
        dtype = model.embed.weight.dtype
        tensors, config_json = state_dict_to_hf(tensors, cfg), config_to_hf(cfg, dtype)
    else:
        config_json = {"format": "flashformer", "format_version": 1, "model": config_to_dict(cfg)}
    shards = _shard_plan(tensors, max_shard_bytes)
    if len(shards) == 1:
        save_file(tensors, os.path.join(directory, SINGLE_FILE), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, names in enumerate(shards, start=1):
            filename = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file({n: tensors[n] for n in names}, os.path.join(directory, filename), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(names, filename))
        total_size = sum(t.numel() * t.element_size() for t in tensors.values())
        with open(os.path.join(directory, INDEX_FILE), "w", encoding="utf-8") as f:
            json.dump({"metadata": {"total_size": total_size}, "weight_map": weight_map}, f, indent=2)
    with open(os.path.join(directory, CONFIG_FILE), "w", encoding="utf-8") as f:
        json.dump(config_json, f, indent=2)
    if tokenizer is not None:
        tokenizer.save(directory)


def save_pretrained(model, out_dir, format: str = "flashformer", max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                    tokenizer=None) -> None:
    """Save ``model`` as safetensors + config.json, replacing ``out_dir`` as a whole, atomically.

    Args:
        model: a Transformer (or its torch.compile wrapper).
        out_dir: destination directory; anything already in it is replaced.
        format: "flashformer" (our config.json) or "hf" (loadable by transformers' AutoModelForCausalLM).
        max_shard_bytes: above this, weights are split into model-0000i-of-0000N.safetensors + index.
        tokenizer: optional tokenizer with a ``save(directory)`` method, saved alongside.
    """
    with atomic_directory(out_dir) as tmp_dir:
        write_pretrained_files(model, tmp_dir, format, max_shard_bytes, tokenizer)


def read_json(path):
    """The JSON document at ``path``; CheckpointError when it is missing or malformed."""
    import json

    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path} not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path} is not valid JSON: {err}") from None


def read_safetensors_file(path, dtype=None) -> dict:
    """All tensors of one safetensors file, on the CPU, read one at a time (safe_open).

    Tensors kept as stored stay backed by the file's mapping (no copy). Floating tensors converted to
    ``dtype`` are converted as each is read, with the file reopened per tensor: a mapping keeps every page
    read through it resident until it closes, so one open for all would peak at the whole file beside
    its converted copy; this way memory peaks at the converted tensors plus one stored tensor.

    Raises:
        CheckpointError: the file is missing, corrupted or truncated.
    """
    from safetensors import SafetensorError, safe_open

    if not os.path.isfile(path):
        raise CheckpointError(f"weights file {path} not found")
    tensors = {}
    try:
        with safe_open(path, framework="pt", device="cpu") as f:
            names = list(f.keys())
            if dtype is None:
                return {name: f.get_tensor(name) for name in names}
        for name in names:
            with safe_open(path, framework="pt", device="cpu") as f:
                tensor = f.get_tensor(name)
            tensors[name] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    except (SafetensorError, OSError, RuntimeError, ValueError) as err:
        raise CheckpointError(f"{path} is corrupted or truncated (not a readable safetensors file): {err}") from None
    return tensors


def read_weights(directory, dtype=None) -> dict:
    """All tensors of a checkpoint directory (single file or sharded with an index), on the CPU.

    Args:
        directory: the checkpoint directory.
        dtype: floating tensors are converted to it one by one as they are read (None: as stored).
    """
    index_path = os.path.join(directory, INDEX_FILE)
    if not os.path.exists(index_path):
        single = os.path.join(directory, SINGLE_FILE)
        if not os.path.exists(single) and os.path.exists(os.path.join(directory, "pytorch_model.bin")):
            raise CheckpointError(f"{directory} holds pytorch_model.bin; only safetensors checkpoints are supported")
        return read_safetensors_file(single, dtype)
    weight_map = read_json(index_path).get("weight_map")
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index_path} has no weight_map")
    tensors = {}
    for filename in sorted(set(weight_map.values())):
        shard = read_safetensors_file(os.path.join(directory, filename), dtype)
        listed = {name for name, file in weight_map.items() if file == filename}
        if listed - shard.keys():
            absent = ", ".join(sorted(listed - shard.keys()))
            raise CheckpointError(f"{filename} lacks tensors its index lists: {absent}")
        tensors.update(shard)
    return tensors
