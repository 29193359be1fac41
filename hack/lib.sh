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

# kubernetes_workspace: cd into a consumer module of k8s.io/kubernetes@$KUBERNETES_VERSION whose
# staging modules (required at v0.0.0 with local replaces) are replaced by the published v0.X.Y,
# and set `k8s_ldflags` to the version stamps a release build carries.
kubernetes_workspace() {
  local kv="${KUBERNETES_VERSION#v}" staging_version modfile go_directive major rest minor pkg cpkg
  staging_version="v0.${kv#*.}"
  mkdir -p "$cache/src/kubernetes-${KUBERNETES_VERSION}"
  cd "$cache/src/kubernetes-${KUBERNETES_VERSION}"
  modfile="$(go mod download -json "k8s.io/kubernetes@${KUBERNETES_VERSION}" | sed -n 's/.*"GoMod": "\(.*\)".*/\1/p')"
  go_directive="$(grep -E '^go ' "$modfile" | awk '{print $2}')"
  {
    echo "module tether.dev/build/kubernetes"
    echo
    echo "go ${go_directive}"
    echo
    echo "require k8s.io/kubernetes ${KUBERNETES_VERSION}"
    echo
    grep -E '=> \./staging/' "$modfile" | awk -v v="$staging_version" '{print "replace " $1 " => " $1 " " v}'
  } > go.mod
  # A staging module the proxy does not serve at this version (k8s.io/endpointslice v0.32.13 is
  # refused) takes the newest served patch of the same minor: those releases carry the same code.
  local mod served
  for mod in $(awk '/^replace /{print $2}' go.mod); do
    go mod download "$mod@$staging_version" >/dev/null 2>&1 && continue
    served="$(go list -m -versions "$mod" 2>/dev/null | tr ' ' '\n' | grep -E "^${staging_version%.*}\.[0-9]+$" \
              | awk -F. -v p="${staging_version##*.}" '$3 + 0 < p + 0' | sort -t. -k3 -n | tail -1)" || true
    [[ -n "$served" ]] || continue
    echo "[kubernetes] $mod $staging_version is not served: using $served" >&2
    sed -i "s#^replace $mod => $mod $staging_version\$#replace $mod => $mod $served#" go.mod
  done
  major="${kv%%.*}"; rest="${kv#*.}"; minor="${rest%%.*}"
  pkg=k8s.io/component-base/version
  k8s_ldflags="-s -w -X ${pkg}.gitVersion=${KUBERNETES_VERSION} -X ${pkg}.gitMajor=${major} -X ${pkg}.gitMinor=${minor}"
  k8s_ldflags+=" -X ${pkg}.gitCommit=0000000000000000000000000000000000000000 -X ${pkg}.gitTreeState=clean"
  k8s_ldflags+=" -X ${pkg}.buildDate=1970-01-01T00:00:00Z"
  # kubectl reads its version from client-go too.
  cpkg=k8s.io/client-go/pkg/version
  k8s_ldflags+=" -X ${cpkg}.gitVersion=${KUBERNETES_VERSION} -X ${cpkg}.gitMajor=${major} -X ${cpkg}.gitMinor=${minor}"
}

# apt_install PKG...: Debian packages the node needs, installed when missing (a fresh machine may
# have no package lists yet: update once and retry; a package manager left interrupted by a killed
# install refuses everything until `dpkg --configure -a` has finished it: run that, then retry).
apt_install() {
  export DEBIAN_FRONTEND=noninteractive
  echo "[apt] installing $*" >&2
  local out
  if out="$(apt-get install -y -q "$@" 2>&1)"; then
    echo "$out" >&2
    return 0
  fi
  echo "$out" >&2
  if grep -q "dpkg was interrupted" <<<"$out"; then
    echo "[apt] dpkg was left interrupted: finishing it with dpkg --configure -a" >&2
    dpkg --configure -a >&2
  fi
  apt-get update -q >&2 && apt-get install -y -q "$@" >&2
}

# build_go_binary WORK REQUIRE DEST PKG [LDFLAGS]: builds package PKG to DEST in a consumer module in
# WORK (made on first use) that requires REQUIRE (module@version); DEST appears only once complete.
build_go_binary() {
  local work="$1" require="$2" dest="$3" pkg="$4" ldflags="${5:--s -w}"
  mkdir -p "$work"
  (
    cd "$work"
    [[ -f go.mod ]] || go mod init "tether.dev/build/$(basename "$work")" >/dev/null 2>&1
    go get "$require" >&2
    go build -trimpath -ldflags "$ldflags" -o "$dest.tmp" "$pkg" >&2
    mv "$dest.tmp" "$dest"
  )
}
