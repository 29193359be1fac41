#!/usr/bin/env bash
# Builds Kueue's manager from Go modules, cached like the control plane, and keeps beside it the
# module's own CRDs (config/components/crd/bases) and webhook configurations. Prints the directory holding them.
set -euo pipefail

# shellcheck source=lib.sh
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/lib.sh"
use_cached_output "$cache/tools/kueue-${KUEUE_VERSION}"
log() { echo "[build-kueue] $*" >&2; }

work="$cache/src/kueue-${KUEUE_VERSION}"
mkdir -p "$work"
(
  cd "$work"
  [[ -f go.mod ]] || go mod init tether.dev/build/kueue >/dev/null 2>&1
  go get "sigs.k8s.io/kueue@${KUEUE_VERSION}" >&2
  log "building kueue ${KUEUE_VERSION}"
  go build -trimpath -ldflags "-s -w -X sigs.k8s.io/kueue/pkg/version.GitVersion=${KUEUE_VERSION}" \
    -o "$out/kueue.tmp" sigs.k8s.io/kueue/cmd/kueue >&2
  mv "$out/kueue.tmp" "$out/kueue"
  src="$(go list -m -f '{{.Dir}}' sigs.k8s.io/kueue)/config/components"
  mkdir -p "$out/crds"
  cp "$src"/crd/bases/*.yaml "$out/crds/"
  cp "$src/webhook/manifests.yaml" "$out/webhooks.yaml"
  chmod u+w "$out/crds"/*.yaml "$out/webhooks.yaml"
)
touch "$out/.complete"
echo "$out"
