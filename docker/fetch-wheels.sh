#!/usr/bin/env bash
# Download, on the host, the wheels the image needs, so the image build needs no network.
#
#   docker/fetch-wheels.sh [--clean]     # -> docker/wheels/*.whl (about 280 MB, git-ignored)
#
# The list is pyproject.toml's runtime dependencies (docker/requirements.py) plus pip itself,
# at the versions requirements.lock pins (the ones CI tested)
# (a base image without pip runs pip straight from its wheel), for the image's Python and
# platform, not the host's: CPython 3.11 (Debian bookworm's), manylinux for this machine's
# architecture. pip uses the host's own configuration (index, find-links, proxy), so a host
# with a local wheel mirror needs nothing more. When docker/wheels holds wheels, the Dockerfile
# installs from them only (pip --no-index); when it holds none, the build uses PyPI as usual.
#
# Settings (environment): MOEMESH_WHEELS_DIR (default docker/wheels), MOEMESH_WHEELS_PYTHON
# (default 3.11), MOEMESH_WHEELS_ARCH (default `uname -m`), MOEMESH_WHEELS_EXTRA (more
# requirements, space-separated, e.g. "aiodocker"). --clean empties the folder first.
set -euo pipefail
cd "$(dirname "$0")/.."

dest=${MOEMESH_WHEELS_DIR:-docker/wheels}
pyver=${MOEMESH_WHEELS_PYTHON:-3.11}
arch=${MOEMESH_WHEELS_ARCH:-$(uname -m)}
clean=0
case "$*" in  # one flag at most
    "") ;;
    --clean) clean=1 ;;
    -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
    *) echo "fetch-wheels: unknown arguments '$*' (use --clean or --help)" >&2; exit 2 ;;
esac

py=$(command -v python3 || true)
[ -n "$py" ] || { echo "fetch-wheels: python3 not found on the host" >&2; exit 1; }
[[ $pyver =~ ^3\.[0-9]+$ ]] || { echo "fetch-wheels: MOEMESH_WHEELS_PYTHON must look like 3.11, got '$pyver'" >&2; exit 2; }
abi="cp${pyver/./}"

mkdir -p "$dest"
if [ "$clean" = 1 ]; then
    find "$dest" -maxdepth 1 -name '*.whl' -delete
fi

req=$(mktemp)
trap 'rm -f "$req"' EXIT
"$py" docker/requirements.py pyproject.toml >"$req"
echo pip >>"$req"
for extra in ${MOEMESH_WHEELS_EXTRA:-}; do echo "$extra" >>"$req"; done

# manylinux tags up to glibc 2.36 (Debian bookworm's); pip does not widen an explicit --platform.
platforms=()
for minor in $(seq 36 -1 17); do platforms+=(--platform "manylinux_2_${minor}_${arch}"); done
platforms+=(--platform "manylinux2014_${arch}" --platform "manylinux2010_${arch}"
            --platform "manylinux_2_5_${arch}" --platform "manylinux1_${arch}")

started=$SECONDS
echo "fetch-wheels: $(grep -c . "$req") requirements for CPython $pyver ($abi) on $arch -> $dest"
"$py" -m pip download --quiet --disable-pip-version-check --dest "$dest" \
    --only-binary=:all: --implementation cp --python-version "$pyver" --abi "$abi" --abi abi3 \
    --abi none "${platforms[@]}" -r "$req" -c requirements.lock 2> >(grep -v "is neither a file nor a directory" >&2)
count=$(find "$dest" -maxdepth 1 -name '*.whl' | wc -l)
echo "fetch-wheels: $count wheels, $(du -sh "$dest" | cut -f1), in $((SECONDS - started))s"
