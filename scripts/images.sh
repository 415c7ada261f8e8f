#!/usr/bin/env bash
# `make images`: the seven role images from the root Dockerfile, one `--target <role>` each,
# tagged $IMAGE_REPOSITORY-<role>:$IMAGE_TAG (docs/DEPLOY.md, "Images").
#
# ENGINE    auto (default): Docker when `$DOCKER info` reaches an engine, else podman, else
#           buildah; or docker|podman|buildah. podman and buildah build with
#           --isolation chroot (BUILD_ISOLATION), which needs no OCI runtime.
# PYTHON_IMAGE  the base of both stages. Default python:3.11-slim-bookworm. With podman or
#           buildah and no PYTHON_IMAGE given, when that image is neither stored nor
#           pullable (no registry), the local base LOCAL_BASE (deploy/docker/base-image.sh:
#           debootstrap bookworm + python3, imported with podman; made once, then reused)
#           is used instead.
# OFFLINE   1: fetch on the host, into deploy/docker/wheelhouse/, the wheels the builder
#           needs (the project's dependencies and build requirements, for the base image's
#           Python, glibc and machine: binary wheels only), and build with
#           --build-arg WHEELHOUSE=/wheelhouse, so that pip in the build asks no index.
#           0: pip in the build uses its index. Default: 1 with the local base, else 0.
# DRY_RUN=1 prints the build commands only (Docker's when no engine is found).
set -euo pipefail
cd "$(dirname "$0")/.."
PATH=$PATH:/usr/sbin:/sbin  # chroot

ROLES=(api shard-manager projector checkpointer compactor reaper worker)
ENGINE=${ENGINE:-auto}
DOCKER=${DOCKER:-docker}
PODMAN=${PODMAN:-podman}
BUILDAH=${BUILDAH:-buildah}
IMAGE_REPOSITORY=${IMAGE_REPOSITORY:-noetl-runtime}
IMAGE_TAG=${IMAGE_TAG:?IMAGE_TAG is needed}
REGISTRY_BASE=python:3.11-slim-bookworm
LOCAL_BASE=${LOCAL_BASE:-localhost/noetl-base:bookworm}
PYTHON_IMAGE=${PYTHON_IMAGE:-}
OFFLINE=${OFFLINE:-}
BUILD_ISOLATION=${BUILD_ISOLATION:-chroot}
PYTHON=${PYTHON:-python3}
WHEELHOUSE_DIR=deploy/docker/wheelhouse
read -r -a EXTRA <<<"${DOCKER_BUILD_ARGS:-}"

say() { echo "make images: $*" >&2; }
fail() { say "$*"; exit 1; }
have() { command -v "$1" >/dev/null 2>&1; }

# ---------------------------------------------------------------- the engine
docker_hint="'make images DRY_RUN=1' prints the build commands; 'make check-deploy' checks the Dockerfile without an engine."
case $ENGINE in
  auto)
    if have "$DOCKER" && "$DOCKER" info >/dev/null 2>&1; then ENGINE=docker
    elif have "$PODMAN"; then ENGINE=podman
    elif have "$BUILDAH"; then ENGINE=buildah
    elif [ -n "${DRY_RUN:-}" ]; then ENGINE=docker
    elif have "$DOCKER"; then
      fail "'$DOCKER' is installed but cannot reach a Docker engine ('$DOCKER info' failed), and neither podman nor buildah is installed. Nothing was built. $docker_hint"
    else
      fail "no '$DOCKER' command on this machine, and neither podman nor buildah: an engine is needed to build the images (apt-get install podman buildah). Nothing was built. $docker_hint"
    fi ;;
  docker)
    if [ -z "${DRY_RUN:-}" ]; then
      have "$DOCKER" || fail "no '$DOCKER' command on this machine; Docker is needed to build the images. Nothing was built. $docker_hint"
      "$DOCKER" info >/dev/null 2>&1 || fail "'$DOCKER' is installed but cannot reach a Docker engine ('$DOCKER info' failed). Nothing was built. $docker_hint"
    fi ;;
  podman) [ -n "${DRY_RUN:-}" ] || have "$PODMAN" || fail "no '$PODMAN' command (apt-get install podman). Nothing was built." ;;
  buildah) [ -n "${DRY_RUN:-}" ] || have "$BUILDAH" || fail "no '$BUILDAH' command (apt-get install buildah). Nothing was built." ;;
  *) fail "ENGINE=$ENGINE: one of auto, docker, podman, buildah" ;;
esac
case $ENGINE in
  docker) build=("$DOCKER" build); store=("$DOCKER") ;;
  podman) build=("$PODMAN" build --format docker --isolation "$BUILD_ISOLATION"); store=("$PODMAN") ;;
  # buildah keeps no layer cache unless asked; it shares podman's image store
  buildah) build=("$BUILDAH" build --format docker --layers --isolation "$BUILD_ISOLATION"); store=("$BUILDAH") ;;
esac

# ---------------------------------------------------------------- the base image
base_stored() {
  if [ "$ENGINE" = buildah ]; then "$BUILDAH" inspect --type image "$1" >/dev/null 2>&1
  else "${store[@]}" image inspect "$1" >/dev/null 2>&1; fi
}
if [ -z "$PYTHON_IMAGE" ]; then
  PYTHON_IMAGE=$REGISTRY_BASE
  if [ "$ENGINE" != docker ] && ! base_stored "$REGISTRY_BASE"; then
    if [ -n "${DRY_RUN:-}" ]; then  # no pull for a dry run: what is stored decides
      ! base_stored "$LOCAL_BASE" || PYTHON_IMAGE=$LOCAL_BASE
    elif ! timeout 300 "${store[@]}" pull -q "$REGISTRY_BASE" >/dev/null 2>&1; then
      say "$REGISTRY_BASE cannot be pulled (no registry); using the local base $LOCAL_BASE"
      PYTHON_IMAGE=$LOCAL_BASE
    fi
  fi
fi
if [ "$PYTHON_IMAGE" = "$LOCAL_BASE" ] && [ -z "${DRY_RUN:-}" ]; then
  [ "$ENGINE" != docker ] || fail "the local base $LOCAL_BASE is made with podman; build with ENGINE=podman (or give PYTHON_IMAGE)"
  have "$PODMAN" || fail "the local base $LOCAL_BASE is imported with podman (apt-get install podman), or give PYTHON_IMAGE"
  PODMAN=$PODMAN sh deploy/docker/base-image.sh "$LOCAL_BASE" >&2
fi
[ -n "$OFFLINE" ] || { [ "$PYTHON_IMAGE" = "$LOCAL_BASE" ] && OFFLINE=1 || OFFLINE=0; }

# ---------------------------------------------------------------- the wheelhouse (offline)
# The target of the wheels is the base image's interpreter, read from the image itself
# (not the host's: a wheel of a compiled dependency is for one CPython minor version and
# glibc); pip download then takes binary wheels for exactly that.
image_python() {
  local probe='import platform, sys, sysconfig; print("%d.%d" % sys.version_info[:2], platform.libc_ver()[1], sysconfig.get_platform().split("-", 1)[1])'
  if [ "$ENGINE" = docker ]; then
    "$DOCKER" run --rm --entrypoint python3 "$PYTHON_IMAGE" -c "$probe"
  else  # no container can run here: chroot into the image's mounted file system
    [ "$(id -u)" = 0 ] || fail "OFFLINE=1 with $ENGINE reads the base image's python from its mounted file system: run as root"
    local mnt ctr status=0
    if [ "$ENGINE" = podman ]; then
      mnt=$("$PODMAN" image mount "$PYTHON_IMAGE")
      chroot "$mnt" python3 -c "$probe" || status=$?
      "$PODMAN" image unmount "$PYTHON_IMAGE" >/dev/null
    else
      ctr=$("$BUILDAH" from --pull-never "$PYTHON_IMAGE")
      mnt=$("$BUILDAH" mount "$ctr")
      chroot "$mnt" python3 -c "$probe" || status=$?
      "$BUILDAH" rm "$ctr" >/dev/null
    fi
    return $status
  fi
}

fill_wheelhouse() {
  local pyver glibc machine
  read -r pyver glibc machine < <(image_python) || fail "could not run python3 of $PYTHON_IMAGE"
  [ -n "$machine" ] || fail "could not read python3's version, glibc and machine in $PYTHON_IMAGE"
  [ -n "$glibc" ] || fail "$PYTHON_IMAGE has no glibc (musl?): the offline build fetches manylinux wheels"
  local abi="cp${pyver/./}" minor=${glibc#*.} platforms=()
  for ((m = minor; m >= 17; m--)); do platforms+=(--platform "manylinux_2_${m}_${machine}"); done
  platforms+=(--platform "manylinux2014_${machine}")
  mapfile -t build_requires < <("$PYTHON" -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["build-system"]["requires"]))')
  say "wheels for CPython $pyver, glibc $glibc, $machine into $WHEELHOUSE_DIR/ (pip download, binary only)"
  find "$WHEELHOUSE_DIR" -name '*.whl' -delete
  local log
  log=$(mktemp)
  # `.`: the project's dependencies (its own wheel is built in the image, from the source)
  if ! "$PYTHON" -m pip download --quiet --disable-pip-version-check --dest "$WHEELHOUSE_DIR" \
      --only-binary=:all: --python-version "$pyver" --implementation cp --abi "$abi" "${platforms[@]}" \
      . "${build_requires[@]}" >"$log" 2>&1; then
    grep -v "is ignored: it is neither" "$log" | tail -n 30 >&2
    rm -f "$log"
    fail "pip download failed: every dependency needs a binary wheel for $abi manylinux $machine"
  fi
  rm -f "$log"
  find "$WHEELHOUSE_DIR" -name 'noetl_runtime-*.whl' -delete
  say "$(find "$WHEELHOUSE_DIR" -name '*.whl' | wc -l) wheels ($(du -sh "$WHEELHOUSE_DIR" | cut -f1))"
}

args=()
[ "$PYTHON_IMAGE" = "$REGISTRY_BASE" ] || args+=(--build-arg "PYTHON_IMAGE=$PYTHON_IMAGE")
if [ "$OFFLINE" = 1 ]; then
  args+=(--build-arg WHEELHOUSE=/wheelhouse)
  [ -n "${DRY_RUN:-}" ] || fill_wheelhouse
fi

# ---------------------------------------------------------------- the builds
[ -n "${DRY_RUN:-}" ] || say "engine $ENGINE, base $PYTHON_IMAGE, $([ "$OFFLINE" = 1 ] && echo "offline (wheels from $WHEELHOUSE_DIR/)" || echo "pip uses its index")"
for r in "${ROLES[@]}"; do
  cmd=("${build[@]}" --target "$r" --build-arg "VERSION=$IMAGE_TAG" "${args[@]}" "${EXTRA[@]}" -t "$IMAGE_REPOSITORY-$r:$IMAGE_TAG" .)
  if [ -n "${DRY_RUN:-}" ]; then
    echo "${cmd[*]}"
    continue
  fi
  echo "==> $IMAGE_REPOSITORY-$r:$IMAGE_TAG"
  "${cmd[@]}"
done
