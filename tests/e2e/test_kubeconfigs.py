"""Any kubeconfig kubectl accepts, for the plugin, the console and the SDK's out-of-cluster path:
an exec credential plugin (testkit/exec_credential.py prints ServiceAccount tokens of the test
cluster, as EKS's or GKE's plugin prints theirs), one whose credential expires or is revoked while
a command runs, KUBECONFIG naming two files, --context, and impersonation. Judged by what the API
server recorded (the approvals' approver, the audit log's credential IDs), not by Tether's view."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.cluster.test_approvals import APPROVALS
from tests.conftest import pod_log
from tests.e2e.test_review import _gated
from testkit import runs
from testkit.audit import AuditLog
from testkit.kube import Kube, eventually
from testkit.scenario import app_run
from tests.support.users import console_user
from tether.kube import config as kubeconfig
from tether.worker.run import load_payload

EXEC_PLUGIN = Path(__file__).resolve().parents[2] / "testkit" / "exec_credential.py"
CREDENTIAL_ID = "authentication.kubernetes.io/credential-id"


def exec_kubeconfig(kube: Kube, ns: str, sa: str, folder: Path, bind: str = "secret", expires_in: float = 3600,
                    current: str = "broken") -> tuple[str, Path]:
    """KUBECONFIG naming two files, as a laptop's often does: the users and contexts in one (the
    exec plugin's user in context `exec`, and a current context `broken` whose token is worthless),
    the cluster in the other. Returns the KUBECONFIG value and the plugin's log."""
    folder.mkdir(parents=True, exist_ok=True)
    log = folder / "credentials.jsonl"
    admin = yaml.safe_load(Path(kube.kubeconfig_path).read_text())
    exec_user = {"exec": {"apiVersion": "client.authentication.k8s.io/v1", "command": sys.executable,
                          "args": [str(EXEC_PLUGIN)], "interactiveMode": "Never", "env": [
                              {"name": "EXEC_ADMIN_KUBECONFIG", "value": str(kube.kubeconfig_path)},
                              {"name": "EXEC_NAMESPACE", "value": ns}, {"name": "EXEC_SERVICE_ACCOUNT", "value": sa},
                              {"name": "EXEC_BIND", "value": bind}, {"name": "EXEC_EXPIRES_IN", "value": str(expires_in)},
                              {"name": "EXEC_LOG", "value": str(log)}]}}
    users = folder / "users.kubeconfig"
    users.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": current,
        "users": [{"name": "exec-user", "user": exec_user}, {"name": "nobody", "user": {"token": "worthless"}}],
        "contexts": [{"name": "exec", "context": {"cluster": "test", "user": "exec-user", "namespace": ns}},
                     {"name": "broken", "context": {"cluster": "test", "user": "nobody", "namespace": ns}}]}))
    clusters = folder / "clusters.kubeconfig"
    clusters.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "Config", "current-context": "exec",
                                        "clusters": [{"name": "test", "cluster": admin["clusters"][0]["cluster"]}]}))
    return f"{users}{os.pathsep}{clusters}", log


def credentials(log: Path) -> list[dict[str, Any]]:
    import json

    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def _env(kubeconfig_value: str) -> dict[str, str]:
    return {**os.environ, "KUBECONFIG": kubeconfig_value,
            "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}


def _kubectl(bin_dir: Path, kubeconfig_value: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(bin_dir / "kubectl"), *args], capture_output=True, text=True,
                          env=_env(kubeconfig_value), timeout=120)


def _revoked(kube: Kube, ns: str, credential: dict[str, Any]) -> None:
    """Deletes the Secret the credential's token is bound to, and waits until the API server refuses it."""
    kube.delete(f"/api/v1/namespaces/{ns}/secrets/{credential['secret']}")
    server = kube.config.server
    eventually(lambda: httpx.get(f"{server}/api", headers={"Authorization": f"Bearer {credential['token']}"},
                                 verify=False, timeout=5).status_code == 401,
               timeout=30, what="the revoked token refused")


def test_kubectl_tether_approve_with_an_exec_plugin_two_files_and_a_context(  # type: ignore[no-untyped-def]
        kube: Kube, namespace: str, operator, bin_dir: Path, tmp_path: Path) -> None:
    alice, _, _ = console_user(kube, namespace, tmp_path)
    config_value, log = exec_kubeconfig(kube, namespace, "alice", tmp_path / "kubeconfig")
    for name in ("by-plugin", "by-impersonation"):
        runs.create(kube, namespace, _gated(), name=name)
        runs.wait_phase(kube, namespace, name, "AwaitingApproval", timeout=30)

    listed = _kubectl(bin_dir, config_value, "get", "wr", "--context", "exec")  # kubectl itself takes this kubeconfig
    assert listed.returncode == 0 and "by-plugin" in listed.stdout, listed
    done = _kubectl(bin_dir, config_value, "tether", "--context", "exec", "approve", "by-plugin", "--reason", "fine")
    assert done.returncode == 0 and f"Approve Start (attempt 0) of by-plugin" in done.stdout, done
    assert f"by {alice}" in done.stdout, done
    assert credentials(log), "the exec plugin never ran"

    # kubectl's errors, kubectl's words: the current context's user is refused, alice may not impersonate.
    unauthorized = _kubectl(bin_dir, config_value, "tether", "status", "by-plugin")
    assert (unauthorized.returncode, unauthorized.stderr) == (1, "error: You must be logged in to the server (Unauthorized)\n"), unauthorized
    forbidden = _kubectl(bin_dir, config_value, "tether", "status", "by-plugin", "--context", "exec", "--as", "bob")
    # (Kubernetes 1.36 words it "cannot impersonate-on:user-info:get resource ...", older ones "cannot impersonate")
    assert forbidden.returncode == 1 and forbidden.stderr.startswith("Error from server (Forbidden): ") \
        and f'User "{alice}" cannot impersonate' in forbidden.stderr, forbidden.stderr
    assert "Traceback" not in unauthorized.stderr + forbidden.stderr

    # Impersonation: the admin acting as alice records alice's decision (the API server says who).
    as_alice = _kubectl(bin_dir, str(kube.kubeconfig_path), "tether", "approve", "by-impersonation", "-n", namespace,
                        "--as", alice, "--as-group", "system:serviceaccounts", "--reason", "as alice")
    assert as_alice.returncode == 0 and f"by {alice}" in as_alice.stdout, as_alice
    approvals = kube.ok(kube.get(APPROVALS.format(ns=namespace)))["items"]
    assert sorted((a["spec"]["runRef"]["name"], a["spec"]["approver"]) for a in approvals) == [
        ("by-impersonation", alice), ("by-plugin", alice)]
    for name in ("by-plugin", "by-impersonation"):
        assert runs.wait_phase(kube, namespace, name, ("Succeeded", "Failed"), timeout=60)["status"]["phase"] == "Succeeded"


@contextlib.contextmanager
def _console(kubeconfig_value: str, *flags: str) -> Iterator[httpx.Client]:
    """`kubectl tether ui FLAGS` with KUBECONFIG=`kubeconfig_value`, signed in: a client of its pages.
    Its host name (tether-….localhost) is a browser's to resolve: here 127.0.0.1, with that Host."""
    plugin = Path(sys.executable).parent / "kubectl-tether"
    proc = subprocess.Popen([str(plugin), "ui", "--no-open", *flags], env=_env(kubeconfig_value),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = httpx.URL([proc.stdout.readline() for _ in range(2)][1].strip())  # type: ignore[union-attr]
        with httpx.Client(base_url=f"http://127.0.0.1:{url.port}", timeout=30,
                          headers={"Host": f"{url.host}:{url.port}"}) as browser:
            signed_in = browser.get("/", params=dict(url.params))
            assert signed_in.status_code == 303, signed_in.text
            browser.headers["Cookie"] = signed_in.headers["set-cookie"].split(";")[0]
            yield browser
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        print("--- kubectl tether ui stderr ---", proc.stderr.read() if proc.stderr else "")  # type: ignore[union-attr]


@pytest.mark.local_cluster  # the container log comes from the process kubelet
def test_the_console_goes_on_when_its_credential_expires_and_the_old_one_is_revoked(  # type: ignore[no-untyped-def]
        kube: Kube, namespace: str, operator, tmp_path: Path) -> None:
    console_user(kube, namespace, tmp_path)
    config_value, log = exec_kubeconfig(kube, namespace, "alice", tmp_path / "kubeconfig", expires_in=4)
    runs.create(kube, namespace, app_run("held", {"holdAttempts": [1], "holdSeconds": 600}))
    runs.wait_phase(kube, namespace, "held", "Running", timeout=60)
    with _console(config_value, "--context", "exec") as browser:
        logs = browser.get(f"/api/runs/{namespace}/held/logs")
        assert logs.status_code == 200, logs.text
        first = credentials(log)[-1]
        # The first credential said it expires in 4 s; it is also revoked, so only a fresh one works.
        said = time.monotonic() + 4
        _revoked(kube, namespace, first)
        eventually(lambda: time.monotonic() > said, timeout=10, what="the credential's stated expiry")
        again = browser.get(f"/api/runs/{namespace}/held/logs")
        assert again.status_code == 200, again.text
    given = credentials(log)
    # The API server refused the first token before the second read: that read used a fresh credential.
    assert len(given) >= 2 and given[-1]["jti"] != first["jti"], given


def test_the_console_acts_as_the_user_it_impersonates(  # type: ignore[no-untyped-def]
        kube: Kube, namespace: str, operator, tmp_path: Path) -> None:
    """The admin's kubeconfig with --as alice: the console is alice's (the API server names her in
    the page's header, through its SelfSubjectReview, and records her decision as hers)."""
    alice, _, _ = console_user(kube, namespace, tmp_path)
    runs.create(kube, namespace, _gated(), name="gated")
    runs.wait_phase(kube, namespace, "gated", "AwaitingApproval", timeout=30)
    with _console(str(kube.kubeconfig_path), "-n", namespace, "--as", alice) as browser:
        page = browser.get("/")
        assert page.status_code == 200 and f"{alice} · namespace {namespace}" in page.text, page.text[:2000]
        # Her decision from the console: the API server records alice as the approver (it admits no other).
        uid = runs.get(kube, namespace, "gated")["metadata"]["uid"]
        decided = browser.post(f"/api/runs/{namespace}/gated/decide", headers={"X-Tether-Console": "1"},
                               json={"uid": uid, "gate": "Start", "attempt": 0, "decision": "Approve", "reason": "ok"})
        assert decided.status_code == 200 and f"by {alice}" in decided.json()["message"], decided.text
    approvals = kube.ok(kube.get(APPROVALS.format(ns=namespace)))["items"]
    assert [a["spec"]["approver"] for a in approvals] == [alice]
    seen = [r for r in AuditLog.from_env().read() if r.impersonated is not None and r.impersonated.username == alice
            and r.object_ref is not None and r.object_ref.resource == "workerruns" and r.object_ref.namespace == namespace]
    assert seen and all(r.user.username == kube.username() for r in seen), seen[:3]


@pytest.mark.local_cluster  # the worker runs on the process kubelet, with the kubeconfig given in its env
def test_a_worker_renews_through_an_exec_plugin_whose_credential_expires_every_few_seconds(  # type: ignore[no-untyped-def]
        kube: Kube, namespace: str, operator, tmp_path: Path) -> None:
    """The SDK out of a cluster: KUBECONFIG of two files whose user is an exec plugin giving
    pod-bound tokens that say they expire after 5 s. The worker holds for 20 s, renewing every
    second, and succeeds in its first attempt: its renewals went on across every expiry, with
    fresh credentials (the audit log names each renewal's credential)."""
    config_value, log = exec_kubeconfig(kube, namespace, "(the pod's)", tmp_path / "kubeconfig", bind="pod",
                                        expires_in=5, current="exec")
    body = app_run("renewing", {"holdAttempts": [1], "holdSeconds": 20}, duration=8, renew=1,
                   env=[{"name": "KUBECONFIG", "value": config_value}])
    runs.create(kube, namespace, body)
    done = runs.wait_phase(kube, namespace, "renewing", ("Succeeded", "Failed"), timeout=120)
    assert done["status"]["phase"] == "Succeeded" and len(done["status"]["attempts"]) == 1, \
        (done["status"], [l for l in pod_log(namespace, "renewing-a1").splitlines() if "exec" in l][:3])
    given = {f"JTI={c['jti']}" for c in credentials(log)}
    renewals = [r for r in AuditLog.from_env().read() if r.object_ref is not None and r.object_ref.resource == "leases"
                and r.object_ref.namespace == namespace and r.verb in ("update", "patch") and r.code == 200
                and r.user.pod == "renewing-a1"]
    used = [r.user.extra.get(CREDENTIAL_ID, ("",))[0] for r in renewals]
    assert len(renewals) >= 10 and set(used) <= given, (used, given)
    assert len(set(used)) >= 3, used  # 20 s of renewals with credentials that expire every 5 s


def test_the_sdk_out_of_a_cluster_takes_impersonation_and_refreshes_after_a_401(  # type: ignore[no-untyped-def]
        kube: Kube, namespace: str, operator, tmp_path: Path) -> None:
    alice, _, _ = console_user(kube, namespace, tmp_path)
    runs.create(kube, namespace, app_run("payload", {"note": "read back"}))
    env = {"TETHER_RUN": "payload", "TETHER_NAMESPACE": namespace, "TETHER_PAYLOAD_FROM": "spec.payload"}
    # Impersonation: the admin's kubeconfig acting as alice reads the payload; as nobody, it is refused.
    as_alice = kubeconfig.load(flags=kubeconfig.Flags(kubeconfig=str(kube.kubeconfig_path), impersonate=alice))
    assert load_payload(env, kube=as_alice)["note"] == "read back"
    seen, admin = AuditLog.from_env().read(), kube.username()
    assert any(r.user.username == admin and r.impersonated is not None and r.impersonated.username == alice for r in seen
               if r.object_ref is not None and r.object_ref.name == "payload" and r.verb == "get"), "not impersonated"
    as_nobody = kubeconfig.load(flags=kubeconfig.Flags(kubeconfig=str(kube.kubeconfig_path), impersonate="nobody"))
    with pytest.raises(Exception, match="403|forbidden"):
        load_payload(env, kube=as_nobody, attempts=1)
    # An exec credential revoked under a running client: the 401 runs the plugin again, once.
    config_value, log = exec_kubeconfig(kube, namespace, "alice", tmp_path / "kubeconfig", current="exec")
    cfg = kubeconfig.load(flags=kubeconfig.Flags(kubeconfig=config_value))
    with cfg.sync_client() as client:
        assert client.get(f"/apis/tether.dev/v1alpha1/namespaces/{namespace}/workerruns/payload").status_code == 200
        (first,) = credentials(log)
        _revoked(kube, namespace, first)
        assert client.get(f"/apis/tether.dev/v1alpha1/namespaces/{namespace}/workerruns/payload").status_code == 200
    assert [c["number"] for c in credentials(log)] == [0, 1]
