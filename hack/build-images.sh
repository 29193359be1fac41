#!/usr/bin/env bash
# Produces the images a real node runs (issue 12), as archives `ctr images import` takes, cached
# by their inputs. Prints a directory holding tether.tar, pause.tar and images.env.
#   base:   Debian bookworm with Python 3.11 (debootstrap from Debian's packages), standing in for
#           python:3.11-slim, which no registry here can serve. It trusts this machine's CA
#           certificates (the package mirror and PyPI are reached through them).
#   tether: `docker build` of the project's own Dockerfile on that base (--build-arg BASE), tagged
#           also as the examples' worker image, so examples/*.yaml run unchanged.
#   pause:  the static pause binary from hack/build-node.sh, the node's pinned sandbox image.
set -euo pipefail

# shellcheck source=lib.sh
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/lib.sh"
root="$(cd "$here/.." && pwd)"
log() { echo "[build-images] $*" >&2; }

BASE_IMAGE="tether.local/base:bookworm-python3.11"
PAUSE_IMAGE="tether.local/pause:${KUBERNETES_VERSION}"
EXAMPLE_IMAGE="ghcr.io/tether-dev/example-worker:0.1.0"
# What the image is built from (the Dockerfile's COPY lines); its hash names the image.
inputs=(Dockerfile pyproject.toml README.md operator examples tests/support/worker_app.py)
source_sum="$(cd "$root" && find "${inputs[@]}" -type f -not -path '*/__pycache__/*' -not -path '*/.import_linter_cache/*' -not -name '*.pyc' -print0 \
  | sort -z | xargs -0 sha256sum | sha256sum | cut -c1-12)"
TETHER_IMAGE="tether.local/tether:${source_sum}"
use_cached_output "$cache/images/${KUBERNETES_VERSION}_${source_sum}"

bash "$here/dockerd.sh"
node_bin="$(bash "$here/build-node.sh")"

# The base image: its rootfs tarball is cached, so a new Docker data root only re-imports it.
base_tar="$cache/images/base-bookworm-python3.11.tar"
if [[ ! -f "$base_tar" ]]; then
  command -v debootstrap >/dev/null || apt_install debootstrap
  rootfs="$(mktemp -d "$cache/images/rootfs.XXXXXX")"
  log "debootstrap bookworm with python3 into $rootfs (a few minutes)"
  debootstrap --variant=minbase --include=python3,python3-venv,python-is-python3,ca-certificates \
    bookworm "$rootfs" http://deb.debian.org/debian >&2
  cp /usr/local/share/ca-certificates/*.crt "$rootfs/usr/local/share/ca-certificates/" 2>/dev/null || true
  chroot "$rootfs" update-ca-certificates >&2
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
  tar -C "$rootfs" --numeric-owner -cf "$base_tar.tmp" .
  mv "$base_tar.tmp" "$base_tar"
  rm -rf "$rootfs"
fi
if ! docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
  log "importing $BASE_IMAGE"
  # pip uses its own CA bundle unless told otherwise: point it at the system's.
  docker import --change 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' --change 'CMD ["python3"]' \
    "$base_tar" "$BASE_IMAGE" >&2
fi

log "docker build of $root/Dockerfile as $TETHER_IMAGE (log: $out/build.log)"
# The classic builder: it uses the local base image as it is, never asking a registry.
if ! DOCKER_BUILDKIT=0 docker build --network host --build-arg "BASE=$BASE_IMAGE" \
  -t "$TETHER_IMAGE" -t "$EXAMPLE_IMAGE" "$root" >"$out/build.log" 2>&1; then
  tail -40 "$out/build.log" >&2
  exit 1
fi
docker save -o "$out/tether.tar.tmp" "$TETHER_IMAGE" "$EXAMPLE_IMAGE"
mv "$out/tether.tar.tmp" "$out/tether.tar"

if ! docker image inspect "$PAUSE_IMAGE" >/dev/null 2>&1; then
  log "making $PAUSE_IMAGE from $node_bin/pause"
  tar -C "$node_bin" --owner=0 --group=0 -cf - pause \
    | docker import --change 'ENTRYPOINT ["/pause"]' --change 'USER 65535:65535' - "$PAUSE_IMAGE" >&2
fi
docker save -o "$out/pause.tar.tmp" "$PAUSE_IMAGE"
mv "$out/pause.tar.tmp" "$out/pause.tar"

cat > "$out/images.env" <<EOF
TETHER_IMAGE=$TETHER_IMAGE
EXAMPLE_IMAGE=$EXAMPLE_IMAGE
PAUSE_IMAGE=$PAUSE_IMAGE
BASE_IMAGE=$BASE_IMAGE
EOF
touch "$out/.complete"
# Each source change makes a new image (about 370 MB): keep only this one, in the cache and in Docker.
for old in "$cache"/images/v*_*; do
  [[ "$old" != "$out" ]] && rm -rf "$old"
done
docker images --format '{{.Repository}}:{{.Tag}}' tether.local/tether | grep -vxF "$TETHER_IMAGE" \
  | xargs -r docker rmi >/dev/null 2>&1 || true
echo "$out"
