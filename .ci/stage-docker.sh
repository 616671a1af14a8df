#!/usr/bin/env bash
# Docker stage: run a command (`make test`) with a private Docker engine up.
#
#   bash .ci/stage-docker.sh make test
#
# Installs docker.io, bubblewrap, debootstrap and busybox-static; starts dockerd with
# its own data root, exec root and socket and no networking of its own
# (--bridge=none --iptables=false --ip-masq=false); builds the sandbox base images
# offline (rootfs recipes + `docker import`, nothing is pulled); runs the command with
# DOCKER_HOST pointing at that engine, so the Docker tests run (under CI=true they fail
# rather than skip without an engine); then removes every labelled container and stops
# the engine, whatever the command's outcome.
set -euo pipefail
cd "$(dirname "$0")/.."
say() { echo "--- [docker stage] $*"; }

missing=()
command -v dockerd >/dev/null || missing+=(docker.io)
command -v bwrap >/dev/null || missing+=(bubblewrap)
command -v debootstrap >/dev/null || missing+=(debootstrap)
{ command -v busybox >/dev/null && ! ldd "$(command -v busybox)" >/dev/null 2>&1; } \
    || missing+=(busybox-static)
if ((${#missing[@]})); then
    say "apt-get install ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi

root=$(mktemp -d /tmp/libra-ci-docker.XXXXXX)
dockerd --data-root "$root/data" --exec-root "$root/exec" --pidfile "$root/dockerd.pid" \
    -H "unix://$root/docker.sock" --bridge=none --iptables=false --ip-masq=false \
    >"$root/dockerd.log" 2>&1 &
dockerd_pid=$!
export DOCKER_HOST="unix://$root/docker.sock"

stop_engine() {
    local ids
    ids=$(docker ps -aq --filter label=libra.sandbox 2>/dev/null || true)
    if [ -n "$ids" ]; then
        say "reaping $(echo "$ids" | wc -l) leftover container(s)"
        docker rm -f $ids >/dev/null 2>&1 || true
    fi
    kill "$dockerd_pid" 2>/dev/null || true
    wait "$dockerd_pid" 2>/dev/null || true
    umount -R "$root/exec" "$root/data" 2>/dev/null || true
    rm -rf "$root" 2>/dev/null || true
}
trap stop_engine EXIT

for _ in $(seq 60); do docker version >/dev/null 2>&1 && break; sleep 0.5; done
docker version --format 'engine {{.Server.Version}} at '"$DOCKER_HOST" \
    || { tail -20 "$root/dockerd.log"; exit 1; }

make setup >/dev/null
say "building base images (busybox, python)"
.venv/bin/python -m libra.sandboxes.images build busybox python --docker

say "running: $*"
"$@"
