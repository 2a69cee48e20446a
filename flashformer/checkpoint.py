"""Loading checkpoints into models: ours (weights.py's format), Hugging Face directories, or LoRA adapter
checkpoints (lora.py), which load as their base with the adapters merged in. A Hugging Face hub id
("org/name") that is not a local path loads from its snapshot in the Hugging Face cache (hub_snapshot).

Above model.py (it builds Transformers); the files themselves are written and read in weights.py.
"""

from __future__ import annotations

import os
import re

from .weights import (ADAPTER_CONFIG_FILE, COMPILED_PREFIX, CONFIG_FILE, CheckpointError, latest_checkpoint, read_json,
                      read_weights)


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


def _architecture_fields(model_fields):
    """Our config.json's model section without ``attn_backend``, which configs written while it was a
    model field hold: the caller's choice wins, as it always did."""
    if isinstance(model_fields, dict):
        return {name: value for name, value in model_fields.items() if name != "attn_backend"}
    return model_fields


# "org/name": what the hub calls a repository id (a local path wins where one exists).
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# What a model needs from a hub repository: weights, configs, tokenizer files, chat templates.
_HUB_FILES = ["*.json", "*.safetensors", "*.jinja", "tokenizer*"]


def hub_snapshot(repo_id: str, revision: str | None = None) -> str:
    """The local directory of hub model ``repo_id`` at ``revision`` (a branch, tag or commit; None: main):
    its snapshot in the Hugging Face cache (HF_HUB_CACHE / HF_HOME), through huggingface_hub's
    snapshot_download, which downloads what the cache lacks unless HF_HUB_OFFLINE=1.

    Raises:
        CheckpointError: naming the id, when neither the cache nor the hub has it.
    """
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HFValidationError, HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled

    named = f"{repo_id}" + (f" (revision {revision})" if revision else "")
    try:
        return snapshot_download(repo_id, revision=revision, allow_patterns=_HUB_FILES,
                                 local_files_only=constants.HF_HUB_OFFLINE)
    except (LocalEntryNotFoundError, OfflineModeIsEnabled) as error:
        raise CheckpointError(
            f"{named} is neither a local directory nor in the Hugging Face cache ({constants.HF_HUB_CACHE}), and "
            f"HF_HUB_OFFLINE=1 forbids downloading it: download it once online (`hf download {repo_id}`), "
            f"or pass a local directory ({type(error).__name__})") from None
    except (HfHubHTTPError, HFValidationError, OSError) as error:
        raise CheckpointError(f"{named} is neither a local directory nor a model the Hugging Face hub gives: "
                              f"{type(error).__name__}: {str(error).splitlines()[0]}") from None


def resolve_checkpoint_dir(path, revision: str | None = None) -> str:
    """The checkpoint directory ``path`` names: itself, or, for a run directory (no config.json, ckpt-<step>
    directories inside), its latest checkpoint; a hub id ("org/name") that is no local path: its snapshot.

    Args:
        path: a directory or a hub id.
        revision: the hub revision (branch, tag or commit) of a hub id.
    Raises:
        CheckpointError: ``path`` is neither a directory nor a hub id the cache or the hub has.
    """
    directory = os.fspath(path)
    if not os.path.exists(directory) and _HUB_ID.match(directory):
        directory = hub_snapshot(directory, revision)
    if not os.path.isdir(directory):
        raise CheckpointError(f"checkpoint directory {directory} not found")
    if not any(os.path.isfile(os.path.join(directory, name)) for name in (CONFIG_FILE, ADAPTER_CONFIG_FILE)):
        return latest_checkpoint(directory) or directory
    return directory


def _check_one_float_dtype(tensors: dict, directory: str) -> None:
    """A checkpoint's floating tensors share one dtype: a stray one (an fp16 tensor in an fp32 checkpoint)
    would give a model of mixed precision without a word."""
    by_dtype: dict = {}
    for name, t in tensors.items():
        if t.is_floating_point():
            by_dtype.setdefault(t.dtype, []).append(name)
    if len(by_dtype) > 1:
        common = max(by_dtype, key=lambda d: len(by_dtype[d]))
        strays = "; ".join(f"{len(names)} in {d} ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})"
                           for d, names in by_dtype.items() if d != common)
        raise CheckpointError(f"{directory} mixes floating dtypes: {strays}, the rest in {common}; pass dtype= "
                              f"(--dtype) to load every tensor in one")


def from_pretrained(path, dtype=None, device=None, attn_backend: str = "auto", revision: str | None = None):
    """Load a Transformer from our checkpoint directory, a Hugging Face one (detected by config.json), or a
    LoRA adapter checkpoint (its base with the adapters merged: a plain Transformer).

    Args:
        path: checkpoint directory, a run directory (its latest checkpoint), or a hub id ("org/name": its
            snapshot in the Hugging Face cache, see hub_snapshot).
        dtype: torch.dtype or name ("bfloat16", ...) for floating tensors; None keeps the stored dtype.
        device: where to put the model (default CPU).
        attn_backend: the loaded model's attention backend (a runtime choice; checkpoints hold none).
        revision: a hub id's branch, tag or commit (None: main).
    Returns:
        A fully loaded Transformer: every tensor is checked before the model is returned.
    Raises:
        CheckpointError: missing / unexpected / misshapen tensors (all listed), unreadable files,
        an unsupported Hugging Face architecture.
    """
    import torch

    from .config import load_config
    from .hf import config_from_hf, state_dict_from_hf
    from .lora import is_adapter_checkpoint, merge_lora
    from .model import ModelConfig, Transformer

    directory = resolve_checkpoint_dir(path, revision)
    dtype = _parse_dtype(dtype)
    if is_adapter_checkpoint(directory):
        adapted = load_adapted(directory, dtype, device, attn_backend)
        stored_dtype = adapted.embed.weight.dtype  # the norms may have trained in fp32 over a bf16 base
        return merge_lora(adapted).to(stored_dtype)
    config_json = read_json(os.path.join(directory, CONFIG_FILE))
    if not isinstance(config_json, dict):
        raise CheckpointError(f"{os.path.join(directory, CONFIG_FILE)} must hold a JSON object, got a "
                              f"{type(config_json).__name__}")
    is_ours = config_json.get("format") == "flashformer"
    try:
        if is_ours:
            cfg = load_config(ModelConfig, _architecture_fields(config_json.get("model")))
        elif "model_type" in config_json:
            cfg = config_from_hf(config_json)
        else:
            raise ValueError("neither a flashformer config (format: flashformer) nor a Hugging Face one (model_type)")
    except ValueError as err:
        raise CheckpointError(f"{os.path.join(directory, CONFIG_FILE)}: {err}") from None
    tensors = {name.removeprefix(COMPILED_PREFIX): t for name, t in read_weights(directory, dtype).items()}
    if not is_ours:
        tensors = state_dict_from_hf(tensors, cfg)
    # Build on the meta device (no memory, no init cost), check everything, then adopt the tensors.
    with torch.device("meta"):
        model = Transformer(cfg, attn_backend=attn_backend)
    _check_tensors({name: t.shape for name, t in model.state_dict().items()}, tensors, directory)
    if dtype is None:
        _check_one_float_dtype(tensors, directory)
    model.load_state_dict(tensors, strict=True, assign=True)
    return model.to(device) if device is not None else model


def load_adapted(path, dtype=None, device=None, attn_backend: str = "auto"):
    """A LoRA adapter checkpoint as its base model carrying the adapters (LoRALinear, not merged).

    Args:
        path: the adapter checkpoint directory (adapter_config.json names the base).
        dtype, device, attn_backend: as in from_pretrained, for the base.
    Raises:
        CheckpointError: the base is gone or no longer has the model config the adapters were trained on;
            adapter files missing, unreadable or not matching.
    """
    from .config import config_to_dict, load_config
    from .lora import LoRAConfig, apply_lora, load_adapter_weights, read_adapter

    directory = os.fspath(path)
    record, tensors = read_adapter(directory)
    base_dir, base_model = record["base"]["path"], record["base"]["model"]
    if not os.path.isdir(base_dir):
        raise CheckpointError(f"{directory} adapts the base checkpoint {base_dir}, which is not there any more")
    model = from_pretrained(base_dir, dtype, device, attn_backend)
    actual, base_model = config_to_dict(model.config), _architecture_fields(base_model)
    if actual != base_model:
        changed = sorted(key for key in actual.keys() | base_model.keys() if actual.get(key) != base_model.get(key))
        raise CheckpointError(f"{directory} adapts {base_dir}, whose model config changed since ({', '.join(changed)})")
    apply_lora(model, load_config(LoRAConfig, record["lora"]))
    load_adapter_weights(model, tensors, directory)
    return model
