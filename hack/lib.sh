# Shared by the build scripts: pinned versions, Go settings, the cache, and a
# cached output directory that is reused as soon as it is complete.
# shellcheck shell=bash

here="$(cd "$(dirname "${BASH_SOURCE[1]}")" && pwd)"
# shellcheck source=versions.env
source "$here/versions.env"
export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS="-mod=mod -buildvcs=false"
cache="${TETHER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/tether}"

# use_cached_output DIR: prints DIR and exits when an earlier build completed it; else creates it.
use_cached_output() {
  out="$1"
  if [[ -f "$out/.complete" ]]; then
    echo "$out"
    exit 0
  fi
  mkdir -p "$out"
}
