"""What the run page and the runs table show (issue 22): liveness from the Lease, stuck runs, each
attempt's exit code, the result and spec, what a start gate approves, and the worker's logs
through the API server's pod log endpoint. No cluster: the API is an httpx.MockTransport stub."""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import ssl
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.testclient import TestClient

from tether.console import details, security, views
from tether.console.app import build_local_app
from tether.console.state import Scope
from tether.kube.config import KubeConfig

PORT = 8123
HOST = security.local_host(PORT)
NOW = dt.datetime.now(dt.timezone.utc)
POD = "/api/v1/namespaces/agents/pods/job-a1"


def _ts(seconds_ago: float) -> str:
    return (NOW - dt.timedelta(seconds=seconds_ago)).isoformat().replace("+00:00", "Z")


def _run(name: str = "job", uid: str = "uid-1", spec: dict[str, Any] | None = None, **status: Any) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "agents", "uid": uid, "resourceVersion": "1",
                         "creationTimestamp": _ts(300)},
            "spec": spec if spec is not None else {"template": {"spec": {"containers": [
                {"name": "worker", "image": "example/worker:1"}]}}},
            "status": status}


def _lease(name: str = "job", uid: str = "uid-1", renewed: float = 1.0, holder: str | None = "job-a1") -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "agents", "resourceVersion": "7",
                         "labels": {"tether.dev/run": name},
                         "ownerReferences": [{"kind": "WorkerRun", "uid": uid, "controller": True}]},
            "spec": {"holderIdentity": holder, "renewTime": _ts(renewed), "leaseTransitions": 1}}


def _pod(exit_code: int | None, name: str = "job-a1") -> dict[str, Any]:
    state = {"terminated": {"exitCode": exit_code}} if exit_code is not None else {"running": {}}
    return {"metadata": {"name": name, "namespace": "agents", "labels": {"tether.dev/run": "job",
                                                                       "tether.dev/attempt": "1"}},
            "spec": {"containers": [{"name": "worker"}, {"name": "sidecar"}]},
            "status": {"containerStatuses": [{"name": "worker", "state": state}]}}


# --- liveness ------------------------------------------------------------------------------------


def test_the_lease_age_is_the_leases_renew_time_not_the_folded_status() -> None:
    """status.lastRenewTime is folded only when progress moves: a paused worker renewed a second
    ago has an old one. The age shown is the Lease's renewTime."""
    run = _run(phase="Running", holder="job-a1", lastRenewTime=_ts(94))
    row = views.run_row("", run, _lease(renewed=1))
    assert f'data-since="{_ts(1)}"' in row and _ts(94) not in row
    summary = views.run_fragments("", run, [], [], NOW, _lease(renewed=1))["summary"]
    assert f'lease renewed <span class="lease-age" data-since="{_ts(1)}"' in summary and _ts(94) not in summary
    assert "lease renewed" not in views.run_fragments("", run, [], [], NOW, _lease(holder=None))["summary"]
    assert '<td class="lease">-</td>' in views.run_row("", run, None)  # no Lease seen (yet): no age made up


def test_a_namesakes_lease_is_not_this_runs() -> None:
    scope = Scope(httpx.AsyncClient(), "agents")
    scope.leases.objects["agents/job"] = _lease(uid="uid-old")
    assert scope.lease_of(_run(uid="uid-new")) is None
    scope.leases.objects["agents/job"] = _lease(uid="uid-new")
    assert scope.lease_of(_run(uid="uid-new")) is not None


def test_a_lease_renewal_or_a_pods_deletion_renders_its_runs_pages_again() -> None:
    scope = Scope(httpx.AsyncClient(), "agents")
    listener = scope.listen()
    scope._owned_changed("agents/job", _lease())
    pod = _pod(0)
    scope._owned_changed("agents/job-a1", pod)
    assert listener.take() == {"run:agents/job"}
    scope._owned_changed("agents/job-a1", None)  # a deleted pod's key is its own, not its run's
    assert listener.take() == {"run:agents/job"}


# --- stuck runs ------------------------------------------------------------------------------------


def _cond(type_: str, status: str, reason: str, message: str = "") -> dict[str, Any]:
    return {"type": type_, "status": status, "reason": reason, "message": message, "lastTransitionTime": _ts(5)}


def test_stuck_runs_are_badged_on_the_runs_page() -> None:
    stalled = _run(phase="Starting", conditions=[_cond("Stalled", "True", "PodRefused", "spec.containers: Required")])
    no_budget = _run(phase="Pending", conditions=[_cond("Admitted", "False", "BudgetNotFound",
                                                        "WorkerBudget team does not exist")])
    over = _run(phase="Pending", conditions=[_cond("Admitted", "False", "BudgetExceeded")])  # waits for a reset
    done = _run(phase="Failed", conditions=[_cond("Stalled", "True", "PodRefused")])
    assert 'class="badge stuck" title="PodRefused: spec.containers: Required">stalled<' in views.run_row("", stalled)
    assert ">no budget<" in views.run_row("", no_budget) and "WorkerBudget team does not exist" in \
        views.run_row("", no_budget)
    assert "stuck" not in views.run_row("", over) and "stuck" not in views.run_row("", done)


# --- a refused pod (issue 34) ------------------------------------------------------------------------

REFUSED = 'the API server refused pod job-a1: Pod "job-a1" is invalid: spec.containers: Required value'


def test_a_grant_never_renewed_claims_no_liveness() -> None:
    """The console said "lease renewed 103s ago" of a worker whose pod was refused: the grant's own
    renewTime (its acquireTime) is no renewal."""
    run = _run(phase="Starting", holder="job-a1", attempt=1, fence=1)
    granted = _lease(renewed=103)
    granted["spec"]["acquireTime"] = granted["spec"]["renewTime"]
    row = views.run_row("", run, granted)
    assert '<td class="lease">never renewed</td>' in row and "data-since" not in row
    summary = views.run_fragments("", run, [], [], NOW, granted)["summary"]
    assert "lease never renewed" in summary and "lease renewed" not in summary
    assert _ts(103) not in summary


def test_a_refused_pod_leads_the_run_page_and_is_badged() -> None:
    run = _run(phase="Backoff", attempt=1, fence=2,
               attempts=[{"attempt": 1, "fence": 1, "holder": "job-a1", "pod": "job-a1", "startedAt": _ts(20),
                          "endedAt": _ts(20), "outcome": "PodRefused", "message": REFUSED}],
               conditions=[_cond("Ready", "False", "PodRefused", f"attempt 2 in 10s after PodRefused: {REFUSED}"),
                           _cond("Stalled", "False", "PodRefused")])
    summary = views.run_fragments("", run, [], [], NOW, None)["summary"]
    assert summary.startswith('<span class="why"><b>PodRefused</b>: attempt 2 in 10s after PodRefused: '
                              'the API server refused pod job-a1: Pod &quot;job-a1&quot; is invalid'), summary
    assert summary.index("PodRefused") < summary.index('id="phase"')
    assert '>pod refused<' in views.run_row("", run)
    assert "PodRefused" in details.attempts_table("", run, []) and "running" not in details.attempts_table("", run, [])
    done = _run(phase="Failed", conditions=[_cond("Ready", "False", "PodRefused", f"2 of 2 attempts used; {REFUSED}")])
    assert views.run_fragments("", done, [], [], NOW, None)["summary"].startswith('<span class="why"><b>PodRefused</b>')
    quiet = _run(phase="Running", conditions=[_cond("Ready", "False", "Running", "job-a1 renewed its lease")])
    assert 'class="why"' not in views.run_fragments("", quiet, [], [], NOW, None)["summary"]


# --- the run page ------------------------------------------------------------------------------------


def test_each_attempt_shows_its_exit_code_recorded_or_from_its_pod() -> None:
    run = _run(phase="Running", attempts=[
        {"attempt": 1, "fence": 1, "pod": "job-a1", "startedAt": _ts(60), "endedAt": _ts(30), "outcome": "Failed",
         "exitCode": 3},
        {"attempt": 2, "fence": 2, "pod": "job-a2", "startedAt": _ts(20), "outcome": None}])
    html = views.run_fragments("", run, [], [], NOW, None, [_pod(137, "job-a2")])["attempts"]
    assert '<tr data-attempt="1">' in html and '<td class="num exit-code">3</td>' in html
    assert '<td class="num exit-code">137</td>' in html  # not recorded yet: the pod's containerStatuses
    assert 'data-logs="/api/runs/agents/job/logs?attempt=2"' in html
    gone = views.run_fragments("", run, [], [], NOW, None, [])["attempts"]
    assert '<td class="num exit-code">-</td>' in gone


def test_the_result_and_the_spec_are_shown_as_escaped_yaml() -> None:
    spec = {"executor": "External", "payload": {"prompt": "<img src=x onerror=alert(1)>"}}
    run = _run(spec=spec, phase="Succeeded", result={"summary": "<b>42</b>", "rows": [1, 2]})
    f = views.run_fragments("", run, [], [], NOW)
    assert "summary: &lt;b&gt;42&lt;/b&gt;" in f["result"] and "- 1" in f["result"]
    assert "prompt: &lt;img src=x onerror=alert(1)&gt;" in f["spec"] and "executor: External" in f["spec"]
    assert "<img" not in f["spec"] + f["result"]
    assert "no result yet" in views.run_fragments("", _run(phase="Running"), [], [], NOW)["result"]
    page = views.run_page("", "agents", "job", f)
    for section in ('id="attempts"', 'id="log-output"', 'id="result"', 'id="spec"'):
        assert section in page


def test_a_start_gate_shows_what_it_approves() -> None:
    spec = {"template": {"spec": {"containers": [{"name": "worker", "image": "registry/agent:7"}]}},
            "payload": {"task": "summarise Q3"}, "budget": {"capCents": 500, "budgetRef": {"name": "team"}},
            "review": {"start": True}}
    form = views.decision_form("", _run(spec=spec, phase="AwaitingApproval"), {"gate": "Start", "attempt": 0})
    assert "registry/agent:7" in form and "task: summarise Q3" in form
    assert "cap 500 cents" in form and "budget team" in form
    bare = views.decision_form("", _run(spec={"executor": "External"}, phase="AwaitingApproval"),
                               {"gate": "Start", "attempt": 0})
    assert "no cap or budget" in bare and "an External worker" in bare
    request = views.decision_form("", _run(spec=spec, phase="Running"), {"gate": "deploy", "attempt": 1})
    assert "registry/agent:7" not in request  # a worker's request shows its own details


# --- logs, on the route --------------------------------------------------------------------------------


class LogApi:
    """The API server: one run whose attempt 1 ran in pod job-a1, and its pod log endpoint."""

    def __init__(self, log: httpx.Response, run: dict[str, Any] | None = None) -> None:
        self.log, self.asked = log, []  # type: ignore[var-annotated]
        self.run = run or _run(phase="Running", attempt=1, attempts=[{"attempt": 1, "fence": 1, "pod": "job-a1"}])

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if request.url.params.get("watch"):  # not a refusal: what was listed stays listed
            return httpx.Response(503, json={"message": "no watch here (stub)"})
        if path.endswith("/selfsubjectreviews"):
            return httpx.Response(201, json={"status": {"userInfo": {"username": "alice"}}})
        if path == f"{POD}/log":
            self.asked.append(dict(request.url.params))
            return self.log
        items = {"workerruns": [self.run], "pods": [_pod(None)]}.get(path.rsplit("/", 1)[-1], [])
        return httpx.Response(200, json={"metadata": {"resourceVersion": "1"}, "items": items})


def _client(api: LogApi) -> TestClient:
    cfg = KubeConfig(server="https://api", ssl_context=ssl.create_default_context())
    secret = security.new_secret()
    app = build_local_app(cfg, "agents", HOST, secret)
    app.state.backend.scope = Scope(httpx.AsyncClient(base_url="https://api", transport=httpx.MockTransport(api)),
                                    "agents")
    client = TestClient(app, base_url=f"http://{HOST}", follow_redirects=False)
    client.cookies.set(security.SESSION_COOKIE, secret)
    return client


def test_logs_are_read_through_the_pod_log_endpoint_as_plain_text() -> None:
    api = LogApi(httpx.Response(200, text="step 1\n<script>alert(1)</script>\n"))
    with _client(api) as client:
        resp = client.get("/api/runs/agents/job/logs", params={"attempt": "1", "tailLines": "50"})
    assert resp.status_code == 200 and resp.text == "step 1\n<script>alert(1)</script>\n"
    assert resp.headers["content-type"].startswith("text/plain")  # shown as text, never as markup
    assert resp.headers["x-content-type-options"] == "nosniff" and resp.headers["cache-control"] == "no-store"
    (asked,) = api.asked
    assert asked["container"] == "worker" and asked["tailLines"] == "50" and int(asked["limitBytes"]) > 0


@pytest.mark.parametrize(("answer", "status", "shown"), [
    # The local process kubelet serves no logs (no port 10250): the API server's own words.
    (httpx.Response(500, json={"message": "Get \"https://127.0.0.1:10250/containerLogs/agents/job-a1/worker\": "
                                          "dial tcp 127.0.0.1:10250: connect: connection refused"}),
     502, "dial tcp 127.0.0.1:10250: connect: connection refused"),
    (httpx.Response(404, json={"message": "pods \"job-a1\" not found"}), 404, "no logs: pod job-a1 no longer exists"),
    (httpx.Response(403, json={"message": "pods \"job-a1\" is forbidden: cannot get resource \"pods/log\""}),
     403, "cannot get resource \"pods/log\""),
    (httpx.Response(400, json={"message": "container \"worker\" is waiting to start"}), 400, "waiting to start"),
])
def test_no_logs_answer_with_the_api_servers_reason(answer: httpx.Response, status: int, shown: str) -> None:
    with _client(LogApi(answer)) as client:
        resp = client.get("/api/runs/agents/job/logs", params={"attempt": "1"})
    assert resp.status_code == status and shown in resp.text, resp.text
    assert resp.headers["content-type"].startswith("text/plain")


def test_logs_of_what_has_no_pod_say_so_without_asking() -> None:
    external = LogApi(httpx.Response(200, text="never asked"),
                      _run(spec={"executor": "External"}, phase="Running", attempt=1,
                           attempts=[{"attempt": 1, "fence": 1, "holder": "ext"}]))
    with _client(external) as client:
        resp = client.get("/api/runs/agents/job/logs", params={"attempt": "1"})
        assert resp.status_code == 404 and "External worker" in resp.text
        assert client.get("/api/runs/agents/other/logs").status_code == 404
        assert client.get("/api/runs/agents/job/logs", params={"attempt": "x"}).status_code == 422
    assert external.asked == []


def test_logs_need_a_session_and_are_read_only() -> None:
    api = LogApi(httpx.Response(200, text="secret output"))
    with _client(api) as client:
        client.cookies.clear()
        resp = client.get("/api/runs/agents/job/logs", params={"attempt": "1"})
        assert resp.status_code == 401 and "secret output" not in resp.text
    assert api.asked == []


# --- screenshots -------------------------------------------------------------------------------------


def test_the_console_tests_write_screenshots_outside_the_tree_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """`make test` left docs/console-*.png rewritten: the browser tests save there only when
    `make screenshots` asks (TETHER_SCREENSHOTS=docs)."""
    from tests.e2e.test_console import ROOT, screenshot_dir

    monkeypatch.delenv("TETHER_SCREENSHOTS", raising=False)
    for cache in (None, "/tmp/tether-cache"):
        if cache:
            monkeypatch.setenv("TETHER_CACHE", cache)
        else:
            monkeypatch.delenv("TETHER_CACHE", raising=False)
        assert not screenshot_dir().resolve().is_relative_to(ROOT), screenshot_dir()
    monkeypatch.setenv("TETHER_SCREENSHOTS", "docs")
    assert screenshot_dir() == ROOT / "docs"
    assert Path(os.path.relpath(screenshot_dir(), ROOT)) == Path("docs")


def test_the_scope_watches_leases_and_pods_of_runs_only() -> None:
    seen: list[httpx.Request] = []

    def api(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(403, json={"message": "forbidden (stub)"})

    async def main() -> list[str]:
        scope = Scope(httpx.AsyncClient(base_url="https://api", transport=httpx.MockTransport(api)), "agents")
        scope.start()
        while len({r.url.path for r in seen}) < 5 or not any(e.startswith("pods") for e in scope.errors()):
            await asyncio.sleep(0.01)  # the watches' first lists, each refused
        errors = scope.errors()
        await scope.close()
        return errors

    errors = asyncio.run(asyncio.wait_for(main(), timeout=5))
    selectors = {r.url.path: r.url.params.get("labelSelector") for r in seen}
    assert selectors["/apis/coordination.k8s.io/v1/namespaces/agents/leases"] == "tether.dev/run"
    assert selectors["/api/v1/namespaces/agents/pods"] == "tether.dev/run"
    assert any(e.startswith("leases: 403") for e in errors)  # a user who may not list Leases is told why
