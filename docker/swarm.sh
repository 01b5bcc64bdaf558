#!/usr/bin/env bash
# One-host Swarm for moemesh: make this engine a manager, remove a stack and wait until it is
# gone, leave the swarm and remove what Swarm itself left behind.
#
#   docker/swarm.sh init            # prints "created" or "existing" (a swarm already here)
#   docker/swarm.sh rm STACK        # docker stack rm, then wait (<= 90 s) until no container,
#                                   # network or volume of STACK is left; exit 1 naming them
#   docker/swarm.sh leave           # docker swarm leave --force, then docker_gwbridge removed
#   docker/swarm.sh supported       # exit 0 when this engine can run a swarm, else 1 + reason
#
# `init` advertises the address of the default route's interface when the engine cannot pick
# one itself (several interfaces). Only `leave` a swarm that `init` said it "created".
set -euo pipefail

leftovers() {  # what of stack $1 the engine still lists
    local label="label=com.docker.stack.namespace=$1"
    docker ps -aq --filter "$label"
    docker network ls -q --filter "$label"
    docker volume ls -q --filter "$label"
}

case ${1:-} in
    init)
        state=$(docker info --format '{{.Swarm.LocalNodeState}}')
        if [ "$state" = active ]; then echo existing; exit 0; fi
        if ! out=$(docker swarm init 2>&1); then
            addr=$(ip -4 route get 1.1.1.1 2>/dev/null | sed -n 's/.* src \([0-9.]*\).*/\1/p')
            [ -n "$addr" ] || { echo "swarm.sh: docker swarm init failed: $out" >&2; exit 1; }
            docker swarm init --advertise-addr "$addr" >/dev/null
        fi
        echo created
        ;;
    rm)
        stack=${2:?"usage: swarm.sh rm STACK"}
        docker stack rm "$stack" >/dev/null 2>&1 || true
        for _ in $(seq 90); do
            [ -z "$(leftovers "$stack")" ] && exit 0
            sleep 1
        done
        echo "swarm.sh: stack $stack left behind: $(leftovers "$stack" | tr '\n' ' ')" >&2
        exit 1
        ;;
    leave)
        docker swarm leave --force >/dev/null 2>&1 || true
        # Swarm's own bridge to the host outlives the swarm; nothing else uses it.
        docker network rm docker_gwbridge >/dev/null 2>&1 || true
        ;;
    supported)
        version=$(docker version --format '{{.Server.APIVersion}}')
        # API 1.41 (Engine 20.10): the first that keeps cap_add (NET_ADMIN) for services
        if [ "$(printf '%s\n1.41\n' "$version" | sort -V | head -n1)" != 1.41 ]; then
            echo "engine API $version < 1.41 (Engine 20.10): Swarm would drop cap_add" >&2
            exit 1
        fi
        docker info --format '{{.Swarm.LocalNodeState}}' | grep -qv 'error' || {
            echo "this engine reports no Swarm support" >&2; exit 1; }
        ;;
    *)
        echo "usage: docker/swarm.sh init | rm STACK | leave | supported" >&2
        exit 2
        ;;
esac
