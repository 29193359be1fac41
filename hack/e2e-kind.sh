#!/usr/bin/env bash
# The end-to-end suite on a kind cluster (issue 25):
#   1. kind and its node image, built here (hack/build-kind.sh), unless KIND_NODE_IMAGE names one
#      (a user's machine: kind's own image from the registry, e.g. kindest/node:v1.36.x);
#   2. `kind create cluster` with the configuration below (the API server's audit log on this
#      machine); 3. the Tether and Kueue images loaded into it; 4. Kueue's chart and Tether's chart
#      installed, with their defaults plus what the tests need;
#   5. pytest against that cluster: tests/kind and every e2e test not marked local_cluster (those
#      need the local control plane's process pids, files or an operator of their own), or
#      KIND_TESTS; 6. the cluster deleted (KIND_KEEP=1 keeps it).
# KIND_CLUSTER names the cluster; KIND_SETUP_ONLY=1 stops after step 4 and prints the kubeconfig's
# path and the API server's audit log's (on this machine).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
# shellcheck source=lib.sh
source hack/lib.sh
CLUSTER="${KIND_CLUSTER:-tether-e2e}"
log() { echo "[e2e-kind] $(date +%T) $*" >&2; }
started=$SECONDS

bash hack/dockerd.sh  # (every build below may be cached: none of them would start it)
kind_dir="$(bash hack/build-kind.sh)"
# shellcheck source=/dev/null
source "$kind_dir/node-image.env"
kind="$kind_dir/bin/kind"
if [[ -z "${KIND_NODE_IMAGE:-}" ]]; then
  docker image inspect "$NODE_IMAGE" >/dev/null 2>&1 || docker load -i "$kind_dir/node-image.tar" >&2
  KIND_NODE_IMAGE="$NODE_IMAGE"
  built_here=1
fi
images_dir="$(bash hack/build-images.sh)"
# shellcheck source=/dev/null
source "$images_dir/images.env"
tools="$(bash hack/build-tools.sh | tail -1)"
# Kueue: its manager built from Go modules (hack/build-kueue.sh) as an image like its own (/manager),
# installed by its own Helm chart, from its module, with examples/queues/kueue-values.yaml.
kueue_bin="$(bash hack/build-kueue.sh)/kueue"
KUEUE_IMAGE="tether.local/kueue:${KUEUE_VERSION}"
if ! docker image inspect "$KUEUE_IMAGE" >/dev/null 2>&1; then
  tar -C "$(dirname "$kueue_bin")" --owner=0 --group=0 --transform 's|^kueue$|manager|' -cf - kueue \
    | docker import --change 'ENTRYPOINT ["/manager"]' --change 'USER 65532:65532' - "$KUEUE_IMAGE" >&2
fi
kueue_chart="$(go mod download -json "sigs.k8s.io/kueue@${KUEUE_VERSION}" | sed -n 's/.*"Dir": "\(.*\)".*/\1/p')/charts/kueue"
log "built in $((SECONDS - started)) s"

# Docker here has no default bridge (hack/dockerd.sh); kind's nodes get a network of their own, with
# no masquerading: nothing in the cluster reaches past this machine.
network="${KIND_EXPERIMENTAL_DOCKER_NETWORK:-tether-kind}"
export KIND_EXPERIMENTAL_DOCKER_NETWORK="$network"
# (Made by whichever of two concurrent runs gets there first; KIND_SUBNET if 172.30.0.0/24 is taken.)
docker network inspect "$network" >/dev/null 2>&1 \
  || docker network create --driver bridge --subnet "${KIND_SUBNET:-172.30.0.0/24}" \
       -o com.docker.network.bridge.enable_ip_masquerade=false "$network" >&2 \
  || docker network inspect "$network" >/dev/null

# The API server's audit log, as the local control plane writes it (tether.devcluster.controlplane's
# policy): the tests' oracle reads it on the host, through a mount of the node's directory.
audit_dir="$cache/kind/$CLUSTER-audit"
rm -rf "$audit_dir" && mkdir -p "$audit_dir"
.venv/bin/python -c 'import sys, yaml; from tether.devcluster.controlplane import AUDIT_POLICY; yaml.safe_dump(AUDIT_POLICY, sys.stdout)' \
  > "$audit_dir/policy.yaml"
config="$(mktemp)"
kubeconfig="${KIND_KUBECONFIG:-$cache/kind/$CLUSTER.kubeconfig}"
# Deleted at the end, and whenever the set-up fails (KIND_SETUP_ONLY keeps only a finished set-up).
cleanup() {
  local rc=$?
  rm -f "$config"
  if [[ -z "${KIND_KEEP:-}" ]] && [[ -z "${KIND_SETUP_ONLY:-}" || $rc -ne 0 ]]; then
    "$kind" delete cluster --name "$CLUSTER" >&2 || true
  fi
}
trap cleanup EXIT
trap 'exit 143' TERM INT  # (so that a stopped run cleans up too)
# The node image built here has a bridge CNI configuration instead of kindnetd (not buildable here),
# the control plane's etcd, and a kubelet that runs on this machine's cgroup v1.
own_cni="" etcd_patch="" kubelet_patch=""
if [[ -n "${built_here:-}" ]]; then
  own_cni=$'\n  disableDefaultCNI: true\n  podSubnet: 10.244.0.0/16'
  etcd_patch=$'\n  etcd:\n    local:\n      imageTag: "'"$ETCD_IMAGE_TAG"'"'
  kubelet_patch=$'\n- |\n  kind: KubeletConfiguration\n  failCgroupV1: false'
fi
cat > "$config" <<EOF
kind: Cluster
apiVersion: kind.x-k8s.io/v1alpha4
name: $CLUSTER
networking:
  apiServerAddress: 127.0.0.1$own_cni
nodes:
- role: control-plane
  extraMounts:
  - {hostPath: "$audit_dir", containerPath: /var/log/tether-audit}
kubeadmConfigPatches:
- |
  kind: ClusterConfiguration
  apiServer:
    extraArgs:
    - {name: audit-policy-file, value: /var/log/tether-audit/policy.yaml}
    - {name: audit-log-path, value: /var/log/tether-audit/audit.log}
    - {name: audit-log-format, value: json}
    - {name: audit-log-maxsize, value: "0"}
    - {name: audit-log-mode, value: blocking}
    extraVolumes:
    - {name: tether-audit, hostPath: /var/log/tether-audit, mountPath: /var/log/tether-audit, pathType: DirectoryOrCreate}$etcd_patch$kubelet_patch
EOF

"$kind" delete cluster --name "$CLUSTER" >/dev/null 2>&1 || true
log "kind create cluster --image $KIND_NODE_IMAGE"
t=$SECONDS
"$kind" create cluster --name "$CLUSTER" --image "$KIND_NODE_IMAGE" --config "$config" --kubeconfig "$kubeconfig" \
  --wait 240s >&2
log "cluster ready in $((SECONDS - t)) s"


t=$SECONDS
"$kind" load docker-image "$KUEUE_IMAGE" --name "$CLUSTER" >&2
"$tools/helm" upgrade --install kueue "$kueue_chart" --namespace kueue-system --create-namespace \
  --kubeconfig "$kubeconfig" -f examples/queues/kueue-values.yaml \
  --set controllerManager.manager.image.repository="${KUEUE_IMAGE%:*}" \
  --set controllerManager.manager.image.tag="${KUEUE_IMAGE##*:}" \
  --set controllerManager.manager.image.pullPolicy=Never --wait --timeout 300s >&2
log "Kueue installed in $((SECONDS - t)) s"

# Tether as docs/own-cluster.md installs it: the release's artefacts (make release, here into a
# directory of this run's own), then that page's kind block as written, run where dist/ and
# examples/ are; then the tests' values on top (the gateway, a short fold interval).
t=$SECONDS
release_dir="$cache/kind/$CLUSTER-release"
rm -rf "$release_dir" && mkdir -p "$release_dir"
.venv/bin/python packaging/release.py --out "$release_dir/dist" --helm "$tools/helm" >/dev/null
ln -s "$root/examples" "$release_dir/examples"
log "release built in $((SECONDS - t)) s"
t=$SECONDS
block="$(.venv/bin/python - docs/own-cluster.md <<'PY'
import re, sys
blocks = re.findall(r"<!-- owncluster:begin -->\s*```bash\n(.*?)```\s*<!-- owncluster:end -->", open(sys.argv[1]).read(), re.S)
assert len(blocks) == 1, "docs/own-cluster.md needs one bash block between the owncluster markers"
print(blocks[0])
PY
)"
(cd "$release_dir" && KIND_CLUSTER_NAME="$CLUSTER" KUBECONFIG="$kubeconfig" \
  PATH="$kind_dir/bin:$tools:$(bash "$root/hack/build-control-plane.sh"):$PATH" bash -euxo pipefail -c "$block") >&2
"$tools/helm" upgrade tether "$release_dir/dist/tether-$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml | head -1).tgz" \
  --namespace tether-system --kubeconfig "$kubeconfig" --reuse-values \
  --set gateway.enabled=true --set foldIntervalSeconds=1 --wait --timeout 300s >&2
log "chart installed as docs/own-cluster.md says in $((SECONDS - t)) s"
if [[ -n "${KIND_SETUP_ONLY:-}" ]]; then
  echo "$kubeconfig $audit_dir/audit.log $release_dir/dist"
  exit 0
fi

t=$SECONDS
# The chart's operator (cluster-wide) drives the runs; tests that need the local cluster's process
# kubelet (pids, SIGSTOP, on-disk pod logs, a killable operator) are marked local_cluster.
if [[ -n "${KIND_TESTS:-}" ]]; then read -r -a tests <<<"$KIND_TESTS"; else tests=(tests/e2e tests/kind -m "not local_cluster"); fi
TETHER_KIND_KUBECONFIG="$kubeconfig" TETHER_KIND_NODE="$CLUSTER-control-plane" TETHER_KIND_RELEASE="$release_dir/dist" \
  TETHER_TEST_KUBECONFIG="$kubeconfig" TETHER_TEST_AUDIT_LOG="$audit_dir/audit.log" TETHER_TEST_EXTERNAL_OPERATOR=1 TETHER_TEST_WORKER_IMAGE="$EXAMPLE_IMAGE" \
  TETHER_TEST_BIN_DIR="$(bash hack/build-control-plane.sh)" \
  .venv/bin/python -m pytest "${tests[@]}" -p no:cacheprovider -ra
log "tests ran in $((SECONDS - t)) s; all in $((SECONDS - started)) s"
