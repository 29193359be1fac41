#!/usr/bin/env bash
# Makes sure a Docker engine answers, starting Debian's `dockerd` without systemd if none does.
# `--iptables=false --bridge=none`: builds run with `--network host`, so the engine never rewrites
# the machine's firewall rules or adds a default bridge (kind's network is made by
# hack/e2e-kind.sh). Its default runtime is runc without CAP_SYS_RESOURCE (hack/kind/runc-wrapper),
# which this machine cannot grant and privileged containers (kind's nodes) ask for. A dockerd this
# script started earlier without that runtime is restarted. Installs docker.io and jq when missing.
set -euo pipefail
# shellcheck source=lib.sh
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/lib.sh"
log="$cache/docker/dockerd.log"
pidfile=/var/run/docker.pid  # dockerd's own default
runtime=tether-runc
mkdir -p "$(dirname "$log")"

command -v dockerd >/dev/null || apt_install docker.io
command -v jq >/dev/null || apt_install jq
# A copy at a path that does not move with the checkout: the daemon keeps it for as long as it runs.
wrapper="$cache/docker/runc-wrapper"
if ! cmp -s "$here/kind/runc-wrapper" "$wrapper" 2>/dev/null; then
  install -m 0755 "$here/kind/runc-wrapper" "$wrapper.tmp" && mv "$wrapper.tmp" "$wrapper"
fi

ours() {  # the default runtime is this wrapper, at this path
  [[ "$(docker info --format "{{.DefaultRuntime}} {{(index .Runtimes \"$runtime\").Path}}" 2>/dev/null)" \
    == "$runtime $wrapper" ]]
}
if docker info >/dev/null 2>&1; then
  ours && exit 0
  pid="$(cat "$pidfile" 2>/dev/null || true)"
  # Ours when started as below (no systemd unit manages it): anyone else's engine is left alone.
  if [[ -z "$pid" ]] || ! tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null | grep -q -- '--bridge=none'; then
    echo "[dockerd] a Docker engine runs without the $runtime runtime (see hack/dockerd.sh); kind needs it" >&2
    exit 0  # not ours to restart: image builds still work, kind's privileged nodes will not
  fi
  if [[ -n "$(docker ps -q)" ]]; then
    echo "[dockerd] dockerd $pid runs without $runtime at $wrapper, and has running containers:" \
      "stop them (or it), then run this again" >&2
    exit 1
  fi
  echo "[dockerd] restarting dockerd $pid with the $runtime runtime" >&2
  kill "$pid"
  for _ in $(seq 1 120); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
  if kill -0 "$pid" 2>/dev/null; then echo "[dockerd] dockerd $pid did not stop" >&2; exit 1; fi
fi

echo "[dockerd] starting dockerd (log: $log)" >&2
# The daemon outlives this script: it must not inherit its descriptors, or a lock held by whoever
# ran us (`flock FILE make test`) would be held by dockerd for as long as it runs.
(
  for fd in /proc/self/fd/*; do
    fd=${fd##*/}
    if [[ $fd -gt 2 ]]; then eval "exec $fd>&-" 2>/dev/null || true; fi
  done
  exec setsid nohup dockerd --iptables=false --ip6tables=false --bridge=none \
    --add-runtime "$runtime=$wrapper" --default-runtime "$runtime" >>"$log" 2>&1 < /dev/null
) &
for _ in $(seq 1 60); do
  if docker info >/dev/null 2>&1; then
    ours && exit 0
    echo "[dockerd] the Docker engine answering has not the $runtime runtime at $wrapper; see $log" >&2
    exit 1
  fi
  sleep 1
done
echo "[dockerd] dockerd did not answer within 60 s; see $log" >&2
exit 1
