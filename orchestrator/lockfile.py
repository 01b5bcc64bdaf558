"""The locked environment: which package versions CI tested, and which ones this process has.

`requirements.lock` at the repository root (also copied into the image) pins every package an
install can pull in, as a pip constraints file: `pip install -c requirements.lock -e '.[dev]'`
gets exactly what CI tested. Regenerated with the command in its header (uv's `pip compile`,
universal: one file for every Python and platform the project supports).

Some packages change results, not only whether the tests pass (torch's kernels, numpy's
random streams, msgpack's encoding, aiohttp's and uvloop's timing, PyYAML's parsing, scipy's
statistics): `versions()` is what run.json records of them, `differences()` what `moemesh
doctor`, a resume, a study and a report say when two environments are not the same.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path

__all__ = ["LOCK_NAME", "RESULT_PACKAGES", "against_lock", "differences", "installed",
           "lock_path", "lock_pins", "lock_sha256", "versions", "versions_note"]

LOCK_NAME = "requirements.lock"
# the distributions whose version can move a run's rows (run.json `versions`)
RESULT_PACKAGES = ("torch", "numpy", "scipy", "msgpack", "aiohttp", "uvloop", "PyYAML")
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;]+)\s*(?:;\s*(.+))?$")


def _norm(name: str) -> str:
    """A distribution's name as PEP 503 compares them (PyYAML = pyyaml, ruamel_x = ruamel-x)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def lock_path() -> Path | None:
    """The lock beside the sources (a checkout, the image's /app), or None (a wheel install)."""
    path = Path(__file__).resolve().parent.parent / LOCK_NAME
    return path if path.is_file() else None


def lock_sha256(path: Path | None = None) -> str | None:
    """The lock file's SHA-256 (run.json `lock_sha256`), or None without one."""
    path = path or lock_path()
    return hashlib.sha256(path.read_bytes()).hexdigest() if path is not None else None


def lock_pins(path: Path | None = None) -> dict[str, str]:
    """Normalised name → pinned version for this interpreter and platform: a pin whose
    environment marker does not hold here (another Python, Windows) is left out."""
    path = path or lock_path()
    if path is None:
        return {}
    from packaging.markers import Marker

    pins: dict[str, str] = {}
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = _PIN.match(line)
        if m is None:
            raise ValueError(f"{path}:{number}: not a 'name==version' pin: {line[:80]!r}")
        name, version, marker = m.groups()
        if marker is None or Marker(marker).evaluate():
            pins[_norm(name)] = version
    return pins


def installed(name: str) -> str | None:
    """The installed version of a distribution, or None."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def versions() -> dict[str, str | None]:
    """RESULT_PACKAGES' installed versions (None: not installed), run.json `versions`."""
    return {name: installed(name) for name in RESULT_PACKAGES}


def _base(version: str) -> str:
    """A version without its local label: torch's 2.13.0+cpu is the lock's 2.13.0."""
    return version.split("+", 1)[0]


def differences(have: Mapping[str, str | None], want: Mapping[str, str | None]
                ) -> list[tuple[str, str | None, str | None]]:
    """(name, have, want) for each package whose versions differ (local labels ignored),
    in `want`'s order; a package only one side names is not compared."""
    have_n = {_norm(k): v for k, v in have.items()}
    out = []
    for name, wanted in want.items():
        key = _norm(name)
        if key not in have_n:
            continue
        got = have_n[key]
        if (got is None) != (wanted is None) or (
                got is not None and wanted is not None and _base(got) != _base(wanted)):
            out.append((name, got, wanted))
    return out


def against_lock(path: Path | None = None) -> list[tuple[str, str | None, str | None]]:
    """(name, installed, locked) for every pinned distribution installed here at another
    version than the lock's (one not installed is an extra left out, not a difference)."""
    pins = lock_pins(path)
    have = {name: installed(name) for name in pins}
    return differences({n: v for n, v in have.items() if v is not None}, pins)


def versions_note(what: str, have: Mapping[str, str | None],
                  want: Mapping[str, str | None]) -> str | None:
    """One sentence naming the packages whose versions differ between two environments, or
    None when they agree: `what` says which two (e.g. "world t3s1 against t1s1")."""
    diff = differences(have, want)
    if not diff:
        return None
    said = ", ".join(f"{n} {h or 'absent'} against {w or 'absent'}" for n, h, w in diff)
    return (f"{what}: package versions that can change results differ ({said}); rows made "
            f"with different versions may differ for that reason alone")
