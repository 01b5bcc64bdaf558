#!/usr/bin/env bash
# Build the moemesh image, offline by default: local Debian base + wheels downloaded on the host.
#
#   docker/build-image.sh            # offline: moemesh/base:bookworm + docker/wheels -> moemesh/moemesh:latest
#   docker/build-image.sh --online   # docker build . as any online user would (python:3.11-slim, PyPI)
#
# Offline, it builds the base image if missing (docker/build-base.sh) and downloads the wheels
# if docker/wheels holds none (docker/fetch-wheels.sh), so no step needs a registry or network
# inside a build container. Rebuilds after a source change take seconds: the dependency layers
# come from the cache. Prints the image size and the build time.
# Settings (environment): MOEMESH_IMAGE (default moemesh/moemesh:latest), MOEMESH_BASE_TAG.
set -euo pipefail
cd "$(dirname "$0")/.."

image=${MOEMESH_IMAGE:-moemesh/moemesh:latest}
base=${MOEMESH_BASE_TAG:-moemesh/base:bookworm}
online=0
for arg in "$@"; do
    case $arg in
        --online) online=1 ;;
        -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
        *) echo "build-image: unknown argument '$arg' (use --online or --help)" >&2; exit 2 ;;
    esac
done
docker info >/dev/null 2>&1 \
    || { echo "build-image: the Docker engine does not answer (docker/start-dockerd.sh)" >&2; exit 1; }

started=$SECONDS
args=()
if [ "$online" = 0 ]; then
    MOEMESH_BASE_TAG=$base docker/build-base.sh
    if ! ls docker/wheels/*.whl >/dev/null 2>&1; then
        docker/fetch-wheels.sh
    fi
    args+=(--build-arg "BASE_IMAGE=$base")
fi
# The classic builder: BuildKit is optional in Debian's docker.io and this Dockerfile needs none
# of its features. DOCKER_BUILDKIT set by the caller wins.
DOCKER_BUILDKIT=${DOCKER_BUILDKIT:-0} docker build "${args[@]}" -t "$image" . >/tmp/moemesh-build.$$.log 2>&1 || {
    tail -n 40 /tmp/moemesh-build.$$.log >&2
    rm -f /tmp/moemesh-build.$$.log
    echo "build-image: docker build failed (log above)" >&2
    exit 1
}
rm -f /tmp/moemesh-build.$$.log
size=$(docker image inspect -f '{{.Size}}' "$image" | numfmt --to=iec)
echo "build-image: $image ($size) built in $((SECONDS - started))s"
