#!/usr/bin/env bash
# `make install-tools PREFIX=DIR`: helm and kubectl for the quick start. One already on PATH is used
# as it is; only a missing one is built (hack/build-tools.sh, hack/build-control-plane.sh: cached,
# the control plane's first build takes about 20 minutes on 2 cores) and linked into DIR/bin.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
prefix="${1:?usage: install-tools.sh PREFIX}"
mkdir -p "$prefix/bin"
for tool in helm kubectl; do
  if found="$(command -v "$tool")"; then
    echo "$tool: using $found (on PATH)"
    continue
  fi
  case "$tool" in
    helm) dir="$(bash "$here/build-tools.sh" | tail -1)" ;;
    kubectl) dir="$(bash "$here/build-control-plane.sh" | tail -1)" ;;
  esac
  ln -sf "$dir/$tool" "$prefix/bin/$tool"
  echo "$tool: built here, linked into $prefix/bin"
done
