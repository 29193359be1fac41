#!/usr/bin/env bash
# Builds what a real node needs beside the control plane (issue 12): kubelet from the same
# Kubernetes module workspace as the control plane, containerd 2.x and its runc shim from Go
# modules, ctr, and a static `pause` binary for the sandbox image, compiled from the Kubernetes
# module's own source. Cached like the control plane; prints the directory on stdout.
# runc, the CNI plugins and iptables come from Debian's packages, installed here when missing.
set -euo pipefail

# shellcheck source=lib.sh
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/lib.sh"
if ! command -v runc >/dev/null || [[ ! -x /usr/lib/cni/bridge ]] || ! command -v iptables >/dev/null; then
  apt_install runc containernetworking-plugins iptables
fi
use_cached_output "$cache/node/k8s-${KUBERNETES_VERSION}_containerd-${CONTAINERD_VERSION}"
log() { echo "[build-node] $*" >&2; }

if [[ ! -x "$out/kubelet" ]]; then
  (
    kubernetes_workspace
    log "building kubelet ${KUBERNETES_VERSION}"
    go build -p "${TETHER_BUILD_PARALLELISM:-2}" -trimpath -ldflags "$k8s_ldflags" -o "$out/kubelet.tmp" \
      k8s.io/kubernetes/cmd/kubelet >&2
    mv "$out/kubelet.tmp" "$out/kubelet"
  )
fi

# containerd: a consumer module of github.com/containerd/containerd/v2 (its go.mod has no local replaces).
work="$cache/src/containerd-${CONTAINERD_VERSION}"
mkdir -p "$work"
(
  cd "$work"
  [[ -f go.mod ]] || go mod init tether.dev/build/containerd >/dev/null 2>&1
  go get "github.com/containerd/containerd/v2@${CONTAINERD_VERSION}" >&2
  for b in containerd containerd-shim-runc-v2 ctr; do
    [[ -x "$out/$b" ]] && continue
    log "building $b ${CONTAINERD_VERSION}"
    go build -trimpath -ldflags "-s -w -X github.com/containerd/containerd/v2/version.Version=${CONTAINERD_VERSION}" \
      -o "$out/$b.tmp" "github.com/containerd/containerd/v2/cmd/$b" >&2
    mv "$out/$b.tmp" "$out/$b"
  done
)

# The sandbox ("pause") container's binary, as Kubernetes builds it: static, tiny.
if [[ ! -x "$out/pause" ]]; then
  src="$(go mod download -json "k8s.io/kubernetes@${KUBERNETES_VERSION}" | sed -n 's/.*"Dir": "\(.*\)".*/\1/p')"
  log "compiling pause from ${src}/build/pause/linux/pause.c"
  gcc -Os -Wall -Werror -static -DVERSION="${KUBERNETES_VERSION}" -o "$out/pause.tmp" "$src/build/pause/linux/pause.c" >&2
  mv "$out/pause.tmp" "$out/pause"
fi
touch "$out/.complete"
echo "$out"
