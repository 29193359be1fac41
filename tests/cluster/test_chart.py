"""The Helm chart: lint, render, schema, and CRDs identical to crds/."""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "tether"


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
    docs = {d["kind"]: d for d in render(tools_dir, "watchNamespaces={team-a,team-b}")}
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


# Policies for workers, from which the operator is exempt; the approval policy exempts nobody.
WORKER_POLICIES = {"worker-status-fencing", "worker-lease-fencing", "namespace-worker-scope"}


def test_admission_policies_match_the_plain_manifests(tools_dir: Path) -> None:
    plain = _plain_policies()
    chart = {(d["kind"], d["metadata"]["name"].removeprefix("rel-tether-")): d for d in render(tools_dir)
             if d["kind"].startswith("ValidatingAdmissionPolicy")}
    names = WORKER_POLICIES | {"approval-approver"}
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
    role = next(d for d in render(tools_dir) if d["kind"] == "ClusterRole")
    assert any("workerruns" in r["resources"] and "fence" in r["verbs"] for r in role["rules"])


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


def test_every_value_is_commented() -> None:
    lines = (CHART / "values.yaml").read_text().splitlines()
    for i, line in enumerate(lines):
        stripped = line.strip()
        if not stripped or stripped.startswith("#") or stripped.endswith(":"):
            continue  # comments and section headers
        above = lines[i - 1].strip()
        assert above.startswith("#"), f"values.yaml line {i + 1} has no comment: {line}"
