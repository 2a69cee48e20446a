"""Crash-safe file writes and the checkpoint format (safetensors weights + config.json).

Everything written here is atomic: a reader (or a resumed run after a crash) sees either the
previous complete file / directory or the new complete one, never a mixture.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile


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


def atomic_write_file(path, write_fn) -> None:
    """Write a file so that ``path`` holds either its old content or the complete new one.

    Args:
        path: destination file.
        write_fn: called with a binary file object opened on a temporary file in the same directory.
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp_path = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            write_fn(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_path, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp_path)
        raise
    _fsync_directory(directory)


@contextlib.contextmanager
def atomic_directory(final_dir):
    """Build a directory next to ``final_dir`` and move it into place only if the block succeeds.

    Yields the temporary directory path. On success its files are fsynced and it replaces
    ``final_dir`` (an existing one is first renamed aside, then deleted, so a crash leaves either
    the old or the new directory under a recognisable name). On an exception it is removed.
    """
    final_dir = os.path.abspath(os.fspath(final_dir))
    parent = os.path.dirname(final_dir)
    os.makedirs(parent, exist_ok=True)
    tmp_dir = tempfile.mkdtemp(prefix=f".{os.path.basename(final_dir)}.", suffix=".tmp", dir=parent)
    try:
        yield tmp_dir
        for root, _, files in os.walk(tmp_dir):
            for name in files:
                with open(os.path.join(root, name), "rb") as f:
                    os.fsync(f.fileno())
            _fsync_directory(root)
        old_dir = None
        if os.path.exists(final_dir):
            old_dir = tempfile.mkdtemp(prefix=f".{os.path.basename(final_dir)}.", suffix=".old", dir=parent)
            os.rmdir(old_dir)
            os.replace(final_dir, old_dir)
        os.replace(tmp_dir, final_dir)
        _fsync_directory(parent)
        if old_dir is not None:
            shutil.rmtree(old_dir, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise


# --- the checkpoint format ---

FORMATS = ("flashformer", "hf")
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
_COMPILED_PREFIX = "_orig_mod."  # torch.compile's wrapper prefixes every key with it


class CheckpointError(ValueError):
    """A checkpoint is missing, unreadable, or does not match the model it describes."""


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
    tensors = {name.removeprefix(_COMPILED_PREFIX): t.detach().cpu().contiguous()
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


def _read_json(path):
    import json

    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path} not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path} is not valid JSON: {err}") from None


def _load_safetensors_file(path) -> dict:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not os.path.isfile(path):
        raise CheckpointError(f"weights file {path} not found")
    try:
        return load_file(path)
    except (SafetensorError, OSError, RuntimeError, ValueError) as err:
        raise CheckpointError(f"{path} is corrupted or truncated (not a readable safetensors file): {err}") from None


def read_weights(directory) -> dict:
    """All tensors of a checkpoint directory (single file or sharded with an index), on the CPU."""
    index_path = os.path.join(directory, INDEX_FILE)
    if not os.path.exists(index_path):
        single = os.path.join(directory, SINGLE_FILE)
        if not os.path.exists(single) and os.path.exists(os.path.join(directory, "pytorch_model.bin")):
            raise CheckpointError(f"{directory} holds pytorch_model.bin; only safetensors checkpoints are supported")
        return _load_safetensors_file(single)
    weight_map = _read_json(index_path).get("weight_map")
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index_path} has no weight_map")
    tensors = {}
    for filename in sorted(set(weight_map.values())):
        shard = _load_safetensors_file(os.path.join(directory, filename))
        listed = {name for name, file in weight_map.items() if file == filename}
        if listed - shard.keys():
            absent = ", ".join(sorted(listed - shard.keys()))
            raise CheckpointError(f"{filename} lacks tensors its index lists: {absent}")
        tensors.update(shard)
    return tensors


def _check_tensors(expected: dict, tensors: dict, source) -> None:
    missing = sorted(expected.keys() - tensors.keys())
    unexpected = sorted(tensors.keys() - expected.keys())
    misshapen = sorted(f"{name} (checkpoint {tuple(tensors[name].shape)}, model {tuple(shape)})"
                       for name, shape in expected.items() if name in tensors and tensors[name].shape != shape)
    groups = (("missing", missing), ("unexpected", unexpected), ("misshapen", misshapen))
    problems = [f"{label} ({len(names)}): {', '.join(names)}" for label, names in groups if names]
    if problems:
        raise CheckpointError(f"{source} does not match the model:\n  " + "\n  ".join(problems))


def _parse_dtype(dtype):
    import torch

    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if dtype not in names:
        raise ValueError(f"dtype={dtype!r}: expected a torch.dtype or one of {', '.join(names)}")
    return names[dtype]


def from_pretrained(path, dtype=None, device=None, attn_backend: str = "auto"):
    """Load a Transformer from our checkpoint directory or a Hugging Face one (detected by config.json).

    Args:
        path: checkpoint directory.
        dtype: torch.dtype or name ("bfloat16", ...) for floating tensors; None keeps the stored dtype.
        device: where to put the model (default CPU).
        attn_backend: the loaded model's attention backend.
    Returns:
        A fully loaded Transformer: every tensor is checked before the model is returned.
    Raises:
        CheckpointError: missing / unexpected / misshapen tensors (all listed), unreadable files,
        an unsupported Hugging Face architecture.
    """
    import dataclasses

    import torch

    from .config import load_config
    from .hf import config_from_hf, state_dict_from_hf
    from .model import ModelConfig, Transformer

    directory = os.fspath(path)
    if not os.path.isdir(directory):
        raise CheckpointError(f"checkpoint directory {directory} not found")
    dtype = _parse_dtype(dtype)
    config_json = _read_json(os.path.join(directory, CONFIG_FILE))
    is_ours = config_json.get("format") == "flashformer"
    try:
        if is_ours:
            cfg = load_config(ModelConfig, config_json.get("model"))
        elif "model_type" in config_json:
            cfg = config_from_hf(config_json)
        else:
            raise ValueError("neither a flashformer config (format: flashformer) nor a Hugging Face one (model_type)")
    except ValueError as err:
        raise CheckpointError(f"{os.path.join(directory, CONFIG_FILE)}: {err}") from None
    cfg = dataclasses.replace(cfg, attn_backend=attn_backend)
    tensors = {name.removeprefix(_COMPILED_PREFIX): t for name, t in read_weights(directory).items()}
    if not is_ours:
        tensors = state_dict_from_hf(tensors, cfg)
    # Build on the meta device (no memory, no init cost), check everything, then adopt the tensors.
    with torch.device("meta"):
        model = Transformer(cfg)
    _check_tensors({name: t.shape for name, t in model.state_dict().items()}, tensors, directory)
    if dtype is not None:
        tensors = {name: t.to(dtype) if t.is_floating_point() else t for name, t in tensors.items()}
    model.load_state_dict(tensors, strict=True, assign=True)
    return model.to(device) if device is not None else model
