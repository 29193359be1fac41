#!/usr/bin/env bash
# Builds kwok (fake nodes and pods for scale benchmarks) from Go modules, cached
# like the control plane. Prints the directory holding the binary.
set -euo pipefail

# shellcheck source=lib.sh
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/lib.sh"
use_cached_output "$cache/tools/kwok-${KWOK_VERSION}"
log() { echo "[build-kwok] $*" >&2; }

work="$cache/src/kwok-${KWOK_VERSION}"
mkdir -p "$work"
(
  cd "$work"
  [[ -f go.mod ]] || go mod init tether.dev/build/kwok >/dev/null 2>&1
  go get "sigs.k8s.io/kwok@${KWOK_VERSION}" >&2
  log "building kwok ${KWOK_VERSION}"
  go build -trimpath -ldflags "-s -w -X sigs.k8s.io/kwok/pkg/consts.Version=${KWOK_VERSION}" \
    -o "$out/kwok.tmp" sigs.k8s.io/kwok/cmd/kwok >&2
  mv "$out/kwok.tmp" "$out/kwok"
  # kwok simulates nothing without stages; the binary embeds none. Its own "fast" stages (pods
  # Running at once, Job pods then Succeeded, deleted pods removed; nodes Ready, status
  # refreshed beside the node Lease) from the same module version:
  src="$(go list -m -f '{{.Dir}}' sigs.k8s.io/kwok)/kustomize/stage"
  for f in node/fast/node-initialize.yaml node/heartbeat-with-lease/node-heartbeat-with-lease.yaml \
           pod/fast/pod-ready.yaml pod/fast/pod-complete.yaml pod/fast/pod-delete.yaml; do
    echo "---"
    cat "$src/$f"
  done > "$out/stages.yaml"
)
touch "$out/.complete"
echo "$out"
