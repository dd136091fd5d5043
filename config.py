"""Typed configs: dataclasses filled from YAML, unknown keys rejected, dotted CLI overrides.

    cfg = load_config(TrainConfig, "recipes/reference/eagle3.yaml", ["train.lr=1e-4"])

Every field is declared (with its documentation) on the dataclass that owns it; nested dataclasses
are nested mappings in YAML. An override ``a.b=value`` parses ``value`` as YAML (so ``3``, ``1e-4``,
``true``, ``[2, 4, 6]`` and ``null`` get their types). Convention after litgpt ``args.py`` and
SpecForge ``config/schema.py``.
"""
from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A config file or override that does not fit its dataclass (message names the key and the fix)."""


def _field_types(cls) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _coerce(value: Any, tp: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping for {tp.__name__}, got {type(value).__name__}")
        return from_dict(tp, value, where)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(f"{where}: {value!r} fits none of {tp}: {'; '.join(errors)}")
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        (item,) = typing.get_args(tp)[:1] or (Any,)
        items = [_coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return dict(value)
    if origin is typing.Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(f"{where}: {value!r} is not one of {typing.get_args(tp)}")
        return value
    if tp is Any:
        return value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    if tp is Path and isinstance(value, str):
        return Path(value)
    if isinstance(tp, type) and not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
        raise ConfigError(f"{where}: expected {getattr(tp, '__name__', tp)}, got {value!r}")
    return value


def from_dict(cls: type[T], data: dict, where: str = "") -> T:
    """Build dataclass ``cls`` from a mapping; raises ConfigError on unknown keys or wrong types."""
    types_ = _field_types(cls)
    unknown = sorted(set(data) - set(types_))
    if unknown:
        raise ConfigError(f"unknown key(s) {', '.join((where + '.' if where else '') + k for k in unknown)} "
                          f"for {cls.__name__}; known keys: {', '.join(sorted(types_))}")
    kwargs = {k: _coerce(v, types_[k], f"{where}.{k}" if where else k) for k, v in data.items()}
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise ConfigError(f"{cls.__name__}{' at ' + where if where else ''}: {e}") from None


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Set ``a.b.c=value`` entries on the nested mapping ``data`` (value parsed as YAML)."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key.path=value")
        key, raw = item.split("=", 1)
        node = data
        parts = key.strip().split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {p} is not a section")
        node[parts[-1]] = yaml.safe_load(raw)
    return data


def load_config(cls: type[T], path: str | Path | None = None, overrides: list[str] | None = None) -> T:
    """Load ``cls`` from YAML file ``path`` (or its defaults when None) plus dotted ``overrides``.

    Raises ConfigError naming the offending key; FileNotFoundError if ``path`` is missing."""
    data: dict = {}
    if path is not None:
        data = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: a config file must hold a mapping at its top level")
    return from_dict(cls, apply_overrides(data, list(overrides or [])))


def to_dict(cfg) -> dict:
    """Plain-data view of a config (Paths as strings), for logging and metadata."""
    def conv(v):
        if isinstance(v, Path):
            return str(v)
        if isinstance(v, (list, tuple)):
            return [conv(x) for x in v]
        if isinstance(v, dict):
            return {k: conv(x) for k, x in v.items()}
        return v
    return {k: conv(v) for k, v in dataclasses.asdict(cfg).items()}
