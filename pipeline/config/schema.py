"""Config declared once: a table is a frozen dataclass whose fields carry their type, default,
check and one-line doc; this module parses TOML into it and writes the reference in
docs/run-file.md from it, so the two can never disagree.

    max_tokens: int = setting(2048, "completion tokens per request", check=at_least(1))

Errors name the file and the key path (``run.toml: datasets[2].token_budget: ...``); an unknown
key gets a "did you mean" from the table's own field names.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .tokens import parse_tokens

__all__ = [
    "Check",
    "Table",
    "at_least",
    "finite_at_least",
    "matches",
    "one_of",
    "parse_table",
    "reference_markdown",
    "setting",
    "within",
]

_REQUIRED = dataclasses.MISSING


@dataclass(frozen=True)
class Check:
    """A rule on one value: ``test`` is true when the value is fine; ``text`` says the rule."""

    test: Callable[[Any], bool]
    text: str

    def problem(self, value: Any) -> str | None:
        return None if self.test(value) else f"{self.text}, got {value!r}"


def at_least(lowest: float) -> Check:
    return Check(lambda v: v >= lowest, f"must be at least {lowest:g}")


def finite_at_least(lowest: float) -> Check:
    return Check(lambda v: math.isfinite(v) and v >= lowest, f"must be a number >= {lowest:g}")


def within(lowest: float, highest: float, *, include_high: bool = True, include_low: bool = True) -> Check:
    def test(v: float) -> bool:
        low_ok = v >= lowest if include_low else v > lowest
        high_ok = v <= highest if include_high else v < highest
        return math.isfinite(v) and low_ok and high_ok

    text = f"must be in {'[' if include_low else '('}{lowest:g}, {highest:g}{']' if include_high else ')'}"
    return Check(test, text)


def one_of(*choices: str) -> Check:
    return Check(lambda v: v in choices, f"must be one of {', '.join(choices)}")


def matches(pattern: str, text: str) -> Check:
    compiled = re.compile(pattern)
    return Check(lambda v: bool(compiled.match(v)), text)


def setting(
    default: Any = _REQUIRED,
    doc: str = "",
    *,
    check: Check | None = None,
    tokens: bool = False,
    clean: Callable[[Any], Any] | None = None,
    internal: bool = False,
) -> Any:
    """A table field. ``tokens``: accepts 10M / 500k / 12000. ``clean`` normalises the raw value
    before the check. ``internal``: not read from the file (set by the loader)."""
    metadata = {"doc": doc, "check": check, "tokens": tokens, "clean": clean, "internal": internal}
    if default is _REQUIRED:
        return field(metadata=metadata)
    if dataclasses.is_dataclass(default) or isinstance(default, (dict, list)):
        return field(default_factory=lambda: _copy(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def _copy(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(value)
    return type(value)(value)


class Table:
    """One TOML table under validation; knows its place for error messages."""

    def __init__(self, data: Any, where: str, origin: str):
        if not isinstance(data, dict):
            raise ConfigError(f"{origin}: {where or 'top level'}: expected a table")
        self.data, self.where, self.origin = data, where, origin

    def key(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def fail(self, key: str, message: str) -> ConfigError:
        return ConfigError(f"{self.origin}: {self.key(key)}: {message}")

    def child(self, key: str, data: Any) -> Table:
        return Table(data, self.key(key), self.origin)


@dataclass(frozen=True)
class _Context:
    origin: str
    base_dir: Path

    def resolve(self, raw: str) -> Path:
        candidate = Path(raw).expanduser()
        return candidate if candidate.is_absolute() else self.base_dir / candidate


_KIND_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true/false", list: "a list", dict: "a table"}


def _unwrap_optional(hint: Any) -> tuple[Any, bool]:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return hint, False


def _expect(table: Table, key: str, value: Any, kinds: tuple[type, ...]) -> Any:
    if isinstance(value, bool) and bool not in kinds:
        raise table.fail(key, f"expected {' or '.join(_KIND_NAMES[k] for k in kinds)}, got a boolean")
    if not isinstance(value, kinds):
        raise table.fail(key, f"expected {' or '.join(_KIND_NAMES[k] for k in kinds)}, got {type(value).__name__} {value!r}")
    return value


def _value(hint: Any, raw: Any, table: Table, key: str, meta: dict[str, Any], ctx: _Context) -> Any:
    hint, _ = _unwrap_optional(hint)
    if meta.get("tokens"):
        _expect(table, key, raw, (int, str, float))
        try:
            return parse_tokens(raw)
        except ValueError as exc:
            raise table.fail(key, str(exc)) from None
    if hint is bool:
        return _expect(table, key, raw, (bool,))
    if hint is int:
        return _expect(table, key, raw, (int,))
    if hint is float:
        value = float(_expect(table, key, raw, (int, float)))
        if not math.isfinite(value):
            raise table.fail(key, f"must be a finite number, got {raw!r}")
        return value
    if hint is str:
        return _expect(table, key, raw, (str,))
    if hint is Path:
        return ctx.resolve(_expect(table, key, raw, (str,)))
    if dataclasses.is_dataclass(hint):
        return parse_table(typing.cast(type, hint), table.child(key, raw).data, table.key(key), ctx)
    origin = typing.get_origin(hint)
    if origin is dict:
        return dict(_expect(table, key, raw, (dict,)))
    if origin is tuple:
        (item,) = [a for a in typing.get_args(hint) if a is not Ellipsis]
        items = _expect(table, key, raw, (list,))
        return tuple(_value(item, element, table, f"{key}[{i}]", {}, ctx) for i, element in enumerate(items))
    raise TypeError(f"no parser for {hint!r} ({table.key(key)})")  # a schema bug, not a user error


def _fields(cls: type) -> list[tuple[dataclasses.Field[Any], Any]]:
    hints = typing.get_type_hints(cls)
    return [(f, hints[f.name]) for f in dataclasses.fields(cls) if not f.metadata.get("internal")]


def parse_table(cls: type, data: Any, where: str, ctx: _Context | tuple[str, Path]) -> Any:
    """Build ``cls`` from a TOML table: every key checked, unknown keys refused."""
    if isinstance(ctx, tuple):
        ctx = _Context(*ctx)
    table = Table(data, where, ctx.origin)
    known = _fields(cls)
    names = [f.name for f, _ in known]
    refused: dict[str, str] = getattr(cls, "REFUSED_KEYS", {})
    for key in table.data:
        if key in refused:
            raise table.fail(key, refused[key])
        if key not in names:
            hint = difflib.get_close_matches(key, names, n=1)
            raise table.fail(key, "unknown key" + (f" (did you mean {hint[0]!r}?)" if hint else ""))
    values: dict[str, Any] = {}
    for f, hint in known:
        if f.name not in table.data:
            if f.default is _REQUIRED and f.default_factory is _REQUIRED:
                raise table.fail(f.name, "missing (required)")
            if isinstance(f.default, Path):  # a default path is relative to the run file too
                values[f.name] = ctx.resolve(str(f.default))
            continue
        raw = table.data[f.name]
        if (clean := f.metadata.get("clean")) is not None and isinstance(raw, str):
            raw = clean(raw)
        value = _value(hint, raw, table, f.name, dict(f.metadata), ctx)
        check: Check | None = f.metadata.get("check")
        if check is not None and (problem := check.problem(value)) is not None:
            raise table.fail(f.name, problem)
        values[f.name] = value
    built = cls(**values)
    finish = getattr(cls, "finish_table", None)
    return finish(built, table) if finish is not None else built


# ---- the reference in docs/run-file.md ---------------------------------------------------------


def _type_text(hint: Any, meta: dict[str, Any]) -> str:
    hint, _ = _unwrap_optional(hint)
    if meta.get("tokens"):
        return "tokens (`10M`, `500k`, `12000`)"
    simple = {bool: "bool", int: "int", float: "number", str: "string", Path: "path"}
    if hint in simple:
        return simple[hint]
    origin = typing.get_origin(hint)
    if origin is dict:
        return "table"
    if origin is tuple:
        (item,) = [a for a in typing.get_args(hint) if a is not Ellipsis]
        return f"list of {_type_text(item, {})}"
    return getattr(hint, "__name__", str(hint))


def _default_text(f: dataclasses.Field[Any]) -> str:
    if f.default is _REQUIRED and f.default_factory is _REQUIRED:
        return "**required**"
    factory = f.default_factory
    value = factory() if callable(factory) else f.default
    if value is None:
        return "-"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, (tuple, list)):
        return "`[" + ", ".join(f'"{v}"' if isinstance(v, str) else str(v) for v in value) + "]`"
    if isinstance(value, dict):
        return "`{}`" if not value else f"`{value}`"
    if isinstance(value, (str, Path)):
        return f'`"{value}"`'
    return f"`{value:g}`" if isinstance(value, float) else f"`{value}`"


def _tables(cls: type, name: str) -> list[tuple[str, type]]:
    found = [(name, cls)]
    for f, hint in _fields(cls):
        inner, _ = _unwrap_optional(hint)
        if dataclasses.is_dataclass(inner):
            found += _tables(typing.cast(type, inner), f"[{f.name}]")
        elif typing.get_origin(inner) is tuple:
            (item,) = [a for a in typing.get_args(inner) if a is not Ellipsis]
            if dataclasses.is_dataclass(item):
                found += _tables(typing.cast(type, item), f"[[{f.name}]]")
    return found


def reference_markdown(root: type) -> str:
    """Every table of ``root`` as Markdown: key, type, default, what it does."""
    out: list[str] = []
    for title, cls in _tables(root, "top level"):
        rows = []
        for f, hint in _fields(cls):
            inner, _ = _unwrap_optional(hint)
            if dataclasses.is_dataclass(inner) or (
                typing.get_origin(inner) is tuple and dataclasses.is_dataclass(typing.get_args(inner)[0])
            ):
                continue
            check: Check | None = f.metadata.get("check")
            doc = f.metadata.get("doc", "") + (f" ({check.text})" if check is not None else "")
            rows.append(f"| `{f.name}` | {_type_text(hint, dict(f.metadata))} | {_default_text(f)} | {doc} |")
        summary = (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else ""
        out += [f"**{title}**: {summary}", "", "| key | type | default | meaning |", "|---|---|---|---|", *rows, ""]
    return "\n".join(out).rstrip() + "\n"
