#!/usr/bin/env bash
# Runs a built image's entrypoint without a container engine: `buildah from` makes a working
# container, `buildah run --isolation chroot --network host` runs the image's ENTRYPOINT with ARGs
# (its CMD when none are given) as the image's user, in its working directory, with its environment;
# the working container is removed when the command exits or this script is stopped. podman, which
# would do this with cgroups and a network namespace, fails on cgroups here.
#
#   deploy/docker/run-image.sh [-e NAME=VALUE | -e NAME]... [-v HOST:CONTAINER[:ro]]...
#                              [--entrypoint PROGRAM] IMAGE [ARG...]
#
# -e NAME alone passes this environment's value; --entrypoint runs PROGRAM in place of the image's
# ENTRYPOINT (as `docker run --entrypoint` does; e.g. python, for the image's HEALTHCHECK). The network is the host's: a server bound to
# 127.0.0.1 inside is reachable on the host's loopback. SIGTERM and SIGINT are passed on to the
# command, so a server drains as it would under `docker stop`.
set -euo pipefail

usage="usage: run-image.sh [-e NAME[=VALUE]]... [-v HOST:CONTAINER[:ro]]... [--entrypoint PROGRAM] IMAGE [ARG...]"
run_args=()
entrypoint=()
own_entrypoint=
while [[ $# -gt 0 ]]; do
    case "$1" in
        -e)
            [[ $# -ge 2 ]] || { echo "$usage" >&2; exit 2; }
            if [[ "$2" == *=* ]]; then run_args+=(--env "$2"); else run_args+=(--env "$2=${!2-}"); fi
            shift 2
            ;;
        -v)
            [[ $# -ge 2 ]] || { echo "$usage" >&2; exit 2; }
            run_args+=(--volume "$2")
            shift 2
            ;;
        --entrypoint)
            [[ $# -ge 2 ]] || { echo "$usage" >&2; exit 2; }
            entrypoint=("$2")
            own_entrypoint=1
            shift 2
            ;;
        -h | --help) echo "$usage"; exit 0 ;;
        -*) echo "run-image.sh: unknown option $1" >&2; echo "$usage" >&2; exit 2 ;;
        *) break ;;
    esac
done
image=${1:?$usage}
shift

# The image's ENTRYPOINT and CMD, one argument a line.
lines() { buildah inspect --type image --format "{{range .Docker.Config.$1}}{{println .}}{{end}}" "$image"; }
if [[ -z "$own_entrypoint" ]]; then mapfile -t entrypoint < <(lines Entrypoint); fi
if [[ $# -gt 0 ]]; then command=("$@"); else mapfile -t command < <(lines Cmd); fi

container=$(buildah from --quiet --pull-never "$image")
child=
# A signal for the command goes to the command itself: `buildah run` and its chroot helper answer
# SIGTERM by killing it. Under them: buildah-chroot-runtime, buildah-chroot-exec, the command.
forward() {  # $1: the signal
    local pid=$child next
    for _ in 1 2; do
        next=$(pgrep -P "$pid" | head -n1) || return 0
        pid=$next
    done
    pgrep -P "$pid" | xargs -r kill -"$1" 2>/dev/null || true
}
cleanup() {
    if [[ -n "$child" ]] && kill -0 "$child" 2>/dev/null; then
        kill -KILL "$child" 2>/dev/null || true
        wait "$child" 2>/dev/null || true
    fi
    buildah rm "$container" >/dev/null 2>&1 || true
}
trap cleanup EXIT
trap 'forward TERM' TERM
trap 'forward INT' INT

# In the background, so that this shell takes SIGTERM at once and passes it on.
buildah run --isolation chroot --network host "${run_args[@]}" "$container" -- \
    "${entrypoint[@]}" "${command[@]}" &
child=$!
status=0
# wait returns early (above 128) when a trapped signal arrives; then wait for the command itself.
while true; do
    wait "$child" && status=0 || status=$?
    kill -0 "$child" 2>/dev/null || break
done
child=
exit "$status"
