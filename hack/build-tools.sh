#!/usr/bin/env bash
# Builds helm and the kstatus checker (hack/kstatus) from Go modules, cached
# like the control plane. Prints the directory holding them.
set -euo pipefail

# shellcheck source=lib.sh
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/lib.sh"
kstatus_sum="$(sha256sum "$here/kstatus/main.go" | cut -c1-12)"
# "-k8s": helm built with upstream's Kubernetes version stamps (below).
use_cached_output "$cache/tools/helm-${HELM_VERSION}-k8s_cli-utils-${CLI_UTILS_VERSION}_${kstatus_sum}"
log() { echo "[build-tools] $*" >&2; }

if [[ ! -x "$out/helm" ]]; then
  log "building helm ${HELM_VERSION}"
  # As helm's own Makefile stamps a release: the Kubernetes version `helm template` assumes is the one
  # of the client-go it is built with (unstamped it is 1.20, which the chart's kubeVersion refuses).
  helm_mod="$(go mod download -json "helm.sh/helm/v3@${HELM_VERSION}" | sed -n 's/.*"GoMod": "\(.*\)".*/\1/p')"
  client_go="$(awk '$1 == "k8s.io/client-go" {print $2; exit}' "$helm_mod")"  # v0.MINOR.PATCH
  k8s_minor="$(cut -d. -f2 <<<"$client_go")"
  stamps="-X helm.sh/helm/v3/pkg/chartutil.k8sVersionMajor=1 -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMinor=${k8s_minor}"
  stamps+=" -X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMajor=1 -X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMinor=${k8s_minor}"
  build_go_binary "$cache/src/helm-${HELM_VERSION}" "helm.sh/helm/v3@${HELM_VERSION}" "$out/helm" \
    helm.sh/helm/v3/cmd/helm "-s -w -X helm.sh/helm/v3/internal/version.version=${HELM_VERSION} ${stamps}"
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
