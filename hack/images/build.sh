#!/usr/bin/env bash
# `make images`: build the operator and server images (images/*.Dockerfile), tagged with the package
# version, with buildah where it exists (podman or docker otherwise), and print each image's size.
#
#   IMAGES="operator server server-cpu"   which to build (server: CUDA base; server-cpu: Debian base, CPU torch)
#   REGISTRY=ghcr.io/conveyor-dev         image names: $REGISTRY/conveyor-operator:$VERSION, ...-server:$VERSION[-cpu]
#   LOCAL_BASE=1                          no registry reachable: build on a Debian base made by debootstrap
#                                         (hack/images/debian-base.sh, cached) instead of python:/debian: images
#   CPU_TORCH_INDEX=URL                   the CPU variant's torch index (default PyTorch's CPU wheels; empty: PyPI)
set -euo pipefail
cd "$(dirname "$0")/../.."

VERSION=$(python3 -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["version"])')
REGISTRY=${REGISTRY:-ghcr.io/conveyor-dev}
IMAGES=${IMAGES:-operator server server-cpu}
CPU_TORCH_INDEX=${CPU_TORCH_INDEX-https://download.pytorch.org/whl/cpu}

# Behind a TLS-inspecting proxy, pip needs the host's CA bundle (PIP_CERT): buildah and podman mount it
# into the RUN steps (never into the image) and the Dockerfiles' `ARG PIP_CERT` points pip at it.
ca_args=()
if [ -n "${PIP_CERT:-}" ] && [ -f "$PIP_CERT" ]; then
  ca_args=(--volume "$PIP_CERT:/run/conveyor-build/ca.crt:ro" --build-arg PIP_CERT=/run/conveyor-build/ca.crt)
fi

if command -v buildah >/dev/null; then
  # vfs needs no kernel overlay support; chroot isolation needs no OCI runtime (RUN steps work as root).
  export STORAGE_DRIVER=${STORAGE_DRIVER:-vfs}
  # --layers keeps each step's layer, so a rebuild after a source change reinstalls no dependency.
  build() { buildah bud --isolation chroot --layers "${ca_args[@]}" "$@"; }
  size() { buildah images --format '{{.Size}}' "$1"; }
elif command -v podman >/dev/null; then
  build() { podman build "${ca_args[@]}" "$@"; }
  size() { podman image inspect --format '{{.Size}}' "$1"; }
elif command -v docker >/dev/null; then
  build() { docker build "$@"; }
  size() { docker image inspect --format '{{.Size}}' "$1"; }
else
  echo "no image builder: install buildah (apt-get install buildah), podman or docker" >&2
  exit 1
fi

debian_base=python:3.11-slim-bookworm
if [ -n "${LOCAL_BASE:-}" ]; then
  debian_base=$(bash hack/images/debian-base.sh)
fi

for image in $IMAGES; do
  start=$(date +%s)
  case $image in
    operator)
      tag=$REGISTRY/conveyor-operator:$VERSION
      build -f images/operator.Dockerfile --build-arg "BASE=$debian_base" -t "$tag" . ;;
    server)
      tag=$REGISTRY/conveyor-server:$VERSION
      build -f images/server.Dockerfile -t "$tag" . ;;
    server-cpu)
      tag=$REGISTRY/conveyor-server:$VERSION-cpu
      build -f images/server.Dockerfile --build-arg "BASE=$debian_base" \
        --build-arg "TORCH_INDEX=$CPU_TORCH_INDEX" -t "$tag" . ;;
    *) echo "unknown image $image (operator, server, server-cpu)" >&2; exit 2 ;;
  esac
  echo "built $tag: $(size "$tag") in $(( $(date +%s) - start )) s"
done
