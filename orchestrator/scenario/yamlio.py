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

Bounds, checked before anything is built or echoed (docs/contracts.md, "Input files"): a file is
a regular file of at most `MAX_FILE_BYTES`; before the document is built its parse events are
counted, so a document of more than `MAX_NODES` values, lists and mappings with every alias
expanded (a 605-byte alias bomb expands to billions), nested deeper than `MAX_DEPTH`, or with
a value longer than `MAX_SCALAR_CHARS` is refused at the line where the bound is crossed; an
error quotes a value through `moe.vocab.clip` (at most 80 characters).
"""

from __future__ import annotations

import difflib
import math
import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from moe.vocab import clip, is_number

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
    "read_bounded",
]

_MISSING: Any = object()
_KEY = re.compile(r"^[\w+-]{1,64}$")  # a key shown as written in a field path

MAX_FILE_BYTES = 1 << 20  # 1 MiB: the largest shipped file is under 6 kB
MAX_NODES = 200_000  # values, lists and mappings, each alias counted as what it expands to
MAX_DEPTH = 64  # lists and mappings inside each other (libyaml's composer recurses)
MAX_SCALAR_CHARS = 4096  # one value (a description, a path); a longer one is not a setting


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
                f"duplicate key {clip(key)} (first on line {out.lines[key]})",
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


class _Open:
    """A list or mapping the bounds walk is inside: its anchor, its size with aliases expanded,
    and where the next item goes (`key` of a mapping, `index` of a list)."""

    def __init__(self, anchor: str | None, mapping: bool, field: str) -> None:
        self.anchor, self.mapping, self.field = anchor, mapping, field
        self.size = 1
        self.index = 0
        self.key: str | None = None  # a mapping's current key; None: the next node is a key
        self.keys: dict[str, int] = {}  # a mapping's plain keys so far → their lines

    def child(self) -> str:
        """The field path of the node that comes next in this collection."""
        if not self.mapping:
            return f"{self.field}[{self.index}]"
        key = self.key if self.key is not None else "?"
        name = key if _KEY.match(key) else clip(key, 40)
        return f"{self.field}.{name}" if self.field else name

    def done_item(self, scalar: str | None) -> None:
        """A node of this collection ended (`scalar`: its text when it was a plain value)."""
        if not self.mapping:
            self.index += 1
        elif self.key is None:
            self.key = scalar if scalar is not None else "?"
        else:
            self.key = None


def _check_bounds(text: str, file: str) -> None:
    """Walk the parse events (no document is built) and refuse, at its line and field, a
    document past MAX_NODES once every alias is expanded, MAX_DEPTH deep or with a value past
    MAX_SCALAR_CHARS. An alias counts what its anchor expanded to (remembered, never
    re-expanded), so the walk is linear in the text whatever the aliases multiply to."""
    loader = _BaseLoader(text)
    sizes: dict[str, int] = {}  # anchor → expanded node count
    stack: list[_Open] = []
    total = 0

    def fail(message: str, line: int | None) -> InputError:
        field = stack[-1].child() if stack else ""
        return InputError(message, file=file, line=line, field=field)

    try:
        while loader.check_event():
            event = loader.get_event()
            line = event.start_mark.line + 1 if event.start_mark is not None else None
            scalar = None
            if isinstance(event, yaml.AliasEvent):
                if any(o.anchor == event.anchor for o in stack):
                    raise fail(f"the alias {clip(event.anchor, 40)} refers to a list or "
                               "mapping that holds it (a value without end)", line)
                size = sizes.get(event.anchor, 1)  # an unknown anchor: the composer says so
            elif isinstance(event, yaml.ScalarEvent):
                if len(event.value) > MAX_SCALAR_CHARS:
                    raise fail(f"a value of {len(event.value):,} characters (at most "
                               f"{MAX_SCALAR_CHARS:,})", line)
                _check_tag(event, fail, line)
                size, scalar = 1, event.value
                top = stack[-1] if stack else None
                if top is not None and top.mapping and top.key is None and scalar != "<<":
                    if scalar in top.keys:
                        top.key = scalar
                        raise fail(f"duplicate key (first on line {top.keys[scalar]})", line)
                    top.keys[scalar] = line or 0
                if event.anchor is not None:
                    sizes[event.anchor] = 1
            elif isinstance(event, yaml.CollectionStartEvent):
                _check_tag(event, fail, line)
                field = stack[-1].child() if stack else ""
                stack.append(_Open(event.anchor, isinstance(event, yaml.MappingStartEvent),
                                   field))
                total += 1
                if len(stack) > MAX_DEPTH:
                    raise InputError(f"lists and mappings nested more than {MAX_DEPTH} deep",
                                     file=file, line=line, field=field[:40] + "…")
                if total > MAX_NODES:
                    raise _too_many(file, line, field)
                continue
            elif isinstance(event, yaml.CollectionEndEvent):
                done = stack.pop()
                if done.anchor is not None:
                    sizes[done.anchor] = done.size
                if stack:
                    stack[-1].size += done.size
                    stack[-1].done_item(None)
                continue
            else:
                continue
            total += size
            if total > MAX_NODES:
                raise fail(_too_many(file, line).message, line)
            if stack:
                stack[-1].size += size
                stack[-1].done_item(scalar)
    except yaml.MarkedYAMLError as exc:
        # libyaml >= 0.2.5 (PyYAML 6.0.4's) scans flow collections ahead and stops at its own
        # depth limit before the events above reach MAX_DEPTH: the same refusal, our words
        if "nesting depth" not in (exc.problem or ""):
            raise
        mark = exc.problem_mark
        raise InputError(f"lists and mappings nested more than {MAX_DEPTH} deep", file=file,
                         line=mark.line + 1 if mark is not None else None,
                         field=(stack[-1].child() if stack else "")[:40] + "…") from None
    finally:
        loader.dispose()


# the tags a safe load builds; any other explicit tag (`!!python/object`, `!custom`) is refused
# at its field before anything is built
_TAGS = {None, "!", *(f"tag:yaml.org,2002:{t}" for t in ("str", "int", "float", "bool", "null",
                                                        "seq", "map"))}


def _check_tag(event: Any, fail: Any, line: int | None) -> None:
    if event.tag not in _TAGS:
        raise fail(f"the tag {clip(event.tag, 60)} is not allowed (plain values, lists and "
                   "mappings only)", line)


def _too_many(file: str, line: int | None, field: str = "") -> InputError:
    return InputError(f"more than {MAX_NODES:,} values, lists and mappings once aliases are "
                      "expanded (an alias repeats what its anchor holds)", file=file, line=line,
                      field=field)


def load_yaml_text(text: str, file: str = "<string>") -> Any:
    """Parse one YAML document within the bounds above; mappings come back as `YMap`,
    sequences as `YList`."""
    if len(text) > MAX_FILE_BYTES:
        raise InputError(f"{len(text):,} characters, more than the {MAX_FILE_BYTES:,} bytes a "
                         "scenario or topology may hold", file=file)
    loader = None
    try:
        _check_bounds(text, file)
        loader = _LineLoader(text)
        loader.file = file
        return loader.get_single_data()
    except yaml.reader.ReaderError as exc:  # a character YAML refuses: its line, not its text
        line = text.count("\n", 0, exc.position) + 1
        code = exc.character if isinstance(exc.character, int) else ord(exc.character[:1] or " ")
        raise InputError(f"not valid YAML: character #x{code:04x} is not allowed (control "
                         "characters are refused)", file=file, line=line) from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark is not None else None
        problem = exc.problem or exc.context or "unreadable"
        raise InputError(f"not valid YAML: {problem[:160]}", file=file, line=line) from None
    except yaml.YAMLError as exc:
        raise InputError(f"not valid YAML: {str(exc)[:160]}", file=file) from None
    except (ValueError, OverflowError, RecursionError) as exc:
        if isinstance(exc, InputError):
            raise
        # a constructor's own refusal (an integer of 5,000 digits, a bad date)
        raise InputError(f"a value cannot be read: {str(exc)[:120]}", file=file) from None
    finally:
        if loader is not None:
            loader.dispose()


def read_bounded(path: str | Path, limit: int, what: str) -> bytes:
    """The bytes of a regular file of at most `limit` bytes; an `InputError` naming the file
    otherwise (a folder, a device such as /dev/zero, a FIFO, a missing or larger file). The
    kind is checked before the file is opened (opening a FIFO would block) and the read stops
    at limit + 1 bytes, whatever the file's size says."""
    path = Path(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise InputError("file not found", file=str(path)) from None
    except OSError as exc:
        raise InputError(f"cannot read: {exc.strerror or type(exc).__name__}",
                         file=str(path)) from None
    if stat.S_ISDIR(st.st_mode):
        raise InputError(f"is a folder, not {what}", file=str(path))
    if not stat.S_ISREG(st.st_mode):
        raise InputError(f"is not a regular file (a device, FIFO or socket), not {what}",
                         file=str(path))
    if st.st_size > limit:
        raise InputError(f"{st.st_size:,} bytes, more than the {limit:,} {what} may hold",
                         file=str(path))
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError as exc:
        raise InputError(f"cannot read: {exc.strerror or type(exc).__name__}",
                         file=str(path)) from None
    if len(data) > limit:
        raise InputError(f"more than the {limit:,} bytes {what} may hold", file=str(path))
    return data


def load_yaml(path: str | Path) -> Any:
    """Read and parse a YAML file (`read_bounded`: a regular file of at most MAX_FILE_BYTES);
    a missing, unreadable, oversized or binary file is an `InputError`."""
    data = read_bounded(path, MAX_FILE_BYTES, "a YAML file")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"not UTF-8 text (byte {exc.start:,} is not): a YAML file is text",
                         file=str(path)) from None
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
    return clip(value)


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
        name = str(key) if _KEY.match(str(key)) else clip(key, 40)  # a key is echoed too
        field = f"{self.field}.{name}" if self.field else name
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
        raise loc.error(f"must be finite, got {clip(value)}")
    return value


class Section:
    """Reads one mapping key by key; `done()` refuses any key that was not read.

    Getters take a default (omit it to make the key required) and return plain Python values.
    `value(key, parse)` runs a parser `parse(raw, loc) -> T` for unit strings and nested parts.
    """

    def __init__(self, data: Any, loc: Loc, what: str = "a mapping") -> None:
        if loc.line is None and getattr(data, "line", None) is not None:
            loc = Loc(loc.file, loc.field, data.line)
        if not isinstance(data, Mapping):
            raise loc.error(f"must be {what}, got {describe(data)}")
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
                raise loc.error(f"must be one of {', '.join(choices)}, got {clip(raw)}")
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
        close = difflib.get_close_matches(str(key)[:100], known, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else f" (known: {', '.join(known)})"
        raise self.at(key).error(f"unknown field{hint}")


def check_range(
    value: float, loc: Loc, *, gt: float | None = None, ge: float | None = None,
    le: float | None = None,
) -> float:
    """`value` if inside the bounds, else an error that names the bound and the value."""
    if gt is not None and not value > gt:
        raise loc.error(f"must be > {gt:g}, got {clip(value)}")
    if ge is not None and not value >= ge:
        raise loc.error(f"must be >= {ge:g}, got {clip(value)}")
    if le is not None and not value <= le:
        raise loc.error(f"must be <= {le:g}, got {clip(value)}")
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
