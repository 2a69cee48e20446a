"""Typed configuration over (nested) dataclasses: YAML or dict in, dotted overrides, validation.

    cfg = load_config(ModelConfig, "configs/models/tiny-llama.yaml", ["n_layer=4", "rope_scaling.factor=8"])

Every key is checked against the dataclass fields (an unknown key names its closest valid
neighbour), every value against the field's annotation, and each dataclass's optional
``validate(self)`` runs once its fields are loaded, inner dataclasses first.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
from typing import Any, Literal, Union

import yaml


class ConfigError(ValueError):
    """A config key is unknown, a value has the wrong type, or a value is invalid."""


def load_config(cls, source=None, overrides=()):
    """Build a ``cls`` instance from a YAML path, a dict (or None for defaults) plus overrides.

    Args:
        cls: a dataclass type, possibly with nested dataclass fields.
        source: path of a YAML mapping, a dict, or None.
        overrides: strings ``"a.b.c=value"``; the value is parsed by ``yaml.safe_load``.
    Raises:
        ConfigError: unknown key, missing required key, wrong type or invalid value.
    """
    if source is None:
        raw = {}
    elif isinstance(source, dict):
        raw = _deep_copy_dict(source)
    elif isinstance(source, (str, os.PathLike)):
        raw = read_yaml(source) or {}
        if not isinstance(raw, dict):
            raise ConfigError(f"{source}: the top level must be a mapping, got {type(raw).__name__}")
    else:
        raise ConfigError(f"source must be a YAML path, a dict or None, got {type(source).__name__}")
    for override in overrides:
        _apply_override(raw, override)
    return _build_dataclass(cls, raw, prefix="")


def config_to_dict(cfg) -> dict:
    """A plain dict (lists instead of tuples) of a dataclass config, ready for YAML / JSON."""
    return _plain(dataclasses.asdict(cfg))


def save_config(cfg, path) -> None:
    """Write ``cfg`` as YAML to ``path`` atomically."""
    from .fileio import atomic_write_file

    text = yaml.safe_dump(config_to_dict(cfg), sort_keys=False)
    atomic_write_file(path, lambda f: f.write(text.encode("utf-8")))


def _plain(value):
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _deep_copy_dict(value):
    return {k: _deep_copy_dict(v) if isinstance(v, dict) else v for k, v in value.items()}


def _apply_override(raw: dict, override: str) -> None:
    if not isinstance(override, str) or "=" not in override:
        raise ConfigError(f"override {override!r} must look like 'key.subkey=value'")
    dotted, text = override.split("=", 1)
    parts = dotted.strip().split(".")
    if not all(parts):
        raise ConfigError(f"override {override!r}: empty component in key {dotted!r}")
    node = raw
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        elif not isinstance(child, dict):
            raise ConfigError(f"override {override!r}: '{'.'.join(parts[:i + 1])}' holds a value, not a section")
        node = child
    try:
        node[parts[-1]] = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ConfigError(f"override {override!r}: the value is not valid YAML ({_yaml_problem(error)})") from None


def read_yaml(path):
    """The YAML document at ``path``; ConfigError naming the file (and the line) when it is missing,
    unreadable or malformed."""
    try:
        with open(path, encoding="utf-8") as f:
            return yaml.safe_load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except UnicodeDecodeError as error:
        raise ConfigError(f"{path}: not UTF-8 text ({error.reason} at byte {error.start})") from None
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not valid YAML ({_yaml_problem(error)})") from None


def _yaml_problem(error: yaml.YAMLError) -> str:
    """PyYAML's complaint in one line: the problem and where (1-based line and column)."""
    mark = getattr(error, "problem_mark", None)
    problem = getattr(error, "problem", None) or str(error).splitlines()[0]
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else problem


def _build_dataclass(cls, raw, prefix: str):
    if isinstance(raw, cls):
        return raw
    if not isinstance(raw, dict):
        raise ConfigError(f"{prefix.rstrip('.') or '<root>'}: expected a mapping for {cls.__name__}, got {raw!r}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    hints = typing.get_type_hints(cls)
    for key in raw:
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f"; did you mean '{close[0]}'?" if close else f"; valid keys: {', '.join(fields)}"
            raise ConfigError(f"unknown config key '{prefix}{key}' in {cls.__name__}{hint}")
    kwargs = {}
    for name, field in fields.items():
        if name in raw:
            kwargs[name] = _coerce(raw[name], hints[name], prefix + name)
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise ConfigError(f"missing required config key '{prefix}{name}' in {cls.__name__}")
    cfg = cls(**kwargs)
    if hasattr(cfg, "validate"):
        cfg.validate()
    return cfg


def _type_name(tp) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value, tp, key: str):
    """Check ``value`` against annotation ``tp``; return it converted (tuples, floats, dataclasses)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    mismatch = ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r} ({type(value).__name__})")
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arm in args:
            if arm is type(None):
                continue
            try:
                return _coerce(value, arm, key)
            except ConfigError:
                continue
        raise mismatch
    if origin is Literal:
        if value in args and type(value) in {type(a) for a in args}:
            return value
        raise ConfigError(f"{key}: expected one of {list(args)}, got {value!r}")
    if dataclasses.is_dataclass(tp):
        return _build_dataclass(tp, value, key + ".")
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise mismatch
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise mismatch
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        # YAML 1.1 reads "1e-5" (no dot) as a string; accept it as the float it obviously is.
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise mismatch
    if tp is str:
        if isinstance(value, str):
            return value
        raise mismatch
    if tp in (list, tuple) or origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise mismatch
        container = origin or tp
        if not args:
            return container(value)
        if container is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            if len(value) != len(args):
                raise ConfigError(f"{key}: expected {len(args)} items, got {value!r}")
            return tuple(_coerce(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
        return container(_coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value))
    if tp is dict or origin is dict:
        if not isinstance(value, dict):
            raise mismatch
        if not args:
            return dict(value)
        return {_coerce(k, args[0], f"{key}.<key>"): _coerce(v, args[1], f"{key}.{k}") for k, v in value.items()}
    if isinstance(tp, type):
        if isinstance(value, tp):
            return value
        raise mismatch
    raise ConfigError(f"{key}: unsupported annotation {tp!r} in the config dataclass")
