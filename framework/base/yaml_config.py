"""Strict conversion between YAML/dicts and Tessera's typed tree of frozen dataclasses.

Every config section is a `@dataclass(kw_only=True, frozen=True)`. Loading is strict: an unknown key raises a
`ConfigError` naming the dotted path and the closest valid keys; a value of the wrong type names the expected
type. A section may define `validate(self) -> None` for its cross-field checks; `build()` calls every one of
them, innermost first.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

import yaml

from framework.base.errors import ConfigError

T = TypeVar("T")

_MISSING = object()


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in get_args(tp))
    if tp is type(None):
        return "null"
    if dataclasses.is_dataclass(tp):
        return f"a mapping ({getattr(tp, '__name__', tp)})"
    if origin is not None:
        return str(tp).replace("typing.", "")
    return getattr(tp, "__name__", str(tp))


def _convert(value: Any, tp: Any, path: str) -> Any:
    """Convert `value` to type `tp` or raise a ConfigError naming `path` and the expected type."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        if value is None:
            value = {}
        if dataclasses.is_dataclass(value) and isinstance(value, tp):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path or '<root>'}: expected {_type_name(tp)}, got {value!r}; write it as a mapping")
        return from_dict(tp, value, path)
    if origin is Literal:
        choices = get_args(tp)
        if value not in choices or type(value) is not type(choices[choices.index(value)]):
            raise ConfigError(f"{path}={value!r}: expected {_type_name(tp)}; set {path} to one of those")
        return value
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(value, arg, path)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(f"{path}={value!r}: expected {_type_name(tp)}")
    if origin in (list, tuple, Sequence):
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{path}={value!r}: expected a list ({_type_name(tp)})")
        args = get_args(tp)
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(args) != len(value):
                raise ConfigError(f"{path}={value!r}: expected {len(args)} items ({_type_name(tp)})")
            return tuple(_convert(v, a, f"{path}[{i}]") for i, (v, a) in enumerate(zip(value, args, strict=True)))
        item = args[0] if args else Any
        items = [_convert(v, item, f"{path}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin in (dict, Mapping):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path}={value!r}: expected a mapping ({_type_name(tp)})")
        kt, vt = get_args(tp) or (Any, Any)
        return {_convert(k, kt, f"{path}.<key>"): _convert(v, vt, f"{path}.{k}") for k, v in value.items()}
    if tp is float:
        if isinstance(value, str):
            # PyYAML (YAML 1.1) reads 3e-4 — no dot in the mantissa — as a string; accept what float() reads.
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{path}={value!r}: expected a float; write a number such as 3e-4")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}={value!r}: expected an int; write a whole number such as 8")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}={value!r}: expected a bool; write true or false")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}={value!r}: expected a str; quote the value")
        return value
    if tp is Path:
        if not isinstance(value, str | Path):
            raise ConfigError(f"{path}={value!r}: expected a path string")
        return Path(value)
    if isinstance(tp, type) and isinstance(value, tp):
        return value
    raise ConfigError(f"{path}={value!r}: expected {_type_name(tp)}")


def from_dict(cls: type[T], data: Mapping[str, Any], path: str = "") -> T:
    """Build dataclass `cls` from `data`, strictly. Nested sections are converted recursively."""
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        dotted = f"{path}.{key}" if path else str(key)
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=3, cutoff=0.5)
            hint = f"did you mean {', '.join(close)}?" if close else f"valid keys: {', '.join(sorted(fields))}"
            raise ConfigError(f"unknown config key '{dotted}'; {hint}")
        kwargs[key] = _convert(value, hints[key], dotted)
    for name, f in fields.items():
        if name not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            dotted = f"{path}.{name}" if path else name
            raise ConfigError(f"missing required config key '{dotted}' ({_type_name(hints[name])}); add it")
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"{path or '<root>'}: {err}") from err


def to_dict(obj: Any) -> Any:
    """The plain-Python (YAML-safe) form of a config tree."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, list | tuple):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {str(k): to_dict(v) for k, v in obj.items()}
    if isinstance(obj, Path):
        return str(obj)
    return obj


def validate_tree(obj: Any, path: str = "") -> None:
    """Call `validate()` on every section, innermost first."""
    if not (dataclasses.is_dataclass(obj) and not isinstance(obj, type)):
        return
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        items = value if isinstance(value, list | tuple) else [value]
        for item in items:
            validate_tree(item, f"{path}.{f.name}" if path else f.name)
    validate = getattr(obj, "validate", None)
    if callable(validate):
        validate()


def parse_override(text: str) -> tuple[list[str], Any]:
    """Split `a.b.c=value` into its key path and a YAML-parsed value."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not of the form a.b.c=value; write e.g. train.lr=3e-4")
    key, raw = text.split("=", 1)
    keys = key.strip().split(".")
    if not all(keys):
        raise ConfigError(f"override {text!r} has an empty key segment; write e.g. train.lr=3e-4")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as err:
        raise ConfigError(f"override {text!r}: value is not valid YAML ({err})") from err
    return keys, value


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Apply `a.b.c=value` overrides to a nested dict (copying the parts it touches)."""
    out = dict(data)
    for text in overrides:
        keys, value = parse_override(text)
        node = out
        for k in keys[:-1]:
            child = node.get(k)
            child = dict(child) if isinstance(child, Mapping) else {}
            node[k] = child
            node = child
        node[keys[-1]] = value
    return out


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML mapping; an optional top-level `base:` names a file (relative to this one) to start from."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist; pass a YAML file such as configs/smoke/tiny.yaml")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML ({err})") from err
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping, got {type(data).__name__}")
    base = data.pop("base", None)
    if base is not None:
        data = deep_merge(load_yaml(path.parent / base), data)
    return data


def deep_merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """`over` merged into `base`, recursively for mappings."""
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def replace(obj: T, **changes: Any) -> T:
    """`dataclasses.replace` for frozen sections (re-export, so callers need not import dataclasses)."""
    return dataclasses.replace(obj, **changes)  # type: ignore[type-var]


__all__ = [
    "apply_overrides",
    "deep_merge",
    "from_dict",
    "load_yaml",
    "parse_override",
    "replace",
    "to_dict",
    "validate_tree",

]
