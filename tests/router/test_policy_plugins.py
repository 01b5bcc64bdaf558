"""Policies from other installed packages: the `moemesh.policies` entry-point group."""

from __future__ import annotations

import csv
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.helpers import ROOT, env

PLUGIN = textwrap.dedent("""\
    from router.policies.greedy import Greedy

    class Nearest(Greedy):
        name = "nearest"

    def broken(settings, seed):
        return "not a policy"
""")


def _site(tmp: Path, modules: dict[str, str], entry_points: dict[str, str]) -> Path:
    """A folder as `pip install --target` leaves it: modules and one package's .dist-info."""
    site = tmp / "site"
    info = site / "moemesh_plugs-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: moemesh-plugs\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[moemesh.policies]\n" + "".join(f"{k} = {v}\n" for k, v in entry_points.items()))
    for name, text in modules.items():
        (site / f"{name}.py").write_text(text)
    return site


def _python(site: Path, code: str) -> subprocess.CompletedProcess[str]:
    extra = env()
    extra["PYTHONPATH"] = f"{extra['PYTHONPATH']}:{site}"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=extra, cwd=ROOT, timeout=120)


def test_a_plugin_policy_is_listed_and_made_and_a_broken_one_is_named(tmp_path: Path) -> None:
    site = _site(tmp_path, {"plug": PLUGIN, "plug_bad": "raise ImportError('no torch here')\n"},
                 {"nearest": "plug:Nearest", "wrong": "plug:broken", "crashes": "plug_bad:X",
                  "greedy": "plug:Nearest"})
    done = _python(site, textwrap.dedent("""\
        from router.errors import BadRouterInput
        from router.policies import MESH_POLICIES, POLICIES, make_policy
        print(POLICIES)
        assert "nearest" in MESH_POLICIES
        from orchestrator.scenario.scenario import Scenario  # no `policies:`: the built-ins only
        assert "nearest" not in Scenario.__dataclass_fields__["policies"].default
        print(type(make_policy("nearest", None, 3)).__name__)
        print(type(make_policy("greedy")).__name__)  # a built-in name stays the built-in
        for name in ("crashes", "wrong", "nope"):
            try:
                make_policy(name)
            except BadRouterInput as exc:
                print(exc)
    """))
    assert done.returncode == 0, done.stderr
    names, made, builtin, crashes, wrong, nope = done.stdout.splitlines()
    assert names.endswith("'exact', 'crashes', 'nearest', 'wrong')")
    assert (made, builtin) == ("Nearest", "Greedy")
    assert crashes == ("policy plug-in 'crashes' (entry point plug_bad:X in package "
                       "moemesh-plugs) failed to load: ImportError: no torch here")
    assert wrong == ("policy plug-in 'wrong' (entry point plug:broken) made a str, not a "
                     "router.policies.Policy")
    assert nope.startswith("unknown policy 'nope'; known: local-first,") and "nearest" in nope


def test_policies_flag_names_what_it_does_not_know(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "orchestrator.cli", "run",
                           "experiments/scenarios/tiny-quick.yaml", "--policies", "greedy,nope",
                           "--out", str(tmp_path / "run")], capture_output=True, text=True,
                          env=env(), cwd=ROOT, timeout=120)
    assert done.returncode == 2
    assert "--policies: 'nope' is neither an arm of the scenario (local-first, greedy" in \
        done.stderr and "nor a registered policy (local-first," in done.stderr


@pytest.mark.slow
def test_an_installed_package_runs_as_a_default_arm(tmp_path: Path) -> None:
    """The issue's check: a policy in its own package, installed with pip, runs with
    `--policies its-name` on a shipped scenario that does not list it."""
    pkg = tmp_path / "pkg"
    (pkg / "src" / "moemesh_nearest").mkdir(parents=True)
    (pkg / "pyproject.toml").write_text(textwrap.dedent("""\
        [build-system]
        requires = ["setuptools>=68"]
        build-backend = "setuptools.build_meta"

        [project]
        name = "moemesh-nearest"
        version = "0.1.0"

        [project.entry-points."moemesh.policies"]
        nearest = "moemesh_nearest:Nearest"
    """))
    (pkg / "src" / "moemesh_nearest" / "__init__.py").write_text(PLUGIN)
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                    "--no-build-isolation", "--no-index", "--target", str(site), str(pkg)],
                   check=True, capture_output=True, timeout=300)
    extra = env()
    extra["PYTHONPATH"] = f"{extra['PYTHONPATH']}:{site}"
    out = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "orchestrator.cli", "run",
                           "experiments/scenarios/quickstart.yaml", "--policies",
                           "nearest,greedy", "--requests", "4", "--quality-windows", "0",
                           "--quiet", "--out", str(out)], capture_output=True, text=True,
                          env=extra, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    with (out / "tokens.csv").open() as f:
        by_policy = {row["policy"] for row in csv.DictReader(f) if row["status"] == "ok"}
    assert by_policy == {"nearest", "greedy"}
