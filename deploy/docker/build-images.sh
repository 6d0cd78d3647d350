#!/usr/bin/env bash
# Builds shoal's container images without a Docker daemon: buildah (--isolation chroot) builds
# deploy/docker/Dockerfile's targets over a base image. `make images` runs it.
#
#   deploy/docker/build-images.sh [TARGET...]    TARGET: gateway, worker, worker-cuda
#                                                (default: gateway worker)
#   deploy/docker/build-images.sh --pip-settings  print the pip.conf and the buildah flags that
#                                                carry the host's pip settings, and build nothing
#
# The base: BASE, default localhost/shoal-base:bookworm, which this script makes with debootstrap
# when it is missing (Debian bookworm minbase, python3, python3-venv, ca-certificates: the stand-in
# for python:3.11-slim-bookworm where no registry is reachable). Pass BASE=python:3.11-slim-bookworm
# where one is.
#
# pip inside the build gets the host's settings (`pip config list`: index URLs, find-links, trusted
# hosts, proxy, constraints) as a pip.conf, and the host's CA bundle, both as build secrets that are
# mounted for the install step only and left in no layer. Settings that name local paths (a file://
# index, a find-links folder, a constraints file) are bind-mounted read-only at the same path.
#
# Each image is tagged localhost/shoal-TARGET:<hash of its inputs> and :latest. The hash covers the
# Dockerfile, install.sh, what the build copies (pyproject.toml, README.md, requirements/weights.txt,
# src/), the base image's ID and the build arguments; an image whose tag exists is not built again.
# Older tags of the same image are removed.
#
# Environment: BASE; TORCH_SPEC, install.sh's torch arguments for the worker (default torch==2.13.0,
# which the host's pip settings must resolve to the CPU wheel, 2.13.0+cpu: install.sh fails the
# build on a CUDA one); CUDA_TORCH_SPEC, the same for worker-cuda (default torch===2.13.0: exactly
# PyPI's 2.13.0, the CUDA 13.0 build, never a local 2.13.0+cpu); SLIM (default 1: install.sh trims the venvs); DEBIAN_MIRROR; IMAGE_PREFIX (default
# localhost/shoal-); PYTHON, whose pip's settings are read (default python3).
set -euo pipefail

cd "$(dirname "$0")/../.."
BASE=${BASE:-localhost/shoal-base:bookworm}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
CUDA_TORCH_SPEC=${CUDA_TORCH_SPEC:-torch===2.13.0}
SLIM=${SLIM:-1}
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
IMAGE_PREFIX=${IMAGE_PREFIX:-localhost/shoal-}
print_pip_settings=0
if [[ "${1:-}" == --pip-settings ]]; then print_pip_settings=1; shift; fi
targets=("$@")
if [[ ${#targets[@]} == 0 ]]; then targets=(gateway worker); fi
for target in "${targets[@]}"; do
    case "$target" in
        gateway | worker | worker-cuda) ;;
        *) echo "build-images.sh: unknown target $target (gateway, worker, worker-cuda)" >&2; exit 2 ;;
    esac
done

say() { echo "build-images.sh: $*" >&2; }

work=$(mktemp -d /var/tmp/shoal-images.XXXXXX)
trap 'rm -rf "$work"' EXIT

# --- the host's pip settings, as build secrets and read-only mounts ---------------------------------

pip_conf="$work/pip.conf"
mounts=()
add_mount() {  # a local path named by a pip setting, bind-mounted read-only at the same path
    local path=${1#file://}
    if [[ "$path" == /* && -e "$path" && " ${mounts[*]} " != *" -v=$path:$path:ro "* ]]; then
        mounts+=("-v=$path:$path:ro")
    fi
}
# `pip config list` prints the PIP_* variables' settings (:env:.key) and each file's (global.key)
# as scope.key='value', the ones that win first.
declare -A pip_settings=()
while IFS= read -r line; do
    key=${line#*.}
    key=${key%%=*}
    value=${line#*=}
    value=${value#\'}
    value=${value%\'}
    if [[ -z "${pip_settings[$key]+set}" ]]; then pip_settings[$key]=$value; fi
done < <("${PYTHON:-python3}" -m pip config list 2>/dev/null || true)
ca_bundle=${pip_settings[cert]:-${REQUESTS_CA_BUNDLE:-${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}}}
proxy=${pip_settings[proxy]:-${HTTPS_PROXY:-${https_proxy:-${HTTP_PROXY:-${http_proxy:-}}}}}
{
    echo "[global]"
    for key in index-url extra-index-url find-links constraint trusted-host timeout default-timeout retries; do
        if [[ -n "${pip_settings[$key]:-}" ]]; then
            echo "$key = ${pip_settings[$key]}"
            for item in ${pip_settings[$key]}; do
                # A file:// index's pages may link outside it (../../files/...): its parent too.
                if [[ "$key" == *index-url && "$item" == file://* ]]; then item=$(dirname "${item%/}"); fi
                add_mount "$item"
            done
        fi
    done
    if [[ -n "$proxy" ]]; then echo "proxy = $proxy"; fi
    if [[ -f "$ca_bundle" ]]; then echo "cert = /run/secrets/pip-ca"; fi
} >"$pip_conf"
secrets=("--secret=id=pip.conf,src=$pip_conf")
if [[ -f "$ca_bundle" ]]; then secrets+=("--secret=id=pip-ca,src=$ca_bundle"); fi

if [[ "$print_pip_settings" == 1 ]]; then
    cat "$pip_conf"
    printf '%s\n' "${secrets[@]}" "${mounts[@]}"
    exit 0
fi

# --- tools ------------------------------------------------------------------------------------------

need_packages=()
command -v buildah >/dev/null || need_packages+=(buildah)
if [[ "$BASE" == localhost/shoal-base:* ]] && ! command -v debootstrap >/dev/null; then
    need_packages+=(debootstrap)
fi
if [[ ${#need_packages[@]} -gt 0 ]]; then
    say "installing ${need_packages[*]} with apt"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_packages[@]}" >/dev/null
fi

# --- the base ---------------------------------------------------------------------------------------

make_base() {
    local root="$work/rootfs" ctr
    say "making $BASE with debootstrap (Debian bookworm minbase + python3)"
    debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
        bookworm "$root" "$DEBIAN_MIRROR" >"$work/debootstrap.log" 2>&1 \
        || { tail -20 "$work/debootstrap.log" >&2; exit 1; }
    # What Debian's slim images leave out: documentation (but the copyright files), manuals,
    # translations; and what an installer leaves behind: the apt lists and caches, logs.
    find "$root/usr/share/doc" -type f ! -name copyright -delete
    find "$root/usr/share/doc" -type d -empty -delete
    rm -rf "$root"/usr/share/{man,info,locale}/* "$root"/var/lib/apt/lists/* \
        "$root"/var/cache/apt/*.bin "$root"/var/cache/apt/archives/*.deb "$root"/var/log/*
    # /dev, /proc and /sys come from the runtime.
    tar --numeric-owner -C "$root" --exclude='./dev/*' --exclude='./proc/*' --exclude='./sys/*' \
        -cf "$work/rootfs.tar" .
    rm -rf "$root"
    ctr=$(buildah from scratch)
    buildah add --quiet "$ctr" "$work/rootfs.tar" / >/dev/null
    rm -f "$work/rootfs.tar"
    buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        --env LANG=C.UTF-8 --cmd python3 --os linux --arch amd64 \
        --label org.opencontainers.image.description="Debian bookworm minbase with python3 (debootstrap)" "$ctr"
    buildah commit --quiet --rm --format docker "$ctr" "$BASE" >/dev/null
}

if ! buildah inspect --type image "$BASE" >/dev/null 2>&1; then
    if [[ "$BASE" == localhost/shoal-base:* ]]; then
        started=$SECONDS
        make_base
        say "$BASE made in $((SECONDS - started)) s"
    else
        say "pulling $BASE"
        buildah pull --quiet "$BASE" >/dev/null
    fi
fi
base_id=$(buildah inspect --type image --format '{{.FromImageID}}' "$BASE")

# --- the images -------------------------------------------------------------------------------------

torch_spec_of() {  # $1: target
    case "$1" in worker) echo "$TORCH_SPEC" ;; worker-cuda) echo "$CUDA_TORCH_SPEC" ;; esac
}

inputs_hash() {  # $1: target
    {
        echo "target=$1 base=$base_id torch_spec=$(torch_spec_of "$1") slim=$SLIM"
        find deploy/docker/Dockerfile deploy/docker/install.sh pyproject.toml README.md \
            requirements/weights.txt src -type f ! -path '*/__pycache__/*' ! -name '*.pyc' \
            ! -path '*.egg-info/*' -print0 | sort -z | xargs -0 sha256sum
    } | sha256sum | cut -c1-16
}

for target in "${targets[@]}"; do
    image="$IMAGE_PREFIX$target"
    tag=$(inputs_hash "$target")
    if buildah inspect --type image "$image:$tag" >/dev/null 2>&1; then
        say "$image:$tag is up to date"
    else
        say "building $image:$tag"
        started=$SECONDS
        buildah bud --isolation chroot --network host --format docker --quiet \
            --file deploy/docker/Dockerfile --target "$target" \
            --build-arg BASE="$BASE" --build-arg TORCH_SPEC="$(torch_spec_of "$target")" --build-arg SLIM="$SLIM" \
            "${secrets[@]}" "${mounts[@]}" --tag "$image:$tag" . >&2
        say "built $image:$tag in $((SECONDS - started)) s"
    fi
    buildah tag "$image:$tag" "$image:latest"
    # Older builds of this image, and what builder stages left behind (untagged images).
    buildah images --noheading --format '{{.Name}}:{{.Tag}}' --filter reference="$image" \
        | grep -v -x -e "$image:$tag" -e "$image:latest" | xargs -r buildah rmi >/dev/null 2>&1 || true
    buildah rmi --prune >/dev/null 2>&1 || true
done

for target in "${targets[@]}"; do
    buildah images --noheading --format '{{.Name}}:{{.Tag}} {{.Size}}' "$IMAGE_PREFIX$target:latest"
done
buildah images --noheading --format '{{.Name}}:{{.Tag}} {{.Size}}' "$BASE"
