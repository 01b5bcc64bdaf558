#!/usr/bin/env bash
# Start the Docker engine in the background if it is not answering yet, and wait until it does.
#
# For machines without systemd (CI, this sandbox): Debian's docker.io ships dockerd, but nothing
# starts it. Idempotent: when `docker info` already answers, it does nothing. Fails with the
# tail of dockerd's log when the engine does not come up in time.
#
#   docker/start-dockerd.sh            # log: $MOEMESH_DOCKERD_LOG (default /var/log/moemesh-dockerd.log)
#   MOEMESH_DOCKERD_WAIT_S=120 docker/start-dockerd.sh
#
# Stop it again with docker/stop-dockerd.sh (only the dockerd this script started).
set -euo pipefail

log=${MOEMESH_DOCKERD_LOG:-/var/log/moemesh-dockerd.log}
wait_s=${MOEMESH_DOCKERD_WAIT_S:-60}
pidfile=${MOEMESH_DOCKERD_PIDFILE:-/var/run/moemesh-dockerd.pid}

die() { echo "start-dockerd: $*" >&2; exit 1; }

if docker info >/dev/null 2>&1; then
    echo "start-dockerd: the Docker engine already answers ($(docker info --format '{{.ServerVersion}}' 2>/dev/null))"
    exit 0
fi

command -v dockerd >/dev/null 2>&1 \
    || die "dockerd not found: install it first (Debian: apt-get install -y docker.io)"
command -v docker >/dev/null 2>&1 || die "the docker client is not on PATH (Debian: docker.io)"
[ "$(id -u)" = 0 ] || die "dockerd must be started as root (running as uid $(id -u))"

if [ -f "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null; then
    echo "start-dockerd: dockerd (pid $(cat "$pidfile")) is starting; waiting for it"
else
    mkdir -p "$(dirname "$log")"
    # setsid: the engine outlives this script and the shell that ran it.
    setsid dockerd --host unix:///var/run/docker.sock >>"$log" 2>&1 < /dev/null &
    echo $! >"$pidfile"
    echo "start-dockerd: started dockerd (pid $!), log in $log"
fi

deadline=$((SECONDS + wait_s))
until docker info >/dev/null 2>&1; do
    if ! kill -0 "$(cat "$pidfile")" 2>/dev/null; then
        tail -n 30 "$log" >&2 || true
        die "dockerd exited before it answered (log above, full log in $log)"
    fi
    if [ "$SECONDS" -ge "$deadline" ]; then
        tail -n 30 "$log" >&2 || true
        die "dockerd did not answer 'docker info' within ${wait_s}s (log above, full log in $log)"
    fi
    sleep 0.5
done
echo "start-dockerd: engine $(docker info --format '{{.ServerVersion}}, storage {{.Driver}}, cgroup {{.CgroupDriver}}') ready"
