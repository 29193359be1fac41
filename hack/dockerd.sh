#!/usr/bin/env bash
# Makes sure a Docker engine answers, starting Debian's `dockerd` without systemd if none does.
# `--iptables=false --bridge=none`: builds run with `--network host`, so the engine never rewrites
# the machine's firewall rules or adds a bridge. Installs docker.io when dockerd is missing.
set -euo pipefail
# shellcheck source=lib.sh
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/lib.sh"
log="$cache/docker/dockerd.log"

docker info >/dev/null 2>&1 && exit 0
command -v dockerd >/dev/null || apt_install docker.io
mkdir -p "$(dirname "$log")"
echo "[dockerd] starting dockerd (log: $log)" >&2
# The daemon outlives this script: it must not inherit its descriptors, or a lock held by whoever
# ran us (`flock FILE make test`) would be held by dockerd for as long as it runs.
(
  for fd in /proc/self/fd/*; do
    fd=${fd##*/}
    if [[ $fd -gt 2 ]]; then eval "exec $fd>&-" 2>/dev/null || true; fi
  done
  exec setsid nohup dockerd --iptables=false --ip6tables=false --bridge=none >>"$log" 2>&1 < /dev/null
) &
for _ in $(seq 1 60); do
  docker info >/dev/null 2>&1 && exit 0
  sleep 1
done
echo "[dockerd] dockerd did not answer within 60 s; see $log" >&2
exit 1
