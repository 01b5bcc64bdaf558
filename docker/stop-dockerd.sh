#!/usr/bin/env bash
# Stop the dockerd that docker/start-dockerd.sh started (and only that one), waiting until it exits.
set -euo pipefail
pidfile=${MOEMESH_DOCKERD_PIDFILE:-/var/run/moemesh-dockerd.pid}
if [ ! -f "$pidfile" ]; then
    echo "stop-dockerd: no $pidfile: this script started no dockerd here"
    exit 0
fi
pid=$(cat "$pidfile")
if kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid"
    for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    if kill -0 "$pid" 2>/dev/null; then
        echo "stop-dockerd: dockerd (pid $pid) still running after 30s" >&2
        exit 1
    fi
    echo "stop-dockerd: dockerd (pid $pid) stopped"
fi
rm -f "$pidfile"
