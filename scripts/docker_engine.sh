#!/usr/bin/env bash
# A private Docker engine for forge_load's container tests, and the images they run.
#
#   scripts/docker_engine.sh start   install docker.io + debootstrap if missing (apt-get); start dockerd in the
#                                    background (overlay2 or vfs, no iptables, no bridge; its own socket,
#                                    pidfile and data-root under $FORGE_DOCKER_DIR; a do-nothing
#                                    nvidia-container-runtime-hook on its PATH where the toolkit is missing,
#                                    so `docker run --gpus ...` runs); build the base image once
#                                    (debootstrap bookworm minbase + python3, python3-venv, ca-certificates,
#                                    `docker import`); build the project image on it. All progress goes to
#                                    stderr; stdout gets `export DOCKER_HOST=...`, FORGE_IMAGE,
#                                    FORGE_REQUIRE_DOCKER=1 (the container tests then fail rather than skip if
#                                    the engine or image goes missing) and FORGE_ENGINE_STARTED (1 if this call
#                                    started dockerd, 0 if it was already running). Use it as:
#                                        out=$(scripts/docker_engine.sh start) && eval "$out"
#   scripts/docker_engine.sh stop    prune dangling images, stop the dockerd this script started (by its PID);
#                                    with FORGE_ENGINE_STARTED=0 in the environment it leaves the engine running
#   scripts/docker_engine.sh env     print the `export DOCKER_HOST=...` line
#   scripts/docker_engine.sh status  say whether our engine runs; exit 0 if it answers
#   scripts/docker_engine.sh build   (re)build the project image on the running engine
#   scripts/docker_engine.sh clean   stop, then delete $FORGE_DOCKER_DIR (the cached base image with it)
#
# Settings (environment): FORGE_DOCKER_DIR (default /var/tmp/forge_load-docker), FORGE_BASE_IMAGE (default
# forge-base:bookworm), FORGE_IMAGE (default forge-load:latest, the README's `docker build -t forge-load .`),
# FORGE_DEBIAN_MIRROR (default: the Debian mirror apt uses here), FORGE_PIP_INDEX_URL (optional),
# FORGE_DOCKER_STORAGE_DRIVER (default: overlay2 where overlay mounts work, else vfs).
# Exit codes: 0 done; 1 a step failed (the message says which); 2 usage.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DIR=${FORGE_DOCKER_DIR:-/var/tmp/forge_load-docker}
BASE_IMAGE=${FORGE_BASE_IMAGE:-forge-base:bookworm}
IMAGE=${FORGE_IMAGE:-forge-load:latest}
# Storage driver: overlay2 where this kernel can mount overlayfs under $DIR, else vfs. vfs works everywhere
# but copies the whole ~0.9 GB image for every container and build step (~9 s each); on the CI machine the
# image builds in ~35 s instead of ~110 s and the container tests run in ~20 s instead of ~150 s on overlay2.
# FORGE_DOCKER_STORAGE_DRIVER=vfs (or overlay2) forces one.
STORAGE_DRIVER=${FORGE_DOCKER_STORAGE_DRIVER:-}
SOCK="$DIR/docker.sock"
PIDFILE="$DIR/dockerd.pid"
LOG="$DIR/dockerd.log"
export DOCKER_HOST="unix://$SOCK"
# The legacy builder: it needs no buildx plugin, and `--network host` works with it on every engine version.
export DOCKER_BUILDKIT=0

say() { printf '[docker_engine] %s\n' "$*" >&2; }
die() { say "ERROR: $*"; exit 1; }

engine_up() { docker version --format '{{.Server.Version}}' >/dev/null 2>&1; }

our_pid() {
    # The PID in our pidfile, if that process is alive and is a dockerd.
    local pid
    [[ -s "$PIDFILE" ]] || return 1
    pid=$(cat "$PIDFILE")
    [[ "$pid" =~ ^[0-9]+$ ]] || return 1
    [[ -r "/proc/$pid/comm" ]] || return 1
    [[ "$(cat "/proc/$pid/comm")" == dockerd ]] || return 1
    printf '%s\n' "$pid"
}

debian_mirror() {
    # The mirror apt uses on this machine (so it is reachable from here), else Debian's CDN.
    if [[ -n "${FORGE_DEBIAN_MIRROR:-}" ]]; then
        printf '%s\n' "$FORGE_DEBIAN_MIRROR"
        return
    fi
    local url
    url=$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.sources /etc/apt/sources.list.d/*.list 2>/dev/null |
        grep -v '^[[:space:]]*#' | grep -oE 'https?://[^[:space:]]+/debian/?([[:space:]]|$)' | head -n 1 |
        tr -d '[:space:]' || true)
    url=${url%/}
    printf '%s\n' "${url:-http://deb.debian.org/debian}"
}

install_tools() {
    local missing=()
    command -v dockerd >/dev/null 2>&1 || missing+=(docker.io)
    command -v docker >/dev/null 2>&1 || missing+=(docker.io)
    command -v debootstrap >/dev/null 2>&1 || missing+=(debootstrap)
    ((${#missing[@]} == 0)) && return 0
    [[ $(id -u) == 0 ]] || die "need ${missing[*]} (apt-get install needs root)"
    say "installing ${missing[*]} with apt-get"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >&2 || die "apt-get update failed"
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2 || die "apt-get install ${missing[*]} failed"
}

STARTED_HERE=0

overlay_works() {
    # Can this kernel mount overlayfs on the filesystem under $DIR? (Not inside many containers, for one.)
    local probe="$DIR/overlay-probe" ok=1
    mkdir -p "$probe/lower" "$probe/upper" "$probe/work" "$probe/merged"
    if mount -t overlay overlay -o "lowerdir=$probe/lower,upperdir=$probe/upper,workdir=$probe/work" \
        "$probe/merged" 2>/dev/null; then
        umount "$probe/merged" && ok=0
    fi
    rm -rf "$probe"
    return "$ok"
}

gpu_hook_standin() {
    # The engine registers its `nvidia` device driver (`docker run --gpus ...`) when an executable named
    # nvidia-container-runtime-hook is on dockerd's PATH. Where the NVIDIA Container Toolkit is not installed,
    # a stand-in that does nothing (the tests bind the virtual GPU's libraries with -v) lets --gpus run here.
    mkdir -p "$DIR/bin"
    rm -f "$DIR/bin/nvidia-container-runtime-hook"
    command -v nvidia-container-runtime-hook >/dev/null 2>&1 && return 0
    printf '#!/bin/sh\n# stand-in for the NVIDIA hook (scripts/docker_engine.sh): reads the OCI state, does nothing\ncat >/dev/null\nexit 0\n' \
        >"$DIR/bin/nvidia-container-runtime-hook"
    chmod 0755 "$DIR/bin/nvidia-container-runtime-hook"
    say "no NVIDIA Container Toolkit here: a stand-in nvidia-container-runtime-hook on dockerd's PATH makes --gpus run"
}

launch_dockerd() {
    # Start dockerd with storage driver $1; 0 once it answers, 1 if it exits or stays silent for 60 s.
    local driver=$1 started i
    rm -f "$SOCK"
    say "starting dockerd ($driver, no iptables, no bridge) at $DOCKER_HOST, log $LOG"
    gpu_hook_standin
    # setsid: its own session, so it outlives this script and a Ctrl-C in the caller's terminal.
    PATH="$DIR/bin:$PATH" setsid dockerd \
        --storage-driver="$driver" --iptables=false --ip-masq=false --bridge=none \
        --data-root="$DIR/data" --exec-root="$DIR/exec" --pidfile="$PIDFILE" \
        --host="$DOCKER_HOST" --log-level=warn \
        >"$LOG" 2>&1 </dev/null 9>&- & # 9>&-: dockerd must not inherit (and hold) our lock
    started=$!
    for ((i = 0; i < 120; i++)); do
        if engine_up; then
            STARTED_HERE=1
            say "engine up after ~$((i / 2)) s: $(docker version --format 'server {{.Server.Version}}, client {{.Client.Version}}')"
            return 0
        fi
        if ! kill -0 "$started" 2>/dev/null; then
            tail -n 20 "$LOG" >&2
            say "dockerd ($driver) exited at start (log above)"
            return 1
        fi
        sleep 0.5
    done
    tail -n 20 "$LOG" >&2
    kill "$started" 2>/dev/null || true
    say "dockerd ($driver) did not answer within 60 s"
    return 1
}

start_engine() {
    mkdir -p "$DIR"
    if our_pid >/dev/null && engine_up; then
        say "engine already running (pid $(our_pid)) at $DOCKER_HOST: using it, and leaving it running at stop"
        return 0
    fi
    [[ $(id -u) == 0 ]] || die "dockerd needs root"
    if [[ -n "$STORAGE_DRIVER" ]]; then
        launch_dockerd "$STORAGE_DRIVER" || die "could not start dockerd with --storage-driver=$STORAGE_DRIVER"
    elif overlay_works && launch_dockerd overlay2; then
        :
    else
        launch_dockerd vfs || die "could not start dockerd"
    fi
}

build_base() {
    if docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
        say "base image $BASE_IMAGE is cached"
        return 0
    fi
    local mirror rootfs t0=$SECONDS
    mirror=$(debian_mirror)
    rootfs=$(mktemp -d "$DIR/rootfs.XXXXXX")
    chmod 0755 "$rootfs" # it becomes the image's `/`: mktemp's 0700 would lock every non-root user out
    say "building base image $BASE_IMAGE: debootstrap bookworm minbase from $mirror"
    if ! debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
        bookworm "$rootfs" "$mirror" >"$DIR/debootstrap.log" 2>&1; then
        tail -n 20 "$DIR/debootstrap.log" >&2
        rm -rf "$rootfs"
        die "debootstrap failed (log above)"
    fi
    # The machine's CA bundle: it may hold a CA that pip needs to reach the package index from here.
    cp /etc/ssl/certs/ca-certificates.crt "$rootfs/etc/ssl/certs/ca-certificates.crt"
    # What an image does not need: apt's downloads and lists, docs, man pages, translations, device nodes.
    rm -rf "${rootfs:?}"/var/cache/apt/archives/*.deb "${rootfs:?}"/var/cache/apt/*.bin "${rootfs:?}"/var/lib/apt/lists/* \
        "${rootfs:?}"/usr/share/doc/* "${rootfs:?}"/usr/share/man/* "${rootfs:?}"/usr/share/info/* \
        "${rootfs:?}"/usr/share/locale/* "${rootfs:?}"/dev/* "${rootfs:?}"/var/log/*.log "${rootfs:?}"/tmp/*
    tar --numeric-owner -C "$rootfs" -c . |
        docker import \
            --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
            --change 'ENV LANG=C.UTF-8' \
            --change 'CMD ["/bin/bash"]' \
            --message "debootstrap bookworm minbase + python3 python3-venv ca-certificates" \
            - "$BASE_IMAGE" >/dev/null || { rm -rf "$rootfs"; die "docker import failed"; }
    rm -rf "$rootfs"
    say "base image $BASE_IMAGE built in $((SECONDS - t0)) s"
}

build_image() {
    [[ -f "$ROOT/requirements.txt" ]] || die "$ROOT/requirements.txt is missing: the image installs its dependencies from it"
    local t0=$SECONDS args=(--network host --build-arg "BASE_IMAGE=$BASE_IMAGE")
    args+=(--build-arg "PIP_CERT=/etc/ssl/certs/ca-certificates.crt")
    [[ -n "${FORGE_PIP_INDEX_URL:-}" ]] && args+=(--build-arg "PIP_INDEX_URL=$FORGE_PIP_INDEX_URL")
    args+=(--label "org.opencontainers.image.revision=$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)")
    args+=(--build-arg "VERSION=$(sed -n 's/^version = "\(.*\)"$/\1/p' "$ROOT/pyproject.toml" | head -n 1)")
    say "building $IMAGE from $ROOT on $BASE_IMAGE (log $DIR/build.log)"
    if ! docker build "${args[@]}" -t "$IMAGE" "$ROOT" >"$DIR/build.log" 2>&1; then
        tail -n 30 "$DIR/build.log" >&2
        die "docker build failed (log above)"
    fi
    say "image $IMAGE built in $((SECONDS - t0)) s, size $(docker image inspect "$IMAGE" --format '{{.Size}}' |
        awk '{printf "%.0f MB", $1 / 1e6}')"
}

stop_engine() {
    local pid i
    if [[ "${FORGE_ENGINE_STARTED:-}" == 0 ]]; then
        say "the engine was already running when 'start' ran (FORGE_ENGINE_STARTED=0): leaving it running"
        return 0
    fi
    if ! pid=$(our_pid); then
        say "no engine of ours is running (pidfile $PIDFILE)"
        return 0
    fi
    if engine_up; then
        docker image prune -f >/dev/null 2>&1 || true
    fi
    say "stopping dockerd pid $pid"
    kill -TERM "$pid"
    for ((i = 0; i < 60; i++)); do
        kill -0 "$pid" 2>/dev/null || { say "dockerd stopped"; rm -f "$SOCK"; return 0; }
        sleep 0.5
    done
    say "dockerd did not stop in 30 s; killing pid $pid"
    kill -KILL "$pid" 2>/dev/null || true
    rm -f "$SOCK" "$PIDFILE"
}

print_env() { printf 'export DOCKER_HOST=%q\n' "$DOCKER_HOST"; }

lock() {
    # One `start` or `build` at a time on this engine (two test runs at once would build twice).
    mkdir -p "$DIR"
    exec 9>"$DIR/lock"
    if ! flock -w 900 9; then die "another docker_engine.sh held $DIR/lock for 15 minutes"; fi
}

case "${1:-}" in
start)
    lock
    install_tools
    start_engine
    build_base
    build_image
    print_env
    # For the tests: an engine and an image are here, so a container test that cannot find them must fail,
    # not skip; and `stop` stops the engine only if this `start` started it.
    printf 'export FORGE_IMAGE=%q FORGE_REQUIRE_DOCKER=1 FORGE_ENGINE_STARTED=%s\n' "$IMAGE" "$STARTED_HERE"
    ;;
stop) stop_engine ;;
env) print_env ;;
status)
    if engine_up; then
        say "engine answers at $DOCKER_HOST (pid $(our_pid || echo '?'))"
    else
        say "no engine answers at $DOCKER_HOST"
        exit 1
    fi
    ;;
build)
    engine_up || die "no engine at $DOCKER_HOST: run '$0 start'"
    lock
    build_image
    ;;
clean)
    stop_engine
    say "removing $DIR"
    # dockerd leaves its network namespace mount behind (exec/netns/default): unmount what is under $DIR.
    findmnt -rn -o TARGET | grep -F "$DIR/" | sort -r | while read -r target; do
        umount -l "$target" || true
    done
    rm -rf "$DIR"
    ;;
*)
    sed -n '2,/^set -euo/p' "$0" | sed '$d' >&2
    exit 2
    ;;
esac
