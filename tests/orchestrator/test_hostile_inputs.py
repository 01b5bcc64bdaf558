"""Broken and hostile scenario files (issue 38): each is refused with exit 2, naming the file,
the line and the field; no message quotes more than a short prefix of a value or any line of a
file the scenario points at; and none makes the CLI grow (an alias bomb is refused before it
is expanded).

Each case is a scenario text (`{topo}`: the shipped edge5 topology's path, `{secret}` a file of
"private" lines, `{dir}`: the case's folder), the line the error must name (None: a whole-file
refusal, named by file only) and a piece of the message.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT, moemesh

TOPO = ROOT / "experiments" / "scenarios" / "topologies" / "edge5.yaml"
HEAD = "topology: {topo}\nworkload: {rate_rps: 2, duration: 60s}\n"
SECRET = ["root:$6$hostilesaltvalue$Zm9yZ2VkIGhhc2g:19000:0:99999:7:::",
          "daemon:*:19000:0:99999:7:::"]
BOMB = ("a: &a [x, x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a, *a]\n"
        "c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b, *b]\nd: &d [*c, *c, *c, *c, *c, *c, *c, *c, "
        "*c, *c]\ne: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d, *d]\nf: &f [*e, *e, *e, *e, *e, *e, "
        "*e, *e, *e, *e]\ng: &g [*f, *f, *f, *f, *f, *f, *f, *f, *f, *f]\n")
MAX_ECHO = 200  # characters of one value a message may quote (the bound)


def _topo_with(link: str) -> str:
    """An inline two-node topology whose one link entry carries `link`."""
    return ("topology:\n  nodes:\n    - {name: a, profile: tiny-edge}\n"
            "    - {name: b, profile: tiny-edge}\n  defaults: {delay_ms: 1ms}\n"
            "  links:\n    - {between: [a, b], " + link + "}\n"
            "workload: {rate_rps: 2, duration: 60s}\n")


CASES: list[tuple[str, str, int | None, str]] = [
    ("alias-bomb", HEAD + "placement:\n  variants:\n    - &a [x, x, x, x, x, x, x, x, x, x]\n"
     + "".join(f"    - &{b} [{', '.join([f'*{a}'] * 10)}]\n"
               for a, b in zip("abcde", "bcdef", strict=True)),
     10, "placement.variants[5][0]: more than 200,000"),
    ("alias-bomb-anchor-first", BOMB + HEAD + "placement: {variants: [*g, *g, *g]}\n", 6,
     "aliases are expanded"),
    ("recursive-alias", HEAD + "policies: &p [greedy, *p]\n", 3, "holds it"),
    ("deep-nesting", HEAD + "placement: " + "[" * 5000 + "]" * 5000 + "\n", 3,
     "nested more than"),
    ("long-value", HEAD + "name: " + "x" * 5000 + "\n", 3, "characters (at most"),
    ("huge-integer", HEAD.replace("rate_rps: 2", "rate_rps: " + "9" * 4200), 2,
     "characters (at most"),
    ("huge-number", HEAD.replace("rate_rps: 2", "rate_rps: 1e400"), 2, "finite"),
    ("too-many-requests", HEAD.replace("rate_rps: 2", "rate_rps: 1.0e+12"), 2,
     "more than a run plans"),
    ("nan", HEAD + "slo_ms: .nan\n", 3, "slo_ms: must be a finite number, got nan"),
    ("negative-duration", HEAD.replace("duration: 60s", "duration: -5s"), 2,
     "must be > 0"),
    ("duplicate-key", HEAD + "slo_ms: 100\nslo_ms: 200\n", 4, "slo_ms: duplicate key (first on "
     "line 3)"),
    ("duplicate-nested-key", HEAD + "placement:\n  policy: hetroute\n  policy: random\n", 5,
     "placement.policy: duplicate key"),
    ("unknown-policy", HEAD + "policies: [greedy, " + "o" * 3000 + "]\n", 3, "policies[1]"),
    ("unicode-name", HEAD + 'name: "evil\\u202egnp.exe"\n', 3, "name: must be"),
    ("python-tag", HEAD + "slo_ms: !!python/object/apply:os.system [id]\n", 3,
     "slo_ms: the tag"),
    ("control-chars", HEAD + "description: \"a\x07b\"\n", 3, "not valid YAML"),
    ("long-key", HEAD + "k" * 3000 + ": 1\n", 3, "not valid YAML"),
    ("long-key-1000", HEAD + "k" * 1000 + ": 1\n", 3, "unknown field"),
    ("bad-arm-settings", HEAD + "policies:\n  - {policy: ordermoe, settings: {beam_width: 0}}\n",
     4, "policies[0]: settings: beam_width must be >= 1"),
    ("arm-settings-list", HEAD + "policies:\n  - {policy: ordermoe, settings: {lookahead: "
     "[1, 2, 3]}}\n", 4, "settings.lookahead: must be a number"),
    ("fault-after-requests-end", HEAD.replace("duration: 60s", "requests: 10")
     + "faults:\n  - {at: 10m, node-down: edge2}\n", 4, "expected end"),
    ("fault-after-duration", HEAD + "faults:\n  - {at: 61s, node-down: edge2}\n", 4,
     "not before the workload's end"),
    ("ambiguous-rate", _topo_with("rate_mbit: 10mbps"), 7, "ambiguous"),
    ("schedule-secret-file", _topo_with("schedule: {secret}"), 7, "not a whole number"),
    ("schedule-csv-secret", _topo_with("schedule: {csv: {secret}}"), 7, "not a number"),
    ("schedule-dev-zero", _topo_with("schedule: /dev/zero"), 7, "not a regular file"),
    ("schedule-folder", _topo_with("schedule: {dir}"), 7, "is a folder"),
    ("schedule-long-path", _topo_with("schedule: " + "p/" * 1500 + "x.csv"), 7,
     "schedule file"),
    ("topology-dev-zero", "topology: /dev/zero\nworkload: {rate_rps: 2, duration: 60s}\n", 1,
     "topology"),
    ("empty-file", "", None, "a scenario mapping"),
    ("a-list", "[1, 2, 3]\n", 1, "a scenario mapping"),
    ("redundancy-huge", HEAD + "placement: {redundancy: 1.0e+300}\n", 3, "redundancy: must be <="),
    ("seed-huge", HEAD.replace("duration: 60s", "duration: 60s, seed: " + "7" * 30), 2,
     "seed: must be <="),
    ("negative-fault-time", HEAD + "faults:\n  - {at: -1s, node-down: edge2}\n", 4,
     "must be >= 0"),
]


def _case_files(tmp_path: Path, text: str) -> tuple[Path, Path]:
    secret = tmp_path / "shadow"
    secret.write_text("\n".join(SECRET) + "\n")
    path = tmp_path / "hostile.yaml"
    path.write_text(text.replace("{topo}", str(TOPO)).replace("{secret}", str(secret))
                    .replace("{dir}", str(tmp_path)))
    return path, secret


def _longest_common_run(message: str, text: str) -> int:
    """The longest stretch of `text` (a file's line, a value) that `message` repeats."""
    best = 0
    for start in range(0, len(text), 50):
        lo, hi = best, len(text) - start
        while lo < hi:  # binary search on the length of text[start:start+n] in message
            mid = (lo + hi + 1) // 2
            if text[start:start + mid] in message:
                lo = mid
            else:
                hi = mid - 1
        best = max(best, lo)
    return best


@pytest.mark.parametrize(("name", "text", "line", "needle"), CASES, ids=[c[0] for c in CASES])
def test_a_hostile_file_exits_2_naming_file_line_and_field(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, text: str,
        line: int | None, needle: str) -> None:
    path, _ = _case_files(tmp_path, text)
    assert moemesh("scenario", "check", str(path)) == 2
    out = capsys.readouterr()
    err = out.err.strip()
    assert out.out == ""
    where = f"moemesh: {path}:{line}: " if line is not None else f"moemesh: {path}: "
    assert err.startswith(where), err[:300]
    assert needle in err, err[:300]
    if line is not None and name not in ("a-list", "control-chars", "long-key"):
        # a field follows the line: `FILE:LINE: FIELD: message`
        field = err[len(where):].split(": ", 1)[0]
        assert field and " " not in field.strip("[]'…"), err[:300]
    assert len(err) < 1000, f"{len(err)} characters: {err[:300]}"
    written = path.read_text()
    for value in [written, *SECRET]:
        assert _longest_common_run(err, value) <= MAX_ECHO
    for secret_line in SECRET:  # no line of a file it read, nor a recognisable part of one
        assert secret_line not in err and "hostilesalt" not in err


def test_a_scenario_larger_than_1_mib_is_refused_unread(tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]
                                                         ) -> None:
    path = tmp_path / "big.yaml"
    path.write_text(HEAD.replace("{topo}", str(TOPO)) + "# padding\n" * 120_000)
    assert moemesh("scenario", "check", str(path)) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"moemesh: {path}: ") and "more than the 1,048,576" in err


@pytest.mark.parametrize("target", ["/dev/zero", "{dir}", "{dir}/fifo", "{dir}/binary.yaml"])
def test_a_scenario_path_that_is_not_a_text_file_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], target: str) -> None:
    os.mkfifo(tmp_path / "fifo")  # opening it would block: refused before it is opened
    (tmp_path / "binary.yaml").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" * 10)
    path = target.format(dir=tmp_path)
    assert moemesh("scenario", "check", path) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"moemesh: {path}: ")
    assert any(w in err for w in ("not a regular file", "is a folder", "not UTF-8")), err


def test_an_alias_bomb_cannot_grow_the_cli(tmp_path: Path) -> None:
    """In a child process: the 10^7-item bomb and 100,000-deep nesting (which crashed
    libyaml's composer) are refused while the CLI stays far below 500 MB."""
    bomb = tmp_path / "bomb.yaml"
    head = HEAD.replace("{topo}", str(TOPO))
    bomb.write_text(head + BOMB + "placement: {variants: [*g, *g, *g]}\n")
    deep = tmp_path / "deep.yaml"
    deep.write_text(head + "placement: " + "[" * 100_000 + "\n")
    # VmHWM, the peak of this process's own memory: ru_maxrss would also count what the
    # forking parent (pytest, 1.2 GB after the suite's torch tests) held before the exec
    code = ("import re, sys\nfrom orchestrator import cli\n"
            "codes = [cli.main(['scenario', 'check', p]) for p in sys.argv[1:]]\n"
            "hwm = re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read())\n"
            "print(codes, hwm.group(1))\n")
    done = subprocess.run([sys.executable, "-c", code, str(bomb), str(deep)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-2000:]
    codes, rss_kb = done.stdout.rsplit("]", 1)
    assert codes + "]" == "[2, 2]"
    assert int(rss_kb) < 500 * 1024, f"max RSS {int(rss_kb) / 1024:.0f} MB"
