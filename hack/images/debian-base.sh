#!/usr/bin/env bash
# A Debian bookworm base image made by debootstrap from Debian's mirror, for building images where no
# container registry is reachable (buildah, as root). Built once; prints its name.
set -euo pipefail
export STORAGE_DRIVER=${STORAGE_DRIVER:-vfs}
name=localhost/conveyor-debian-base:bookworm
if ! buildah inspect --type image "$name" >/dev/null 2>&1; then
  # The machine's own Debian mirror (apt's sources), which is reachable where registries are not.
  mirror=${DEBIAN_MIRROR:-$({ cat /etc/apt/sources.list /etc/apt/sources.list.d/*.sources 2>/dev/null || true; } |
    awk '/^(deb|URIs:)/ {for (i = 1; i <= NF; i++) if ($i ~ /^https?:/) {print $i; exit}}')}
  mirror=${mirror:-http://deb.debian.org/debian}
  root=$(mktemp -d)
  trap 'rm -rf "$root"' EXIT
  debootstrap --variant=minbase bookworm "$root" "$mirror" >&2
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/cache/apt/*.bin "$root"/var/lib/apt/lists/*
  container=$(buildah from scratch)
  buildah copy "$container" "$root" / >/dev/null
  buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "$container"
  buildah commit --rm "$container" "$name" >&2
fi
echo "$name"
