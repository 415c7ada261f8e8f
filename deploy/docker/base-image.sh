#!/bin/sh
# Make a local Python base image when no container registry is reachable: Debian bookworm
# (debootstrap --variant=minbase) with its python3 (3.11, as python:3.11-slim-bookworm) and
# what the Dockerfile needs from a base (venv for the builder stage; ca-certificates,
# netbase and tzdata as the official slim image has them), imported with podman.
#
#   base-image.sh [TAG]          default TAG: localhost/noetl-base:bookworm
#
# Then: make images PYTHON_IMAGE=localhost/noetl-base:bookworm (what `make images` does
# by itself with podman when no registry answers; docs/DEPLOY.md, "Images"). Needs root
# (debootstrap), debootstrap and podman; DEBIAN_MIRROR picks the archive (default
# http://deb.debian.org/debian). Does nothing when TAG already exists (FORCE=1 remakes it).
set -eu
PATH=$PATH:/usr/sbin:/sbin  # debootstrap, chroot
tag=${1:-localhost/noetl-base:bookworm}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
podman=${PODMAN:-podman}

if [ -z "${FORCE:-}" ] && "$podman" image exists "$tag"; then
  echo "base-image: $tag exists (FORCE=1 remakes it)"
  exit 0
fi
for cmd in debootstrap "$podman" tar; do
  command -v "$cmd" >/dev/null 2>&1 || { echo "base-image: '$cmd' is needed (apt-get install debootstrap podman)" >&2; exit 1; }
done
[ "$(id -u)" = 0 ] || { echo "base-image: debootstrap needs root" >&2; exit 1; }

root=$(mktemp -d "${TMPDIR:-/var/tmp}/noetl-base.XXXXXX")
trap 'rm -rf "$root"' EXIT
echo "base-image: debootstrap bookworm from $mirror into $root"
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates,netbase,tzdata \
  bookworm "$root" "$mirror" >"$root.log" 2>&1 || { tail -n 30 "$root.log" >&2; rm -f "$root.log"; exit 1; }
rm -f "$root.log"
# What an image does not need: package caches and lists, documentation, debootstrap's leftovers.
chroot "$root" apt-get clean
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/* "$root"/var/log/* \
       "$root"/usr/share/doc/* "$root"/usr/share/man/* "$root"/usr/share/info/* \
       "$root"/debootstrap "$root"/dev/* "$root"/proc/* "$root"/sys/* "$root"/run/* "$root"/tmp/*
python_version=$(chroot "$root" python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')
echo "base-image: python $python_version; importing as $tag"
tar --numeric-owner -C "$root" -c . | "$podman" import --quiet \
  --change 'ENV LANG=C.UTF-8' --change 'CMD ["python3"]' \
  --message "debootstrap --variant=minbase bookworm + python3 $python_version (deploy/docker/base-image.sh)" \
  - "$tag" >/dev/null
echo "base-image: $tag ready"
