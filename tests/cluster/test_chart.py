"""The Helm chart: lint, render, schema, and CRDs identical to crds/."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from testkit import runs
from testkit.kube import Kube, eventually

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "tether"
ADMISSION = "/apis/admissionregistration.k8s.io/v1"
LEASES = "/apis/coordination.k8s.io/v1/namespaces/tether-system/leases"
# Where the process kubelet records the host port it gave each declared container port.
HOST_PORTS_ANNOTATION = "dev.tether.dev/host-ports"


def helm(tools_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(tools_dir / "helm"), *args], capture_output=True, text=True)


def test_chart_crds_are_identical_to_top_level() -> None:
    top = {p.name: p.read_bytes() for p in (ROOT / "crds").glob("*.yaml")}
    chart = {p.name: p.read_bytes() for p in (CHART / "crds").glob("*.yaml")}
    assert top and top == chart


def test_helm_lint_strict(tools_dir: Path) -> None:
    result = helm(tools_dir, "lint", "--strict", str(CHART))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 chart(s) failed" in result.stdout


def render(tools_dir: Path, *sets: str) -> list[dict]:
    args = ["template", "rel", str(CHART), "--namespace", "tether-system", "--kube-version", "1.36.3"]
    for s in sets:
        args += ["--set", s]
    result = helm(tools_dir, *args)
    assert result.returncode == 0, result.stderr
    return [d for d in yaml.safe_load_all(result.stdout) if d]


def test_template_renders_a_restricted_operator(tools_dir: Path) -> None:
    rendered = render(tools_dir, "watchNamespaces={team-a,team-b}")
    docs = {d["kind"]: d for d in rendered if d["metadata"]["name"] in ("rel-tether", "rel-tether-gateway") or
            d["kind"] not in ("ClusterRole", "Service")}
    assert set(docs) == {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Service", "Deployment",
                         "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}
    services = sorted(d["metadata"]["name"] for d in render(tools_dir) if d["kind"] == "Service")
    assert services == ["rel-tether-gateway", "rel-tether-metrics"]
    dep = docs["Deployment"]
    pod = dep["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    sc = container["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"]
    assert sc["readOnlyRootFilesystem"] is True
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert "--namespace=team-a" in container["command"] and "--leader-elect" in container["command"]
    assert dep["spec"]["replicas"] == 2
    for doc in docs.values():
        labels = doc["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] == "tether" and labels["app.kubernetes.io/managed-by"] == "Helm"
        assert labels["app.kubernetes.io/instance"] == "rel" and "helm.sh/chart" in labels
    rules = docs["ClusterRole"]["rules"]
    assert not any("*" in r["verbs"] or "*" in r["resources"] for r in rules)


def test_people_get_view_and_edit_through_kubernetes_aggregated_roles_and_approval_only_when_bound(
        tools_dir: Path) -> None:
    roles = {d["metadata"]["name"]: d for d in render(tools_dir) if d["kind"] == "ClusterRole"}
    aggregated = lambda name: {k.rsplit("-", 1)[-1] for k, v in roles[name]["metadata"]["labels"].items()  # noqa: E731
                               if k.startswith("rbac.authorization.k8s.io/aggregate-to-") and v == "true"}
    assert aggregated("rel-tether-view") == {"view", "edit", "admin"}
    assert aggregated("rel-tether-edit") == {"edit", "admin"}
    assert aggregated("rel-tether-approver") == set()  # deciding a gate is granted one binding at a time
    view = roles["rel-tether-view"]["rules"]
    assert all(set(r["verbs"]) <= {"get", "list", "watch"} for r in view)
    assert any("leases" in r["resources"] for r in view)  # the console's liveness reads the Lease
    assert not any("workerrunapprovals" in r["resources"] and "create" in r["verbs"]
                   for r in roles["rel-tether-edit"]["rules"])
    assert any("workerrunapprovals" in r["resources"] and r["verbs"] == ["create"]
               for r in roles["rel-tether-approver"]["rules"])
    assert {d["metadata"]["name"] for d in render(tools_dir, "rbac.create=false") if d["kind"] == "ClusterRole"} == set()


def test_probes_hold_liveness_through_a_slow_start_and_tolerate_a_stalled_loop(tools_dir: Path) -> None:
    """The kubelet restarts the operator only for a loop that stays stopped: a start slowed by a
    loaded node is the startup probe's (liveness waits for it), and one probe answered late (a
    full garbage collection, a starved CPU) is not a failure."""
    def probes(*sets: str) -> dict[str, dict]:
        dep = next(d for d in render(tools_dir, *sets) if d["kind"] == "Deployment")
        container = dep["spec"]["template"]["spec"]["containers"][0]
        return {k: container.get(k) for k in ("startupProbe", "livenessProbe")}

    default = probes()
    startup, liveness = default["startupProbe"], default["livenessProbe"]
    assert startup["httpGet"] == liveness["httpGet"] == {"path": "/healthz", "port": "health"}
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 120  # the time a start may take
    assert startup["timeoutSeconds"] >= 2
    assert liveness["timeoutSeconds"] >= 5  # several GC pauses of a second or two
    assert liveness["failureThreshold"] >= 3 and liveness["periodSeconds"] >= 10
    tuned = probes("livenessProbe.timeoutSeconds=7", "livenessProbe.failureThreshold=4",
                   "livenessProbe.startup.periodSeconds=3", "livenessProbe.startup.failureThreshold=50")
    assert (tuned["livenessProbe"]["timeoutSeconds"], tuned["livenessProbe"]["failureThreshold"]) == (7, 4)
    assert (tuned["startupProbe"]["periodSeconds"], tuned["startupProbe"]["failureThreshold"]) == (3, 50)
    assert probes("livenessProbe.enabled=false") == {"startupProbe": None, "livenessProbe": None}


def test_optional_objects(tools_dir: Path) -> None:
    kinds = [d["kind"] for d in render(tools_dir, "metrics.serviceMonitor.enabled=true", "podDisruptionBudget.enabled=true",
                                       "gateway.ingress.enabled=true", "gateway.tls.secretName=gw-tls")]
    assert "ServiceMonitor" in kinds and "PodDisruptionBudget" in kinds and "Ingress" in kinds
    dep = next(d for d in render(tools_dir, "gateway.tls.secretName=gw-tls") if d["kind"] == "Deployment")
    command = dep["spec"]["template"]["spec"]["containers"][0]["command"]
    assert "--gateway-tls-cert=/etc/tether/gateway-tls/tls.crt" in command
    names = [d["metadata"]["name"] for d in render(tools_dir, "metrics.enabled=false", "gateway.enabled=false")
             if d["kind"] == "Service"]
    assert names == []


def _plain_policies() -> dict[tuple[str, str], dict]:
    docs = [d for p in sorted((ROOT / "policies").glob("*.yaml")) for d in yaml.safe_load_all(p.read_text()) if d]
    return {(d["kind"], d["metadata"]["name"].removeprefix("tether-")): d for d in docs}


# Policies for workers, from which the operator is exempt (the size policy judges its workers'
# publications); the approval and label policies exempt nobody.
WORKER_POLICIES = {"worker-status-fencing", "worker-lease-fencing", "namespace-worker-scope", "workerrun-size"}


def test_admission_policies_match_the_plain_manifests(tools_dir: Path) -> None:
    plain = _plain_policies()
    chart = {(d["kind"], d["metadata"]["name"].removeprefix("rel-tether-")): d for d in render(tools_dir)
             if d["kind"].startswith("ValidatingAdmissionPolicy")}
    names = WORKER_POLICIES | {"approval-approver", "workerrun-kueue-labels", "workerrun-service-account",
                               "workerclass-bounds", "schedule-service-account", "schedule-slot-fence", "child-runs",
                               "child-classes"}
    # The chart's one policy of its own: no runs in its namespace (the plain manifests know no namespace).
    placement = {(kind, "workerrun-placement") for kind in ("ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")}
    assert placement <= set(chart)
    chart = {key: doc for key, doc in chart.items() if key not in placement}
    assert set(chart) == set(plain) == {(kind, n) for n in names for kind in
                                        ("ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")}
    for (kind, name), doc in chart.items():
        spec = dict(doc["spec"])
        if kind == "ValidatingAdmissionPolicyBinding":
            assert spec.pop("policyName") == f"rel-tether-{name}"
            assert spec == {k: v for k, v in plain[kind, name]["spec"].items() if k != "policyName"}
            continue
        if name not in WORKER_POLICIES:
            assert spec == plain[kind, name]["spec"]
            continue
        # The chart adds one thing: its own operator is exempt by name (with or without rbac.create).
        own, *conditions = spec.pop("matchConditions")
        assert own == {"name": "not-the-operator",
                       "expression": "request.userInfo.username != 'system:serviceaccount:tether-system:rel-tether'"}
        assert conditions == plain[kind, name]["spec"]["matchConditions"]
        assert spec == {k: v for k, v in plain[kind, name]["spec"].items() if k != "matchConditions"}
    # The plain policies exempt the operator by the `fence` verb, which the chart's role grants.
    role = next(d for d in render(tools_dir) if d["kind"] == "ClusterRole" and d["metadata"]["name"] == "rel-tether")
    assert any("workerruns" in r["resources"] and "fence" in r["verbs"] for r in role["rules"])


def test_runs_in_the_operator_namespace_only_when_asked(tools_dir: Path) -> None:
    def placement(*values: str) -> list[dict]:
        return [d for d in render(tools_dir, *values) if d["metadata"]["name"] == "rel-tether-workerrun-placement"]

    policy, _binding = placement()
    assert policy["spec"]["matchConstraints"]["namespaceSelector"] == {
        "matchLabels": {"kubernetes.io/metadata.name": "tether-system"}}
    assert placement("admissionPolicy.allowRunsInOperatorNamespace=true") == []


def test_helm_template_works_without_kube_version_with_the_helm_the_project_builds(tools_dir: Path) -> None:
    """Unstamped, helm assumes Kubernetes 1.20, which the chart's kubeVersion refuses: the build
    stamps the version of the client-go helm is built with, as helm's own release does."""
    result = helm(tools_dir, "template", "rel", str(CHART), "--namespace", "tether-system")
    assert result.returncode == 0, result.stderr
    assert "kind: Deployment" in result.stdout


def test_admission_policies_can_be_turned_off(tools_dir: Path) -> None:
    kinds = [d["kind"] for d in render(tools_dir, "admissionPolicy.enabled=false")]
    assert "ValidatingAdmissionPolicy" not in kinds and "ValidatingAdmissionPolicyBinding" not in kinds
    result = helm(tools_dir, "template", "rel", str(CHART), "--kube-version", "1.36.3",
                  "--set", "admissionPolicy.enabled=yes")
    assert result.returncode != 0 and "admissionPolicy" in result.stderr


def test_values_schema_rejects_unknown_and_wrong_values(tools_dir: Path) -> None:
    result = helm(tools_dir, "template", "rel", str(CHART), "--kube-version", "1.36.3", "--set", "replicas=2")
    assert result.returncode != 0 and "replicas" in result.stderr
    result = helm(tools_dir, "template", "rel", str(CHART), "--kube-version", "1.36.3", "--set", "replicaCount=0")
    assert result.returncode != 0 and "replicaCount" in result.stderr


def test_values_schema_refuses_what_kubernetes_would(tools_dir: Path) -> None:
    """Refused at `helm template`/`helm install`, naming the value, not later by the API server."""
    for value, path in (("resources.limits.memory=lots", "/resources/limits/memory"),
                        ("resources.requests.cpu=-1", "/resources/requests/cpu"),
                        ("tolerations[0].operator=Maybe", "/tolerations/0/operator"),
                        ("affinity.nodeAfinity.x=y", "/affinity"),
                        ("podSecurityContext.runAsUser=root", "/podSecurityContext/runAsUser"),
                        ("securityContext.privilegd=true", "/securityContext"),
                        ("topologySpreadConstraints[0].maxSkew=1", "/topologySpreadConstraints/0")):
        result = helm(tools_dir, "template", "rel", str(CHART), "--kube-version", "1.36.3", "--set", value)
        assert result.returncode != 0 and f"at '{path}'" in result.stderr, (value, result.stderr)
    render(tools_dir, "resources.limits.memory=1Gi", "resources.requests.cpu=0.5", "resources.limits.hugepages-2Mi=2Mi")


def test_operator_values_render_where_expected(tools_dir: Path) -> None:
    def pod(*sets: str) -> dict:
        return next(d for d in render(tools_dir, *sets) if d["kind"] == "Deployment")["spec"]["template"]["spec"]

    default = pod()
    assert "priorityClassName" not in default and "topologySpreadConstraints" not in default
    assert default["securityContext"] == {"runAsNonRoot": True, "runAsUser": 65532, "runAsGroup": 65532,
                                          "seccompProfile": {"type": "RuntimeDefault"}}
    spread = "topologySpreadConstraints[0]."
    tuned = pod("priorityClassName=system-cluster-critical", "extraArgs={--verbose,--x=a b}",
                "extraEnv[0].name=HTTPS_PROXY", "extraEnv[0].value=http://proxy:3128",
                "podSecurityContext.fsGroup=2000", "podSecurityContext.runAsUser=1001",
                "securityContext.readOnlyRootFilesystem=false",
                f"{spread}maxSkew=1", f"{spread}topologyKey=topology.kubernetes.io/zone",
                f"{spread}whenUnsatisfiable=ScheduleAnyway", f"{spread}labelSelector.matchLabels.app=tether")
    container = tuned["containers"][0]
    assert tuned["priorityClassName"] == "system-cluster-critical"
    assert container["command"][-2:] == ["--verbose", "--x=a b"]
    assert container["env"][-1] == {"name": "HTTPS_PROXY", "value": "http://proxy:3128"}
    assert tuned["securityContext"]["fsGroup"] == 2000 and tuned["securityContext"]["runAsUser"] == 1001
    assert tuned["securityContext"]["runAsNonRoot"] is True  # the rest of the default stays
    assert container["securityContext"]["readOnlyRootFilesystem"] is False
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert tuned["topologySpreadConstraints"] == [{"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone",
                                                   "whenUnsatisfiable": "ScheduleAnyway",
                                                   "labelSelector": {"matchLabels": {"app": "tether"}}}]


def test_every_value_is_commented() -> None:
    lines = (CHART / "values.yaml").read_text().splitlines()
    for i, line in enumerate(lines):
        stripped = line.strip()
        if not stripped or stripped.startswith("#") or stripped.endswith(":"):
            continue  # comments and section headers
        above = lines[i - 1].strip()
        assert above.startswith("#"), f"values.yaml line {i + 1} has no comment: {line}"


@pytest.fixture
def dev_cluster(bin_dir: Path, tmp_path: Path) -> Iterator[Kube]:
    """A fresh cluster set up as `tether dev cluster` (`make cluster`) sets it up: CRDs and policies
    pre-installed. Not the shared one: installing and uninstalling release `tether` replaces and then
    removes the `tether-*` policies every other test there relies on."""
    from tether.devcluster.controlplane import LocalCluster
    from tether.devcluster.crds import install_crds, install_policies

    with LocalCluster(bin_dir=bin_dir, state_dir=tmp_path / "cluster") as cluster:
        with cluster.client() as client:
            install_crds(client)
            install_policies(client)
        yield Kube(str(cluster.kubeconfig))


def _host_ports(pod: dict) -> dict[int, int]:
    ports = json.loads(pod["metadata"].get("annotations", {}).get(HOST_PORTS_ANNOTATION, "{}"))
    return {int(k): v for k, v in ports.items()}


def _healthy(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_readme_install_with_defaults_on_the_dev_cluster(dev_cluster: Kube, tools_dir: Path) -> None:
    """The README's path: `make cluster`, then `helm install tether charts/tether` with defaults."""
    kube, ns = dev_cluster, "tether-system"
    kubeconfig = ["--kubeconfig", kube.kubeconfig_path]
    install = helm(tools_dir, "install", "tether", str(CHART), "--namespace", ns, "--create-namespace",
                   "--wait", "--timeout", "180s", *kubeconfig)
    assert install.returncode == 0, install.stderr
    assert "runs pods as local processes" in install.stdout  # NOTES.txt found the process kubelet's node
    # The pre-installed policies were adopted: the chart's versions, exempting its operator by name.
    policy = kube.ok(kube.get(f"{ADMISSION}/validatingadmissionpolicies/tether-worker-status-fencing"))
    assert policy["metadata"]["annotations"]["meta.helm.sh/release-name"] == "tether"
    assert policy["spec"]["matchConditions"][0]["name"] == "not-the-operator"
    # Both replicas run with the default ports: each process-kubelet pod got host ports of its own.
    selector = {"labelSelector": "app.kubernetes.io/instance=tether"}
    pods = kube.ok(kube.get(f"/api/v1/namespaces/{ns}/pods", params=selector))["items"]
    assert len(pods) == 2
    health = [_host_ports(p)[8081] for p in pods]
    assert len(set(health)) == 2 and len({_host_ports(p)[8080] for p in pods}) == 2
    eventually(lambda: all(_healthy(port) for port in health), timeout=90, what="both replicas' /healthz")
    eventually(lambda: kube.get(f"{LEASES}/tether-operator-leader").status_code == 200, timeout=60, what="a leader")
    pods = kube.ok(kube.get(f"/api/v1/namespaces/{ns}/pods", params=selector))["items"]
    restarts = {p["metadata"]["name"]: p["status"]["containerStatuses"][0]["restartCount"] for p in pods}
    # `kubectl logs`: the API server reaches the process kubelet's containerLogs (it failed to dial 10250).
    # A replica serves /healthz before its first line names it (the server check, then the election's
    # "waiting for leadership"): each log is read until it does.
    def logs_naming_their_pods() -> dict[str, httpx.Response] | None:
        logs = {name: kube.get(f"/api/v1/namespaces/{ns}/pods/{name}/log") for name in restarts}
        return logs if all(r.status_code == 200 and name in r.text for name, r in logs.items()) else None

    assert set(restarts.values()) == {0}, (restarts, {name: kube.get(f"/api/v1/namespaces/{ns}/pods/{name}/log").text[-600:]
                                                   for name in restarts})
    logs = eventually(logs_naming_their_pods, timeout=60, what="each replica's log (kubectl logs) naming its pod")
    last = kube.get(f"/api/v1/namespaces/{ns}/pods/{next(iter(logs))}/log", params={"tailLines": "1"})
    assert last.status_code == 200 and len(last.text.splitlines()) == 1
    # No runs in the operator's own namespace: refused by the API server, saying why and what to do.
    # An admission policy is in force once the API server has compiled it, a moment after it exists
    # (seconds on a loaded machine): probed with a dry run, as a user's first apply could meet that moment.
    eventually(lambda: kube.post(Kube.wr_path(ns), runs.example("short-job.yaml"), params={"dryRun": "All"}).status_code == 403,
               timeout=60, what="the chart's placement policy in force")
    refused = kube.post(Kube.wr_path(ns), runs.example("short-job.yaml"))
    assert refused.status_code == 403 and "the Tether operator's own namespace" in refused.text, refused.text
    # The chart's operator runs a first run to the end under the adopted policies.
    kube.ok(kube.post("/api/v1/namespaces", {"metadata": {"name": "first-run"}}))
    eventually(lambda: kube.get("/api/v1/namespaces/first-run/serviceaccounts/default").status_code == 200,
               timeout=60, what="the default service account")
    runs.create(kube, "first-run", runs.example("short-job.yaml", payload={"steps": 2, "stepSeconds": 0.2}))
    assert runs.wait_phase(kube, "first-run", "short-job", ("Succeeded", "Failed"), timeout=120)["status"]["phase"] == "Succeeded"
    kube.ok(kube.delete(Kube.wr_path("first-run", "short-job")))
    eventually(lambda: kube.get(Kube.wr_path("first-run", "short-job")).status_code == 404, timeout=60,
               what="the run deleted (its finalizer released by the operator)")
    lease = kube.ok(kube.get(f"{LEASES}/tether-operator-leader"))
    account = kube.ok(kube.get(f"/api/v1/namespaces/{ns}/serviceaccounts/tether"))
    assert [(o["kind"], o["uid"]) for o in lease["metadata"]["ownerReferences"]] == [("ServiceAccount", account["metadata"]["uid"])]
    uninstall = helm(tools_dir, "uninstall", "tether", "--namespace", ns, "--wait", "--timeout", "60s", *kubeconfig)
    assert uninstall.returncode == 0, uninstall.stderr
    # Nothing left naming a deleted pod: the leader Lease goes with the chart's ServiceAccount, so an
    # immediate reinstall leads at once (docs/install.md "Uninstall" lists what stays).
    eventually(lambda: kube.get(f"{LEASES}/tether-operator-leader").status_code == 404, timeout=60,
               what="the leader Lease collected after helm uninstall")
