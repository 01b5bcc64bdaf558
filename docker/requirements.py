"""Print the project's runtime dependencies from pyproject.toml, one requirement a line.

The one list of dependencies is pyproject.toml; the wheel download on the host
(docker/fetch-wheels.sh) and the image build (docker/install-deps.sh) both read it through this
script, so they cannot drift apart. Needs only the standard library (Python >= 3.11, tomllib).

    python3 docker/requirements.py [PYPROJECT] [--extra NAME]...
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path


def requirements(pyproject: Path, extras: list[str]) -> list[str]:
    """`[project].dependencies` plus the named optional-dependency groups."""
    with pyproject.open("rb") as fh:
        project = tomllib.load(fh).get("project", {})
    deps = list(project.get("dependencies", []))
    optional = project.get("optional-dependencies", {})
    for extra in extras:
        if extra not in optional:
            raise ValueError(f"{pyproject}: no optional-dependencies group {extra!r} "
                             f"(groups: {', '.join(sorted(optional)) or 'none'})")
        deps.extend(optional[extra])
    return deps


def main(argv: list[str]) -> int:
    path = Path(__file__).resolve().parent.parent / "pyproject.toml"
    extras: list[str] = []
    args = iter(argv)
    for arg in args:
        if arg == "--extra":
            extras.append(next(args, ""))
        else:
            path = Path(arg)
    try:
        print("\n".join(requirements(path, extras)))
    except (OSError, ValueError, tomllib.TOMLDecodeError) as exc:
        print(f"requirements.py: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
