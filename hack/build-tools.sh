#!/usr/bin/env bash
# Builds helm and the kstatus checker (hack/kstatus) from Go modules, cached
# like the control plane. Prints the directory holding them.
set -euo pipefail

# shellcheck source=lib.sh
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/lib.sh"
kstatus_sum="$(sha256sum "$here/kstatus/main.go" | cut -c1-12)"
use_cached_output "$cache/tools/helm-${HELM_VERSION}_cli-utils-${CLI_UTILS_VERSION}_${kstatus_sum}"
log() { echo "[build-tools] $*" >&2; }

if [[ ! -x "$out/helm" ]]; then
  log "building helm ${HELM_VERSION}"
  build_go_binary "$cache/src/helm-${HELM_VERSION}" "helm.sh/helm/v3@${HELM_VERSION}" "$out/helm" \
    helm.sh/helm/v3/cmd/helm "-s -w -X helm.sh/helm/v3/internal/version.version=${HELM_VERSION}"
fi

if [[ ! -x "$out/kstatus-check" ]]; then
  work="$cache/src/kstatus-${CLI_UTILS_VERSION}-${kstatus_sum}"
  mkdir -p "$work"
  cp "$here/kstatus/main.go" "$work/main.go"
  (
    cd "$work"
    [[ -f go.mod ]] || go mod init tether.dev/build/kstatus >/dev/null 2>&1
    go get "sigs.k8s.io/cli-utils@${CLI_UTILS_VERSION}" >&2
    go mod tidy >&2
    log "building kstatus-check (cli-utils ${CLI_UTILS_VERSION})"
    go build -trimpath -ldflags "-s -w" -o "$out/kstatus-check.tmp" . >&2
    mv "$out/kstatus-check.tmp" "$out/kstatus-check"
  )
fi
touch "$out/.complete"
echo "$out"
