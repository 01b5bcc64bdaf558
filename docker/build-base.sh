#!/usr/bin/env bash
# Build a local Debian base image with python3, for hosts that cannot pull from a container registry.
#
#   docker/build-base.sh [--force]      # -> image moemesh/base:bookworm (about a minute)
#
# debootstrap --variant=minbase makes a root filesystem from Debian's own packages; `docker import`
# turns it into an image. The Debian mirror is the one apt on this host already uses (read from
# /etc/apt/sources.list.d/*.sources or /etc/apt/sources.list), so no host name is written here.
# The image carries python3 (3.11 on bookworm, the version the wheels in docker/wheels are for) and
# iproute2 (`ip`, `tc`) for looking at a node's links; Python packages come from wheels
# (docker/fetch-wheels.sh) when the project image is built on it:
#
#   docker build --build-arg BASE_IMAGE=moemesh/base:bookworm -t moemesh/moemesh .
#
# Settings (environment): MOEMESH_BASE_TAG (image name, default moemesh/base:bookworm),
# MOEMESH_BASE_SUITE (default bookworm), MOEMESH_BASE_MIRROR (default: apt's own),
# MOEMESH_BASE_PACKAGES (comma-separated extra packages, default python3,iproute2),
# MOEMESH_APT_ETC (where apt's sources are read, default /etc/apt).
# Needs root, debootstrap and a running Docker engine. Without --force an existing image is kept.
# --print-mirror only prints the mirror it would use, and needs none of that.
set -euo pipefail

tag=${MOEMESH_BASE_TAG:-moemesh/base:bookworm}
suite=${MOEMESH_BASE_SUITE:-bookworm}
packages=${MOEMESH_BASE_PACKAGES:-python3,iproute2}
apt_etc=${MOEMESH_APT_ETC:-/etc/apt}
force=0
print_mirror=0
for arg in "$@"; do
    case $arg in
        --force) force=1 ;;
        --print-mirror) print_mirror=1 ;;
        -h|--help) sed -n '2,23p' "$0"; exit 0 ;;
        *) echo "build-base: unknown argument '$arg' (use --force, --print-mirror or --help)" >&2
           exit 2 ;;
    esac
done

die() { echo "build-base: $*" >&2; exit 1; }

# The first "deb" source that carries $suite, from apt's own configuration (deb822 or one-line form).
apt_mirror() {
    local file
    for file in "$apt_etc"/sources.list.d/*.sources; do
        [ -f "$file" ] || continue
        awk -v suite="$suite" '
            function flush() {
                if (types ~ /(^| )deb( |$)/ && (" " suites " ") ~ (" " suite " ") && uris != "") {
                    split(uris, u, " "); print u[1]; found = 1; exit
                }
                types = ""; suites = ""; uris = ""
            }
            /^[ \t]*$/ { flush(); next }
            /^[ \t]*#/ { next }
            tolower($1) == "types:"  { $1 = ""; types = $0 }
            tolower($1) == "uris:"   { $1 = ""; uris = $0; sub(/^ +/, "", uris) }
            tolower($1) == "suites:" { $1 = ""; suites = $0; sub(/^ +/, "", suites) }
            END { if (!found) flush() }
        ' "$file" | head -n 1
    done
    for file in "$apt_etc"/sources.list "$apt_etc"/sources.list.d/*.list; do
        [ -f "$file" ] || continue
        # deb [options] URI SUITE COMPONENTS...
        awk -v suite="$suite" '
            $1 == "deb" {
                i = 2
                if ($i ~ /^\[/) { while ($i !~ /\]$/) i++; i++ }
                if ($(i + 1) == suite) { print $i; exit }
            }
        ' "$file"
    done
}

mirror=${MOEMESH_BASE_MIRROR:-$(apt_mirror | head -n 1)}
[ -n "$mirror" ] || die "no Debian mirror for '$suite' in apt's sources under $apt_etc; set MOEMESH_BASE_MIRROR"
if [ "$print_mirror" = 1 ]; then
    echo "$mirror"
    exit 0
fi

[ "$(id -u)" = 0 ] || die "debootstrap needs root (running as uid $(id -u))"
command -v debootstrap >/dev/null 2>&1 || die "debootstrap not found (Debian: apt-get install -y debootstrap)"
docker info >/dev/null 2>&1 || die "the Docker engine does not answer (start it: docker/start-dockerd.sh)"

if [ "$force" = 0 ] && docker image inspect "$tag" >/dev/null 2>&1; then
    echo "build-base: $tag exists already ($(docker image inspect -f '{{.Size}}' "$tag" | numfmt --to=iec)); --force rebuilds it"
    exit 0
fi

started=$SECONDS
rootfs=$(mktemp -d "${TMPDIR:-/tmp}/moemesh-base.XXXXXX")
cleanup() {
    # debootstrap may leave /proc or /sys mounted inside the tree when it fails half-way.
    for m in proc sys dev/pts dev; do umount -l "$rootfs/$m" 2>/dev/null || true; done
    rm -rf --one-file-system "$rootfs"
}
trap cleanup EXIT

echo "build-base: debootstrap --variant=minbase $suite from $mirror (+ $packages)"
if ! debootstrap --variant=minbase --include="$packages" "$suite" "$rootfs" "$mirror" \
        >"$rootfs.log" 2>&1; then
    tail -n 30 "$rootfs.log" >&2
    rm -f "$rootfs.log"
    die "debootstrap failed (log above)"
fi
rm -f "$rootfs.log"

# What an image does not need: downloaded packages, package lists, docs, man pages, translations.
rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/* \
       "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/* \
       "$rootfs"/var/log/* "$rootfs"/tmp/*
find "$rootfs"/usr/share/locale -mindepth 1 -maxdepth 1 ! -name 'locale.alias' -exec rm -rf {} +
find "$rootfs"/usr/lib/python3* -name '__pycache__' -type d -prune -exec rm -rf {} +

tar --numeric-owner -C "$rootfs" -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["python3"]' \
    --message "debootstrap --variant=minbase $suite + $packages" \
    - "$tag" >/dev/null

docker run --rm "$tag" python3 -c 'import sys; assert sys.version_info[:2] >= (3, 11), sys.version' \
    || die "the new image $tag does not run python3 >= 3.11"
size=$(docker image inspect -f '{{.Size}}' "$tag" | numfmt --to=iec)
echo "build-base: $tag built in $((SECONDS - started))s ($size, $(docker run --rm "$tag" python3 -V))"
