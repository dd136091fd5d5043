"""Typed configs: dataclasses filled from YAML, unknown keys rejected, dotted CLI overrides.

    cfg = load_config(TrainConfig, "recipes/reference/eagle3.yaml", ["train.lr=1e-4"])

Every field is declared (with its documentation) on the dataclass that owns it; nested dataclasses
are nested mappings in YAML. An override ``a.b=value`` parses ``value`` as YAML (so ``3``, ``1e-4``,
``true``, ``[2, 4, 6]`` and ``null`` get their types). Convention after litgpt ``args.py`` and
SpecForge ``config/schema.py``.

Reading a file and applying overrides (``read_config_data``) needs only PyYAML, so the CLI reports a
missing file or a YAML syntax error before torch is imported. YAML 1.1 (PyYAML) reads unquoted
``no``/``off``/``yes``/``on`` as booleans and ``0123`` / ``2024`` as numbers: a Literal field whose options
include ``"no"`` (``"off"``, ``"yes"``, ``"on"``) reads the boolean as that option; any other string field
refuses it with the quoted fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")
#: The words YAML 1.1 reads as booleans (PyYAML's resolver), lower case; a Literal option among them is what an
#: unquoted boolean meant.
YAML_FALSE_WORDS = ("no", "off", "false")
YAML_TRUE_WORDS = ("yes", "on", "true")


class ConfigError(ValueError):
    """A config file or override that does not fit its dataclass (message names the key and the fix)."""


def _field_types(cls) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _unquoted_scalar(value: Any, where: str, options: tuple = ()) -> ConfigError:
    """The error for a string field that YAML gave a boolean or a number (an unquoted ``no``, ``2024``)."""
    leaf = where.rsplit(".", 1)[-1]
    if isinstance(value, bool):
        words = "no/off/false" if value is False else "yes/on/true"
        read, word = f"an unquoted {words} as the boolean {value}", words.split("/")[0]
    else:
        read, word = f"an unquoted number as {value!r}", str(value)
    if options:
        return ConfigError(
            f"{where}: YAML read {read}; this key takes one of {', '.join(map(repr, options))}: "
            f"write one of them, e.g. {leaf}: {options[0]}"
        )
    return ConfigError(
        f"{where}: YAML read {read}, but this key takes a string; quote it, e.g. "
        f'{leaf}: "{word}" in the file, or {where}=\'"{word}"\' as an override'
    )


def _boolean_option(value: bool, options: tuple) -> Any:
    """The Literal option an unquoted YAML boolean stood for ("no" for False when "no" is an option), or None."""
    words = YAML_FALSE_WORDS if value is False else YAML_TRUE_WORDS
    meant = [o for o in options if isinstance(o, str) and o.lower() in words]
    return meant[0] if len(meant) == 1 else None


def _takes_strings(tp: Any) -> bool:
    """True for str, Path and Literal-of-strings types (where an unquoted boolean or number is a YAML trap)."""
    if tp in (str, Path):
        return True
    return typing.get_origin(tp) is typing.Literal and all(isinstance(o, str) for o in typing.get_args(tp))


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
        if isinstance(value, (bool, int, float)) and not any(a in (bool, int, float, Any) for a in args):
            texts = [a for a in args if _takes_strings(a)]
            if texts:  # an unquoted no / 2024 for an optional string
                return _coerce(value, texts[0], where)
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
        options = typing.get_args(tp)
        if isinstance(value, bool) and value not in [o for o in options if isinstance(o, bool)]:
            meant = _boolean_option(value, options)
            if meant is not None:
                return meant
            raise _unquoted_scalar(value, where, options)
        if value not in options:
            if isinstance(value, (int, float)) and _takes_strings(tp):
                raise _unquoted_scalar(value, where, options)
            raise ConfigError(f"{where}: {value!r} is not one of {', '.join(map(repr, options))}; use one of them")
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
    if tp in (str, Path) and isinstance(value, (bool, int, float)):
        raise _unquoted_scalar(value, where)
    if isinstance(tp, type) and not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
        raise ConfigError(f"{where}: expected {getattr(tp, '__name__', tp)}, got {value!r}")
    return value


def from_dict(cls: type[T], data: dict, where: str = "") -> T:
    """Build dataclass ``cls`` from a mapping; raises ConfigError on unknown keys or wrong types.

    Two hooks a dataclass may define: ``migrate(data) -> data`` (a staticmethod) rewrites an older schema
    first (``pipeline.recipe.Recipe``); ``variant(data) -> subclass`` (a classmethod) picks the subclass the
    mapping describes, by a discriminator key (``drafters.config.DrafterSection``: ``method``)."""
    if hasattr(cls, "migrate"):
        data = cls.migrate(data)
    if hasattr(cls, "variant"):
        try:
            cls = cls.variant(data)
        except ValueError as e:
            raise ConfigError(f"{where + ': ' if where else ''}{e}") from None
    types_ = _field_types(cls)
    odd = [k for k in data if not isinstance(k, str)]
    if odd:
        key = odd[0]
        word = "on/yes/true" if key is True else "off/no/false" if key is False else "number"
        raise ConfigError(
            f"{where + ': ' if where else ''}YAML read the key {key!r} (an unquoted {word}) as "
            f'{type(key).__name__}, not a name; quote the key (e.g. "on": ...) or fix the '
            f"indentation"
        )
    unknown = sorted(set(data) - set(types_))
    if unknown:
        prefix = where + "." if where else ""
        close = difflib.get_close_matches(unknown[0], list(types_), n=1)
        raise ConfigError(
            f"unknown key(s) {', '.join(prefix + k for k in unknown)} for {cls.__name__}"
            + (f"; did you mean {prefix}{close[0]}?" if close else "")
            + f" known keys: {', '.join(sorted(types_))}"
        )
    kwargs = {k: _coerce(v, types_[k], f"{where}.{k}" if where else k) for k, v in data.items()}
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise ConfigError(f"{cls.__name__}{' at ' + where if where else ''}: {e}") from None


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Set ``a.b.c=value`` entries on the nested mapping ``data`` (value parsed as YAML)."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key.path=value, e.g. train.lr=1e-4")
        key, raw = item.split("=", 1)
        node = data
        parts = key.strip().split(".")
        if not all(parts):
            raise ConfigError(f"override {item!r}: the key {key!r} has an empty part; write it like train.lr=1e-4")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {p} is not a section")
        try:
            node[parts[-1]] = yaml.safe_load(raw)
        except yaml.YAMLError as e:
            problem = getattr(e, "problem", None) or str(e).splitlines()[0]
            raise ConfigError(
                f"override {item!r}: the value is not valid YAML ({problem}); quote it "
                f"({key}='\"{raw}\"') or close its brackets"
            ) from None
    return data


def read_yaml(path: str | Path) -> dict:
    """The mapping in YAML file ``path`` (empty file: ``{}``); needs PyYAML only, never torch.

    Raises ConfigError naming the file and the fix: missing, a directory, unreadable, not UTF-8, a YAML
    syntax error (with its line and column), or not a mapping at the top level."""
    path = Path(path)
    if path.is_dir():
        inside = sorted(path.glob("*.yaml"))
        raise ConfigError(
            f"{path} is a directory, not a YAML file; pass a file" + (f" such as {inside[0]}" if inside else "")
        )
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(
            f"{path} does not exist; check the path (shipped recipes: {Path(__file__).resolve().parent / 'recipes'})"
        ) from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path} is not UTF-8 text (byte {e.start}: {e.reason}); save it as UTF-8 YAML") from None
    except OSError as e:
        raise ConfigError(
            f"{path} cannot be read ({e.strerror or e}); fix its permissions or pass a readable copy"
        ) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: {_yaml_problem(e)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path}: a config file must hold a mapping at its top level (key: value lines), "
            f"got a {type(data).__name__}"
        )
    return data


def _yaml_problem(e: "yaml.YAMLError") -> str:
    """One line for a PyYAML error: where (1-based line, column), what, and the usual fixes."""
    mark, context_mark = getattr(e, "problem_mark", None), getattr(e, "context_mark", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    context = (
        (getattr(e, "context", None) or "").removeprefix("while ").removeprefix("parsing ").removeprefix("scanning ")
    )
    began = (
        f" ({context} began at line {context_mark.line + 1})"
        if context and context_mark is not None and (mark is None or context_mark.line != mark.line)
        else ""
    )
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    return (
        f"YAML syntax error at {where}{problem}{began}; fix that line: indent with spaces, close brackets and "
        f"quotes, quote values that hold ': ' or ' #'"
    )


def read_config_data(path: str | Path | None = None, overrides: list[str] | None = None) -> dict:
    """The plain mapping ``load_config`` builds from: YAML file ``path`` (``{}`` when None) with dotted
    ``overrides`` applied. Needs PyYAML only (the CLI calls it before importing torch).

    Raises ConfigError (``read_yaml``; an override that is not ``key.path=value`` or not YAML)."""
    data = read_yaml(path) if path is not None else {}
    return apply_overrides(data, list(overrides or []))


def load_config(cls: type[T], path: str | Path | None = None, overrides: list[str] | None = None) -> T:
    """Load ``cls`` from YAML file ``path`` (or its defaults when None) plus dotted ``overrides``.

    Raises ConfigError naming the offending key, or the file and the fix (missing, unreadable, YAML syntax:
    ``read_yaml``)."""
    return from_dict(cls, read_config_data(path, overrides))


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
