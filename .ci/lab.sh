#!/usr/bin/env bash
# The tc tests (pytest marker `lab`): directly where this kernel has sch_netem, else inside the
# UML kernel lab (`python -m netem.lab run`, the same code as `moemesh lab run`).
# Needs root, iproute2, kmod (modprobe, used by the guest) and apt (to fetch user-mode-linux
# once into ~/.cache/moemesh/uml); a missing piece is a clear failure, never a silent skip.
# The slow lab tests run too (--run-slow), except the two runs of a whole mesh with tc (the
# Mahimahi scenario and the access-link run: about 5 minutes more, and a 3 GiB guest for
# their three tiny-moe nodes): MOEMESH_LAB_E2E=1 adds them. Extra arguments go to pytest:
# .ci/lab.sh -x -k rate
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 MOEMESH_LAB_REQUIRED=1
E2E=(--deselect tests/netem/test_mahimahi_scenario.py::test_mahimahi_scenario_with_tc_in_namespaces
     --deselect tests/netem/test_access_lab.py)
MEM=768
if [ "${MOEMESH_LAB_E2E:-0}" = 1 ]; then E2E=(); MEM=3072; fi

if python3 -c 'import sys; from netem.probe import probe_tc; v = probe_tc(); print("tc:", v.reason); sys.exit(0 if v.ok else 1)'; then
  echo "== lab tests on this host's kernel"
  exec python3 -m pytest -p no:cacheprovider --run-slow -m lab tests/netem ${E2E[@]+"${E2E[@]}"} "$@"
fi

if ! command -v modprobe >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "== installing kmod (the guest loads its modules with the host's modprobe)"
  apt-get install -y -q kmod >/dev/null || { apt-get update -q >/dev/null && apt-get install -y -q kmod >/dev/null; }
fi

echo "== lab tests inside the UML kernel lab"
exec python3 -m netem.lab run --timeout 1500 --mem "$MEM" -- --run-slow -m lab tests/netem ${E2E[@]+"${E2E[@]}"} "$@"
