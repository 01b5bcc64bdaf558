"""YAML that keeps lines: every error names the file, the line and the field."""

from __future__ import annotations

import string
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.scenario.yamlio import (
    InputError,
    Loc,
    Section,
    YList,
    YMap,
    load_yaml,
    load_yaml_text,
    locate,
)

DOC = """\
name: demo
nodes:
  - name: a
    users: 2
  - {name: b, users: 1}
links:
  - from: a
    to: b
    rate_mbit: -5
"""


def test_lines_of_keys_and_items() -> None:
    data = load_yaml_text(DOC, "demo.yaml")
    assert isinstance(data, YMap) and isinstance(data["nodes"], YList)
    assert data.line == 1
    assert data.lines == {"name": 1, "nodes": 2, "links": 6}
    assert data["nodes"].lines == [3, 5]
    assert data["nodes"][0].lines == {"name": 3, "users": 4}
    assert data["nodes"][1].lines == {"name": 5, "users": 5}
    assert data["links"][0].lines["rate_mbit"] == 9
    # still plain data
    assert data == yaml.safe_load(DOC)


def test_loc_paths_and_message_format() -> None:
    data = load_yaml_text(DOC, "demo.yaml")
    loc = Loc("demo.yaml").key(data, "links")
    bad = loc.item(data["links"], 0).key(data["links"][0], "rate_mbit")
    expected = "demo.yaml:9: links[0].rate_mbit: must be > 0, got -5"
    assert str(bad.error("must be > 0, got -5")) == expected
    err = bad.error("x")
    assert isinstance(err, ValueError)
    assert (err.file, err.line, err.field, err.message) == (
        "demo.yaml", 9, "links[0].rate_mbit", "x")


def test_input_error_without_parts() -> None:
    assert str(InputError("bad")) == "bad"
    assert str(InputError("bad", file="f.yaml")) == "f.yaml: bad"
    assert str(InputError("bad", file="f.yaml", line=3)) == "f.yaml:3: bad"
    assert str(InputError("bad", field="a.b")) == "a.b: bad"


def test_duplicate_key_is_an_error_with_both_lines() -> None:
    with pytest.raises(InputError) as info:
        load_yaml_text("a: 1\nb: 2\na: 3\n", "dup.yaml")
    assert str(info.value) == "dup.yaml:3: a: duplicate key (first on line 1)"


def test_syntax_error_names_the_line() -> None:
    with pytest.raises(InputError) as info:
        load_yaml_text("a: 1\nb: [1, 2\nc: 3\n", "broken.yaml")
    assert info.value.file == "broken.yaml"
    assert info.value.line is not None and info.value.line >= 2
    assert str(info.value).startswith(f"broken.yaml:{info.value.line}: not valid YAML: ")


def test_missing_file_and_folder(tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r"nope\.yaml: file not found$"):
        load_yaml(tmp_path / "nope.yaml")
    with pytest.raises(InputError, match="is a folder"):
        load_yaml(tmp_path)


def test_merge_keys_still_work() -> None:
    data = load_yaml_text("base: &b {x: 1, y: 2}\nother:\n  <<: *b\n  y: 3\n")
    assert data["other"] == {"x": 1, "y": 3}


def test_section_refuses_unknown_keys_with_a_suggestion() -> None:
    data = load_yaml_text("delay_ms: 3\nrate_mbits: 10\n", "l.yaml")
    sec = Section(data, Loc("l.yaml"))
    assert sec.number("delay_ms", ge=0) == 3
    sec.number("rate_mbit", 1000.0)
    with pytest.raises(InputError) as info:
        sec.done()
    assert str(info.value) == "l.yaml:2: rate_mbits: unknown field (did you mean 'rate_mbit'?)"


def test_section_getters_name_the_value() -> None:
    data = load_yaml_text("n: -1\ns: 3\nb: yes\nreq: 1\n", "g.yaml")
    sec = Section(data, Loc("g.yaml", "top"))
    with pytest.raises(InputError, match=r"^g.yaml:1: top.n: must be > 0, got -1$"):
        sec.number("n", gt=0)
    with pytest.raises(InputError, match=r"^g.yaml:2: top.s: must be a non-empty string, got 3$"):
        sec.str("s")
    with pytest.raises(InputError, match=r"top.b: must be a number, got True \(YAML reads yes"):
        sec.number("b")
    with pytest.raises(InputError, match=r"^g.yaml:1: top: missing required field 'zzz'$"):
        sec.raw("zzz")
    with pytest.raises(InputError, match=r"must be a mapping, got a list"):
        Section(load_yaml_text("[1]"), Loc("x.yaml"))


def test_locate_walks_paths_and_aliases() -> None:
    data = load_yaml_text("faults:\n  - at: 3s\n    link-down: a b\n  - {at: -1, node-down: c}\n",
                          "s.yaml")
    loc = Loc("s.yaml")
    err = locate(ValueError("faults[1].at_s: must be >= 0, got -1"), data, loc, {"at_s": "at"})
    assert str(err) == "s.yaml:4: faults[1].at: must be >= 0, got -1"
    err = locate(ValueError("faults[0].link-down: unknown node 'b'"), data, loc)
    assert str(err) == "s.yaml:3: faults[0].link-down: unknown node 'b'"
    # a path that is not in the file stays at the deepest line known
    err = locate(ValueError("faults[0].for: must be > 0"), data, loc)
    assert str(err) == "s.yaml:2: faults[0].for: must be > 0"
    # no path: the message stays at loc
    assert str(locate(ValueError("something broke"), data, loc)) == "s.yaml: something broke"


_keys = st.text(string.ascii_lowercase, min_size=1, max_size=8)
_scalars = st.one_of(st.integers(-10**6, 10**6), st.text(string.ascii_letters, min_size=1,
                                                          max_size=10), st.booleans())


@settings(max_examples=60, deadline=None)
@given(st.lists(st.dictionaries(_keys, _scalars, min_size=1, max_size=5), min_size=1, max_size=6))
def test_block_yaml_lines_point_at_their_text(items: list[dict]) -> None:
    """Whatever the data, each recorded line holds that key (block style, as people write)."""
    text = yaml.safe_dump({"items": items}, default_flow_style=False, sort_keys=False)
    data = load_yaml_text(text)
    assert data == {"items": items}
    lines = text.splitlines()
    for i, item in enumerate(data["items"]):
        assert lines[data["items"].lines[i] - 1].lstrip().startswith("- ")
        for key, line in item.lines.items():
            written = yaml.safe_dump(key).splitlines()[0]  # 'null', 'yes' come back quoted
            assert lines[line - 1].lstrip(" -").startswith(f"{written}:")
