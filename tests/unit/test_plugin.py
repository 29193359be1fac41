"""kubectl-tether's commands, driven through main() against a fake API server."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from tether import plugin, release_finalizers
from tether.devcluster import demo

pytestmark = pytest.mark.unit


class _FakeConfig:
    """Stands in for a kubeconfig: every client talks to `handler` instead of a server."""

    namespace = "default"

    def __init__(self, handler: Any) -> None:
        self.transport = httpx.MockTransport(handler)

    def async_client(self, **_: Any) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url="https://api.test", transport=self.transport)

    def sync_client(self, **_: Any) -> httpx.Client:
        return httpx.Client(base_url="https://api.test", transport=self.transport)


@pytest.mark.parametrize(("command", "said", "spec"), [
    ("stop", "stopped", {"stop": True}),
    ("suspend", "suspended", {"suspend": True}),
    ("resume", "resumed", {"suspend": False}),
])
def test_control_commands_say_what_they_did(command: str, said: str, spec: dict[str, bool],
                                            monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    patches: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        patches.append(json.loads(request.content))
        return httpx.Response(200, json={})

    monkeypatch.setattr(plugin.kubeconfig, "load", lambda flags: _FakeConfig(handler))
    assert plugin.main([command, "job", "-n", "ns"]) == 0
    assert capsys.readouterr().out == f"workerrun.tether.dev/job {said}\n"
    assert patches == [{"spec": spec}]


FORBIDDEN = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Forbidden", "code": 403,
             "message": 'workerruns.tether.dev "job" is forbidden: User "system:anonymous" cannot get resource'}


@pytest.mark.parametrize("argv", [["status", "job"], ["stop", "job"], ["approve", "job", "--reason", "ok"],
                                  ["deny", "job", "--reason", "no"]])
def test_a_refusal_reads_like_kubectls_never_a_traceback(argv: list[str], monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(plugin.kubeconfig, "load", lambda flags: _FakeConfig(lambda r: httpx.Response(403, json=FORBIDDEN)))
    assert plugin.main(argv) == 1
    err = capsys.readouterr().err
    assert err == f"Error from server (Forbidden): {FORBIDDEN['message']}\n", err


def test_an_unreachable_server_and_a_bad_kubeconfig_read_like_kubectls(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def unreachable(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    monkeypatch.setattr(plugin.kubeconfig, "load", lambda flags: _FakeConfig(unreachable))
    assert plugin.main(["status", "job"]) == 1
    assert capsys.readouterr().err == "Unable to connect to the server: connection refused\n"
    monkeypatch.undo()
    (tmp_path / "kubeconfig").write_text("clusters: []\ncontexts: []\nusers: []\ncurrent-context: gone\n")
    assert plugin.main(["--kubeconfig", str(tmp_path / "kubeconfig"), "status", "job"]) == 1
    assert capsys.readouterr().err == 'error: context "gone" does not exist\n'
    assert plugin.main(["status", "job", "--request-timeout", "soon"]) == 1
    assert "invalid request timeout 'soon'" in capsys.readouterr().err


def test_kubectls_flags_go_before_or_after_the_command(monkeypatch: pytest.MonkeyPatch) -> None:
    given: list[Any] = []
    monkeypatch.setattr(plugin.kubeconfig, "load", lambda flags: given.append(flags) or _FakeConfig(
        lambda r: httpx.Response(200, json={})))
    plugin.main(["--context", "other", "--as", "carol", "--as-group", "a", "--as-group", "b", "stop", "job",
                 "--cluster", "c", "--user", "u", "-n", "ns", "--request-timeout", "1m", "--kubeconfig", "/k"])
    assert given == [plugin.kubeconfig.Flags(kubeconfig="/k", context="other", cluster="c", user="u", namespace="ns",
                                             impersonate="carol", impersonate_groups=("a", "b"), request_timeout=60.0)]


def test_demo_offers_kubectl_only_while_its_cluster_stays() -> None:
    kubeconfig, bin_dir = Path("/r/.tether/demo/kubeconfig"), Path("/cache/bin")
    kept = "\n".join(demo.ending(kubeconfig, bin_dir, keep=True))
    assert f"export KUBECONFIG={kubeconfig}" in kept and "Ctrl-C" in kept
    gone = "\n".join(demo.ending(kubeconfig, bin_dir, keep=False))
    assert "KUBECONFIG" not in gone and str(kubeconfig.parent) not in gone
    assert "make demo" in gone  # how to get a cluster that stays


def test_demo_says_which_example_it_shortened() -> None:
    """It said `applied examples/long-job.yaml` and ran 12 one-second steps, not the file's 60 of 2 s."""
    root = Path(__file__).resolve().parents[2]
    said = {line.split(",")[0].removeprefix("==> applied examples/"): (body, line) for body, line in demo.examples(root)}
    body, line = said["long-job.yaml"]
    assert body["spec"]["payload"] == {"steps": 12, "stepSeconds": 1}
    assert line == ('==> applied examples/long-job.yaml, shortened for the demo: payload {"steps": 12, '
                    '"stepSeconds": 1} (the file says {"steps": 60, "stepSeconds": 2})')
    assert said["short-job.yaml"][1] == "==> applied examples/short-job.yaml"


def test_a_leader_lease_is_a_sign_of_life_only_while_held_and_fresh() -> None:
    now = dt.datetime(2026, 1, 1, 12, 0, 0, tzinfo=dt.timezone.utc)

    def lease(holder: str, renewed_ago: float) -> dict[str, Any]:
        stamp = (now - dt.timedelta(seconds=renewed_ago)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        return {"spec": {"holderIdentity": holder, "renewTime": stamp, "leaseDurationSeconds": 15}}

    assert release_finalizers.lease_alive(lease("op_1", 3), now)
    assert release_finalizers.lease_alive(lease("op_1", 18), now)  # within the skew allowance
    assert not release_finalizers.lease_alive(lease("op_1", 60), now)
    assert not release_finalizers.lease_alive(lease("", 1), now)  # released on a clean stop (ReleaseOnCancel)


NOW = dt.datetime(2026, 12, 6, 12, tzinfo=dt.timezone.utc)


def _run(status: dict[str, Any]) -> dict[str, Any]:
    return {"metadata": {"namespace": "ns", "name": "job"}, "status": status}


def test_status_claims_no_liveness_for_a_lease_nobody_holds_or_renewed() -> None:
    """A finished run's Lease is released: it said `renewed - ago`; one granted but never renewed
    (a refused pod) is not a live worker either."""
    released = {"spec": {"holderIdentity": None, "leaseTransitions": 3, "leaseDurationSeconds": 90}}
    lines = plugin.status_lines(_run({"phase": "Succeeded", "attempt": 1, "fence": 3}), released, NOW)
    assert "  lease: holder -  fence 3  not held  duration 90s" in lines
    granted = {"spec": {"holderIdentity": "job-a1", "leaseTransitions": 1, "leaseDurationSeconds": 90}}
    assert any("never renewed" in line for line in plugin.status_lines(_run({"phase": "Starting"}), granted, NOW))
    held = {"spec": {"holderIdentity": "job-a1", "leaseTransitions": 1, "leaseDurationSeconds": 90,
                     "renewTime": (NOW - dt.timedelta(seconds=4)).isoformat()}}
    assert any("renewed 4.0s ago (worker clock)" in line for line in plugin.status_lines(_run({}), held, NOW))
    assert not any(" - ago" in line for line in plugin.status_lines(_run({}), released, NOW))


REFUSED = 'the API server refused pod job-a1: Pod "job-a1" is invalid: spec.containers: Required value'


def _cond(type_: str, status: str, reason: str, message: str) -> dict[str, Any]:
    return {"type": type_, "status": status, "reason": reason, "message": message}


def test_status_leads_with_a_refused_pod_and_its_message() -> None:
    """Issue 34: the run said `Starting` and only a condition at the bottom told why."""
    status = {"phase": "Backoff", "attempt": 1, "fence": 2,
              "attempts": [{"attempt": 1, "fence": 1, "holder": "job-a1", "outcome": "PodRefused",
                            "startedAt": "2026-12-06T11:59:50Z", "endedAt": "2026-12-06T11:59:50Z"}],
              "conditions": [_cond("Ready", "False", "PodRefused", f"attempt 2 in 10s after PodRefused: {REFUSED}"),
                             _cond("Stalled", "False", "PodRefused", "")]}
    lines = plugin.status_lines(_run(status), None, NOW)
    assert lines[:2] == ["ns/job: Backoff (PodRefused)  attempt 1  fence 2  holder -",
                         f"  PodRefused: attempt 2 in 10s after PodRefused: {REFUSED}"]
    failed = {"phase": "Failed", "conditions": [_cond("Ready", "False", "PodRefused", f"2 of 2 attempts used; {REFUSED}")]}
    assert plugin.status_lines(_run(failed), None, NOW)[1] == f"  PodRefused: 2 of 2 attempts used; {REFUSED}"
    # A phase that says it all gets no second line.
    running = {"phase": "Running", "conditions": [_cond("Ready", "False", "Running", "job-a1 renewed its lease")]}
    assert plugin.status_lines(_run(running), None, NOW)[1].startswith("  ATTEMPT")


def test_a_grant_is_no_renewal() -> None:
    """The grant writes renewTime (as its acquireTime): a worker whose pod never started did not renew."""
    granted_at = (NOW - dt.timedelta(seconds=103)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    lease = {"spec": {"holderIdentity": "job-a1", "leaseTransitions": 1, "leaseDurationSeconds": 90,
                      "acquireTime": granted_at, "renewTime": granted_at}}
    lines = plugin.status_lines(_run({"phase": "Starting"}), lease, NOW)
    assert "  lease: holder job-a1  fence 1  never renewed (granted 103.0s ago)  duration 90s" in lines, lines
    assert not any("renewed 103" in line for line in lines)


def test_status_shows_what_waits_for_a_person_and_the_result() -> None:
    status = {"phase": "AwaitingReview", "attempt": 2, "result": {"rows": 12},
              "review": {"requests": [
                  {"gate": "Start", "attempt": 0, "decision": "Approve"},
                  {"gate": "deploy", "attempt": 2, "details": "push v2 to prod", "deadline": "2026-12-06T13:00:00Z"}]}}
    lines = plugin.status_lines(_run(status), None, NOW)
    assert "  pending: gate deploy (attempt 2)  decide by 2026-12-06T13:00:00Z: push v2 to prod" in lines
    assert not any("gate Start" in line for line in lines)  # decided
    assert '  result: {"rows": 12}' in lines


@pytest.mark.parametrize("command", ["approve", "deny"])
def test_a_decision_needs_a_reason(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    for argv in ([command, "job"], [command, "job", "--reason", "  "]):
        with pytest.raises(SystemExit) as exit_:
            plugin.main(argv)
        assert exit_.value.code == 2
        assert f"{command} needs --reason" in capsys.readouterr().err


def test_version_is_a_command_and_a_flag(capsys: pytest.CaptureFixture[str]) -> None:
    from tether import __version__
    assert plugin.main(["version"]) == 0
    assert capsys.readouterr().out == f"kubectl-tether {__version__}\n"
    with pytest.raises(SystemExit) as exit_:
        plugin.main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out == f"kubectl-tether {__version__}\n"


def test_status_shows_a_runs_place_in_its_tree() -> None:
    parent = _run({"phase": "Running", "children": {"admitted": 2, "reservedCents": 10, "spentCents": 7}})
    done = {"metadata": {"name": "job-1a2b", "creationTimestamp": "2026-01-01T00:00:01Z",
                         "annotations": {"tether.dev/child-key": "search:1"}},
            "status": {"phase": "Succeeded", "usage": {"cents": 7}, "result": {"hits": 3}}}
    refused = {"metadata": {"name": "job-3c4d", "creationTimestamp": "2026-01-01T00:00:02Z",
                            "annotations": {"tether.dev/child-key": "shell:1"}},
               "status": {"phase": "Rejected", "conditions": [
                   {"type": "Ready", "status": "False", "reason": "TreeBudgetExhausted", "message": "has 3 left",
                    "lastTransitionTime": "2026-01-01T00:00:02Z"}]}}
    lines = plugin.tree_lines(parent, [refused, done])
    assert lines[0] == "  children: 2 admitted, holding 10 cents / 0 tokens, spent 7 cents / 0 tokens"
    assert lines[1] == '    job-1a2b (search:1): Succeeded  spent 7 cents  result {"hits": 3}'
    assert lines[2].startswith("    job-3c4d (shell:1): Rejected (TreeBudgetExhausted)")
    child = {**done, "spec": {"parentRef": {"name": "job", "uid": "u", "holder": "job-a2", "fence": 3, "depth": 1}}}
    assert plugin.tree_lines(child, []) == ["  parent: job (spawned by job-a2 at fence 3, depth 1)"]
    assert plugin.tree_lines(_run({"phase": "Running"}), []) == []
