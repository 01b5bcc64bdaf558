"""YAML that remembers where things were written, and errors that say so.

Topology and scenario files are read here and nowhere else. Every mapping and list the loader
builds remembers the line of each key and item, so a validator can say exactly where a bad value
sits: `quickstart.yaml:14: links[3].rate_mbit: must be > 0, got -5`.

Who does what:
- `load_yaml(path)` / `load_yaml_text(text, file)` parse (SafeLoader, duplicate keys refused);
- `Loc` is a position: file, field path (`links[3].rate_mbit`) and line; `loc.error(msg)` makes
  the `InputError` to raise;
- `Section` reads one mapping field by field and refuses keys nobody asked for (a typo such as
  `rate_mbits` is an error naming the closest known key, never silently ignored).

`InputError` is a `ValueError`, so `moemesh` maps it to exit code 2 with the message as is.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from moe.vocab import is_number

__all__ = [
    "InputError",
    "Loc",
    "Section",
    "YList",
    "YMap",
    "describe",
    "dump_yaml",
    "load_yaml",
    "load_yaml_text",
    "locate",
]

_MISSING: Any = object()


class InputError(ValueError):
    """A bad input file or value: `FILE:LINE: FIELD: MESSAGE` (each part only when known)."""

    def __init__(
        self, message: str, *, file: str | None = None, line: int | None = None, field: str = ""
    ) -> None:
        super().__init__(message)
        self.message = message
        self.file = file
        self.line = line
        self.field = field

    def __str__(self) -> str:
        where = ""
        if self.file:
            where = self.file if self.line is None else f"{self.file}:{self.line}"
        parts = [p for p in (where, self.field) if p]
        return ": ".join([*parts, self.message])


class YMap(dict):
    """A YAML mapping: a plain dict plus `line` (where it starts) and `lines[key]`."""

    line: int | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lines: dict[Any, int] = {}


class YList(list):
    """A YAML sequence: a plain list plus `line` and `lines[i]` (each item's line)."""

    line: int | None = None

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.lines: list[int] = []


# libyaml's parser when PyYAML has it (about 5x faster), the pure-Python one otherwise.
_BaseLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class _LineLoader(_BaseLoader):  # type: ignore[misc, valid-type]
    """A safe loader whose mappings and sequences keep 1-based line numbers."""

    file = "<string>"


def _construct_map(loader: _LineLoader, node: yaml.MappingNode) -> YMap:
    explicit = sum(1 for k, _ in node.value if k.tag != "tag:yaml.org,2002:merge")
    loader.flatten_mapping(node)  # YAML merge keys (<<: *anchor) come first, then our own
    merged = len(node.value) - explicit
    out = YMap()
    out.line = node.start_mark.line + 1
    explicit_keys: set[Any] = set()
    for i, (key_node, value_node) in enumerate(node.value):
        key = loader.construct_object(key_node, deep=True)
        line = key_node.start_mark.line + 1
        try:
            hash(key)
        except TypeError:
            raise InputError("a mapping key must be a plain value", file=loader.file,
                             line=line) from None
        if i >= merged and key in explicit_keys:
            raise InputError(
                f"duplicate key {key!r} (first on line {out.lines[key]})",
                file=loader.file, line=line,
            )
        if i >= merged:
            explicit_keys.add(key)
        out[key] = loader.construct_object(value_node, deep=True)
        out.lines[key] = line
    return out


def _construct_list(loader: _LineLoader, node: yaml.SequenceNode) -> YList:
    out = YList()
    out.line = node.start_mark.line + 1
    for item in node.value:
        out.append(loader.construct_object(item, deep=True))
        out.lines.append(item.start_mark.line + 1)
    return out


_LineLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_map)
_LineLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_SEQUENCE_TAG, _construct_list)


def load_yaml_text(text: str, file: str = "<string>") -> Any:
    """Parse one YAML document; mappings come back as `YMap`, sequences as `YList`."""
    loader = _LineLoader(text)
    loader.file = file
    try:
        return loader.get_single_data()
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark is not None else None
        problem = exc.problem or exc.context or "unreadable"
        raise InputError(f"not valid YAML: {problem}", file=file, line=line) from None
    except yaml.YAMLError as exc:
        raise InputError(f"not valid YAML: {exc}", file=file) from None
    finally:
        loader.dispose()


def load_yaml(path: str | Path) -> Any:
    """Read and parse a YAML file; a missing or unreadable file is an `InputError`."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError("file not found", file=str(path)) from None
    except IsADirectoryError:
        raise InputError("is a folder, not a YAML file", file=str(path)) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read: {exc}", file=str(path)) from None
    return load_yaml_text(text, str(path))


def describe(value: Any) -> str:
    """A value as an error message shows it, with a hint for YAML's surprising booleans."""
    if isinstance(value, bool):
        return f"{value!r} (YAML reads yes/no/on/off/true/false as booleans: quote it)"
    if isinstance(value, YMap):
        return "a mapping"
    if isinstance(value, YList):
        return "a list"
    if value is None:
        return "nothing (an empty value)"
    return repr(value)


@dataclass(frozen=True)
class Loc:
    """Where a value sits: file, dotted field path and line (each may be unknown)."""

    file: str | None = None
    field: str = ""
    line: int | None = None

    def key(self, mapping: Any, key: str) -> Loc:
        """The position of `mapping[key]` (the key's own line when the mapping knows it)."""
        lines = getattr(mapping, "lines", {})
        line = lines.get(key) if isinstance(lines, dict) else None
        if line is None:
            line = getattr(mapping, "line", None) or self.line
        field = f"{self.field}.{key}" if self.field else str(key)
        return Loc(self.file, field, line)

    def item(self, seq: Any, index: int) -> Loc:
        """The position of `seq[index]`."""
        lines = getattr(seq, "lines", [])
        line = lines[index] if index < len(lines) else (getattr(seq, "line", None) or self.line)
        return Loc(self.file, f"{self.field}[{index}]", line)

    def sub(self, name: str) -> Loc:
        """A named part of this value on the same line (`links[3]` → `links[3].rate_mbit`)."""
        return Loc(self.file, f"{self.field}.{name}" if self.field else name, self.line)

    def error(self, message: str) -> InputError:
        return InputError(message, file=self.file, line=self.line, field=self.field)


def _number(value: Any, loc: Loc) -> float:
    if not is_number(value, finite=False):
        raise loc.error(f"must be a number, got {describe(value)}")
    if not math.isfinite(value):
        raise loc.error(f"must be finite, got {value!r}")
    return value


class Section:
    """Reads one mapping key by key; `done()` refuses any key that was not read.

    Getters take a default (omit it to make the key required) and return plain Python values.
    `value(key, parse)` runs a parser `parse(raw, loc) -> T` for unit strings and nested parts.
    """

    def __init__(self, data: Any, loc: Loc, what: str = "a mapping") -> None:
        if not isinstance(data, Mapping):
            raise loc.error(f"must be {what}, got {describe(data)}")
        if loc.line is None and getattr(data, "line", None) is not None:
            loc = Loc(loc.file, loc.field, data.line)
        self.data = data
        self.loc = loc
        self._read: set[Any] = set()
        self._known: set[Any] = set()  # keys asked about: what `done` suggests from

    def __contains__(self, key: str) -> bool:
        self._known.add(key)
        return key in self.data

    def at(self, key: str) -> Loc:
        return self.loc.key(self.data, key)

    def raw(self, key: str, default: Any = _MISSING) -> Any:
        self._read.add(key)
        if key in self.data:
            return self.data[key]
        if default is _MISSING:
            raise self.loc.error(f"missing required field {key!r}")
        return default

    def value(self, key: str, parse: Any, default: Any = _MISSING) -> Any:
        """`parse(raw, loc)` of the key's value, or the default (not parsed) when absent."""
        self._read.add(key)
        if key not in self.data:
            if default is _MISSING:
                raise self.loc.error(f"missing required field {key!r}")
            return default
        return parse(self.data[key], self.at(key))

    def str(self, key: str, default: Any = _MISSING, choices: tuple[str, ...] = ()) -> Any:
        def parse(raw: Any, loc: Loc) -> str:
            if not isinstance(raw, str) or not raw.strip():
                raise loc.error(f"must be a non-empty string, got {describe(raw)}")
            if choices and raw not in choices:
                raise loc.error(f"must be one of {', '.join(choices)}, got {raw!r}")
            return raw

        return self.value(key, parse, default)

    def _typed(self, key: str, kind: type, what: str, default: Any,
               convert: Any = None) -> Any:
        """A value of one Python type (`what` names it in the error), optionally converted."""
        def parse(raw: Any, loc: Loc) -> Any:
            if not isinstance(raw, kind):
                raise loc.error(f"must be {what}, got {describe(raw)}")
            return raw if convert is None else convert(raw)

        return self.value(key, parse, default)

    def text(self, key: str, default: Any = _MISSING) -> Any:
        """Any string, empty allowed (descriptions)."""
        return self._typed(key, str, "text", default)

    def list(self, key: str, default: Any = _MISSING) -> Any:
        """A YAML list, as a tuple."""
        return self._typed(key, list, "a list", default, tuple)

    def unit(self, key: str, parse: Any, default: Any = _MISSING) -> Any:
        """A number in the key's unit, or a string `parse` reads ("20ms", "1gbit", "10s").

        Numbers pass through as written, so the range check that follows shows them unchanged.
        """
        def read(raw: Any, loc: Loc) -> Any:
            if is_number(raw, finite=False):
                return raw
            try:
                return parse(raw)
            except ValueError as exc:
                raise loc.error(str(exc)) from None

        return self.value(key, read, default)

    def number(
        self, key: str, default: Any = _MISSING, *, gt: float | None = None,
        ge: float | None = None, le: float | None = None,
    ) -> Any:
        def parse(raw: Any, loc: Loc) -> float:
            return check_range(_number(raw, loc), loc, gt=gt, ge=ge, le=le)

        return self.value(key, parse, default)

    def boolean(self, key: str, default: Any = _MISSING) -> Any:
        return self._typed(key, bool, "true or false", default)

    def done(self) -> None:
        """Raise at the first key that no getter asked for, suggesting the closest known one."""
        unknown = [k for k in self.data if k not in self._read]
        if not unknown:
            return
        key = unknown[0]
        known = sorted(str(k) for k in self._read | self._known)
        close = difflib.get_close_matches(str(key), known, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else f" (known: {', '.join(known)})"
        raise self.at(key).error(f"unknown field{hint}")


def check_range(
    value: float, loc: Loc, *, gt: float | None = None, ge: float | None = None,
    le: float | None = None,
) -> float:
    """`value` if inside the bounds, else an error that names the bound and the value."""
    if gt is not None and not value > gt:
        raise loc.error(f"must be > {gt:g}, got {value!r}")
    if ge is not None and not value >= ge:
        raise loc.error(f"must be >= {ge:g}, got {value!r}")
    if le is not None and not value <= le:
        raise loc.error(f"must be <= {le:g}, got {value!r}")
    return value


_PATH = re.compile(r"^([A-Za-z_][\w+-]*(?:\[\d+\])*(?:\.[A-Za-z_][\w+-]*(?:\[\d+\])*)*): (.+)$",
                   re.S)
_SEGMENT = re.compile(r"\[\d+\]|[^.\[\]]+")


def locate(
    exc: Exception, data: Any, loc: Loc, aliases: Mapping[str, str] | None = None
) -> InputError:
    """Put a dataclass's `ValueError("faults[2].at_s: must be >= 0, got -1")` on its line.

    The message's leading field path is walked through the parsed YAML `data` (at `loc`);
    `aliases` renames dataclass fields to the YAML keys people write (`at_s` → `at`; an empty
    alias drops the segment). A message without a path stays at `loc`.
    """
    text = str(exc)
    match = _PATH.match(text)
    if match is None:
        return loc.error(text)
    path, message = match.groups()
    aliases = aliases or {}
    here, node = loc, data
    for seg in _SEGMENT.findall(path):
        if seg.startswith("["):
            index = int(seg[1:-1])
            if isinstance(node, list) and index < len(node):
                here, node = here.item(node, index), node[index]
            else:
                here, node = Loc(here.file, f"{here.field}{seg}", here.line), None
            continue
        key = aliases.get(seg, seg)
        if not key:
            continue
        if isinstance(node, Mapping) and key in node:
            here, node = here.key(node, key), node[key]
        else:
            here, node = here.sub(key), None
    return here.error(message)


def _flow(value: Any) -> str:
    text = yaml.safe_dump(value, default_flow_style=True, width=10**6, sort_keys=False,
                          allow_unicode=True)
    return text.removesuffix("\n").removesuffix("\n...").strip()


def dump_yaml(data: Mapping[str, Any], header: str = "") -> str:
    """YAML people can read: top-level keys in block style, each list item on its own line.

    `header` becomes `#` comment lines on top. The text parses back to `data`.
    """
    lines = [f"# {line}".rstrip() for line in header.splitlines()]
    for key, value in data.items():
        if isinstance(value, list) and value:
            lines.append(f"{_flow(key)}:")
            lines.extend(f"  - {_flow(item)}" for item in value)
        else:
            lines.append(f"{_flow(key)}: {_flow(value)}")
    return "\n".join(lines) + "\n"
