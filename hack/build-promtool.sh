#!/usr/bin/env bash
# Builds promtool (github.com/prometheus/prometheus/cmd/promtool) and hack/promql-names (the metric
# names a PromQL expression reads, from Prometheus's own parser) from Go modules, cached like the
# other tools: `promtool check rules` and `promtool test rules` check the alerts in deploy/prometheus
# (tests/unit/chart/test_alerts.py), promql-names the dashboards' and alerts' metrics against a live
# operator (tests/e2e/test_observability.py). Prints the directory holding them.
set -euo pipefail

# shellcheck source=lib.sh
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/lib.sh"
names_sum="$(sha256sum "$here/promql-names/main.go" | cut -c1-12)"
use_cached_output "$cache/tools/promtool-${PROMETHEUS_MODULE_VERSION}_${names_sum}"
log() { echo "[build-promtool] $*" >&2; }
module="github.com/prometheus/prometheus"
work="$cache/src/promtool-${PROMETHEUS_MODULE_VERSION}"

if [[ ! -x "$out/promtool" ]]; then
  # Prometheus 3.X.Y is tagged as the Go module version v0.3XX.Y (v0.316.0 is 3.16.0).
  mv="${PROMETHEUS_MODULE_VERSION#v0.}"
  release="${mv:0:1}.$((10#${mv:1:2})).${mv#*.}"
  log "building promtool ${release} (module ${PROMETHEUS_MODULE_VERSION})"
  build_go_binary "$work" "${module}@${PROMETHEUS_MODULE_VERSION}" "$out/promtool" "${module}/cmd/promtool" \
    "-s -w -X github.com/prometheus/common/version.Version=${release}"
fi

if [[ ! -x "$out/promql-names" ]]; then
  mkdir -p "$work/promql-names"
  cp "$here/promql-names/main.go" "$work/promql-names/main.go"
  log "building promql-names (module ${PROMETHEUS_MODULE_VERSION})"
  build_go_binary "$work" "${module}@${PROMETHEUS_MODULE_VERSION}" "$out/promql-names" ./promql-names
fi
touch "$out/.complete"
echo "$out"
