#!/usr/bin/env bash
# End-to-end suite on kind, for users with Docker and kind (not available on the
# project's own CI machines, which use the local control plane instead).
#   1. build the image  2. load it into kind  3. helm install  4. run the suite against that cluster
set -euo pipefail
cd "$(dirname "$0")/.."
CLUSTER="${KIND_CLUSTER:-tether-e2e}"
IMAGE="${IMAGE:-tether:e2e}"
command -v docker >/dev/null || { echo "docker is required" >&2; exit 1; }
command -v kind >/dev/null || { echo "kind is required (https://kind.sigs.k8s.io)" >&2; exit 1; }

docker build -t "$IMAGE" .
kind get clusters | grep -qx "$CLUSTER" || kind create cluster --name "$CLUSTER"
kind load docker-image "$IMAGE" --name "$CLUSTER"
KUBECONFIG_FILE="$(mktemp)"
kind get kubeconfig --name "$CLUSTER" > "$KUBECONFIG_FILE"
TOOLS="$(bash hack/build-tools.sh)"
"$TOOLS/helm" upgrade --install tether charts/tether --namespace tether-system --create-namespace \
  --kubeconfig "$KUBECONFIG_FILE" --set image.repository="${IMAGE%:*}" --set image.tag="${IMAGE##*:}" \
  --set image.pullPolicy=Never --wait --timeout 300s
# The chart's operator (cluster-wide) drives the runs; tests that need a local process
# kubelet (pids, SIGSTOP, on-disk pod logs, a killable operator) are marked local_cluster.
TETHER_TEST_KUBECONFIG="$KUBECONFIG_FILE" TETHER_TEST_EXTERNAL_OPERATOR=1 TETHER_TEST_WORKER_IMAGE="$IMAGE" \
  .venv/bin/python -m pytest tests/e2e -m "not local_cluster" -p no:cacheprovider -ra
