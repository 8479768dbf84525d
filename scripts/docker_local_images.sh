#!/usr/bin/env bash
# Builds the CPU deployment's images where no image registry is reachable (as on CI): a Debian
# bookworm base made with debootstrap and `docker import`, a CPU torch wheel in docker/wheels/, then
# the project's Dockerfiles through docker-compose.yml + docker/compose.host-network.yml.
# Each step is skipped when its result is already there; docker's layer cache does the rest.
# Needs root (debootstrap), a running Docker engine, and `docker compose` or `docker-compose`.
set -euo pipefail
cd "$(dirname "$0")/.."

BASE_IMAGE=${PAGEDSERVE_BASE_IMAGE:-pagedserve-base:bookworm}
TORCH_VERSION=$(sed -n 's/^TORCH_VERSION ?= //p' Makefile)

compose() {
  if docker compose version >/dev/null 2>&1; then
    docker compose "$@"
  else
    docker-compose "$@"
  fi
}

# bookworm, minbase, plus what the Dockerfiles need: python3 with venv and pip's CA certificates,
# with the CAs this host added locally (a TLS-inspecting proxy's, say) trusted too. debootstrap's
# own default mirror unless DEBOOTSTRAP_MIRROR names another.
base_image() {
  if docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
    echo "base image $BASE_IMAGE: already built"
    return
  fi
  local root status=0
  root=$(mktemp -d /var/tmp/pagedserve-base.XXXXXX)
  if debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
      bookworm "$root/fs" ${DEBOOTSTRAP_MIRROR:-} >"$root/log" 2>&1; then
    cp /usr/local/share/ca-certificates/*.crt "$root/fs/usr/local/share/ca-certificates/" \
      2>/dev/null && chroot "$root/fs" update-ca-certificates >/dev/null
    rm -rf "$root"/fs/var/cache/apt/archives/*.deb "$root"/fs/var/lib/apt/lists/*
    tar -C "$root/fs" -c . | docker import --change 'CMD ["python3"]' - "$BASE_IMAGE" >/dev/null \
      || status=1
  else
    tail -20 "$root/log"
    status=1
  fi
  rm -rf "$root"
  [ "$status" = 0 ] && echo "base image $BASE_IMAGE: built"
  return "$status"
}

# The CPU build of the pinned torch, from pip's find-links (never an index: there the Linux wheel
# is the multi-GB CUDA build), for the base image's Python.
torch_wheel() {
  if ls docker/wheels/torch-"$TORCH_VERSION"+cpu-*.whl >/dev/null 2>&1; then
    echo "torch wheel: already in docker/wheels"
    return
  fi
  local py
  py=$(docker run --rm --network host "$BASE_IMAGE" python3 -c \
    'import sys; print("%d.%d" % sys.version_info[:2])')
  python3 -m pip download -q --no-index --no-deps --only-binary=:all: --python-version "$py" \
    -d docker/wheels "torch==$TORCH_VERSION" \
    || { echo "no CPU wheel of torch $TORCH_VERSION for Python $py in pip's find-links;" \
              "put one in docker/wheels/" >&2; return 1; }
  ls docker/wheels/torch-"$TORCH_VERSION"+cpu-*.whl >/dev/null \
    || { echo "the torch wheel found is not a CPU build" >&2; return 1; }
}

base_image
torch_wheel
PAGEDSERVE_BASE_IMAGE=$BASE_IMAGE compose -f docker-compose.yml -f docker/compose.host-network.yml \
  --profile cpu build model-init executor-cpu
