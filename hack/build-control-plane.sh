#!/usr/bin/env bash
# Builds etcd, kube-apiserver, kube-controller-manager, kube-scheduler and
# kubectl from Go modules (through the module proxy) and caches them outside
# the repository. Prints the directory holding the binaries on stdout.
# With --oldest, the oldest supported Kubernetes instead (no kubectl).
#
# TETHER_CONTROL_PLANE_BIN=<dir> (or KUBEBUILDER_ASSETS) skips the build and
# uses existing binaries, e.g. from setup-envtest (TETHER_OLDEST_CONTROL_PLANE_BIN for --oldest).
set -euo pipefail

override="${TETHER_CONTROL_PLANE_BIN:-${KUBEBUILDER_ASSETS:-}}"
[[ "${1:-}" == "--oldest" ]] && override="${TETHER_OLDEST_CONTROL_PLANE_BIN:-}"
if [[ -n "$override" ]]; then
  dir="$override"
  for b in etcd kube-apiserver; do
    [[ -x "$dir/$b" ]] || { echo "error: $dir/$b missing or not executable" >&2; exit 1; }
  done
  echo "$dir"
  exit 0
fi

# shellcheck source=lib.sh
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/lib.sh"
# --oldest: the oldest supported Kubernetes (KUBERNETES_OLDEST_VERSION), with the same etcd.
binaries=(kube-apiserver kube-controller-manager kube-scheduler kubectl)
if [[ "${1:-}" == "--oldest" ]]; then
  KUBERNETES_VERSION="$KUBERNETES_OLDEST_VERSION"
  binaries=(kube-apiserver kube-controller-manager kube-scheduler)
fi
use_cached_output "$cache/control-plane/k8s-${KUBERNETES_VERSION}_etcd-${ETCD_VERSION}"
log() { echo "[build-control-plane] $*" >&2; }

# etcd: its server/go.mod has relative replaces, so build it from a consumer module.
if [[ ! -x "$out/etcd" ]]; then
  work="$cache/src/etcd-${ETCD_VERSION}"
  mkdir -p "$work"
  (
    cd "$work"
    [[ -f go.mod ]] || go mod init tether.dev/build/etcd >/dev/null 2>&1
    go get "go.etcd.io/etcd/server/v3@${ETCD_VERSION}" >&2
    log "building etcd ${ETCD_VERSION}"
    go build -trimpath -ldflags "-s -w" -o "$out/etcd.tmp" go.etcd.io/etcd/server/v3 >&2
    mv "$out/etcd.tmp" "$out/etcd"
  )
fi

# Kubernetes: from a consumer module with the staging modules at their published versions.
(
  kubernetes_workspace
  for b in "${binaries[@]}"; do
    [[ -x "$out/$b" ]] && continue
    log "building $b ${KUBERNETES_VERSION}"
    # -p 1 keeps the kube-apiserver link within memory on small machines.
    go build -p "${TETHER_BUILD_PARALLELISM:-2}" -trimpath -ldflags "$k8s_ldflags" -o "$out/$b.tmp" "k8s.io/kubernetes/cmd/$b" >&2
    mv "$out/$b.tmp" "$out/$b"
  done
)
if [[ "${1:-}" == "--oldest" && ! -e "$out/kubectl" ]]; then
  # Tests drive the oldest server with the pinned kubectl (built by the plain run of this script).
  newest="$(env -u TETHER_OLDEST_CONTROL_PLANE_BIN bash "${BASH_SOURCE[0]}")"
  ln -sf "$newest/kubectl" "$out/kubectl"
fi
touch "$out/.complete"
echo "$out"
