#!/bin/sh
# Image build step: a virtual environment at $1 with the project's runtime dependencies.
#
#   install-deps.sh VENV BUILD_DIR     (BUILD_DIR holds pyproject.toml, requirements.py, wheels/)
#
# With wheels in BUILD_DIR/wheels (docker/fetch-wheels.sh on the host), pip installs from them
# only, run straight from the pip wheel, so neither the network nor a pip in the base image is
# needed. Without wheels, the base image's pip installs from the index it is configured for
# (PyPI; PIP_INDEX_URL / PIP_EXTRA_INDEX_URL build arguments change that), as for any image.
# EXTRA_REQUIREMENTS (space-separated) adds requirements to the list. Every version is the one
# BUILD_DIR/requirements.lock pins (a pip constraints file: the versions CI tested).
set -eu
venv=$1
build=$2
die() { echo "install-deps: $*" >&2; exit 1; }

command -v python3 >/dev/null 2>&1 || die "the base image has no python3"
python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
    || die "the base image's python3 is $(python3 -V 2>&1); moemesh needs >= 3.11"
# --without-pip: Debian's python3 has no ensurepip (python3-venv), and the image needs no pip.
python3 -m venv --without-pip "$venv"
python3 "$build/requirements.py" "$build/pyproject.toml" >"$build/requirements.txt"
for extra in ${EXTRA_REQUIREMENTS:-}; do echo "$extra" >>"$build/requirements.txt"; done

if ls "$build"/wheels/*.whl >/dev/null 2>&1; then
    pip_wheel=$(ls "$build"/wheels/pip-*.whl 2>/dev/null | sort -V | tail -n 1)
    [ -n "$pip_wheel" ] || die "wheels/ has wheels but no pip wheel: rerun docker/fetch-wheels.sh"
    echo "install-deps: from $(ls "$build"/wheels/*.whl | wc -l) local wheels (no network)"
    "$venv/bin/python" "$pip_wheel/pip" install --no-index --find-links "$build/wheels" \
        --no-cache-dir --disable-pip-version-check --root-user-action=ignore \
        -r "$build/requirements.txt" -c "$build/requirements.lock"
else
    python3 -m pip --version >/dev/null 2>&1 \
        || die "no wheels in wheels/ and no pip in the base image: run docker/fetch-wheels.sh"
    echo "install-deps: from the package index (no local wheels)"
    python3 -m pip --python "$venv/bin/python" install --no-cache-dir \
        --disable-pip-version-check --root-user-action=ignore -r "$build/requirements.txt" \
        -c "$build/requirements.lock"
fi
# What nothing here runs (about 250 MB): the dependencies' test suites, torch's C++ headers,
# C++ test binaries and protoc (torch_shm_manager stays).
find "$venv/lib" -depth -type d \( -path '*/scipy/*/tests' -o -path '*/numpy/*/tests' \
    -o -path '*/site-packages/torch/test' -o -path '*/site-packages/torch/include' \) \
    -exec rm -rf {} +
find "$venv/lib" -path '*/site-packages/torch/bin/*' \( -name '*Test' -o -name 'test_*' \
    -o -name 'protoc*' \) -delete
"$venv/bin/python" -c 'import torch, aiohttp, numpy; x = torch.ones(4, 4); assert float((x @ x).sum()) == 64.0; print("install-deps: torch", torch.__version__, "works")'
