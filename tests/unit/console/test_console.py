"""The console's pure parts: the guards (session token, Host, cross-site writes), filters, the
review queue, the timeline's geometry and the usage series."""

from __future__ import annotations

import datetime as dt
import re
import ssl
from typing import Any

import pytest
from starlette.testclient import TestClient

from tether.console import charts, security, views
from tether.console.actions import normalize_gate, pending_requests
from tether.console.app import build_local_app, without_client_certificate
from tether.console.state import Point, record
from tether.kube.config import KubeConfig

T0 = dt.datetime(2026, 12, 1, 12, 0, 0, tzinfo=dt.timezone.utc)


def _ts(seconds: float) -> str:
    return (T0 + dt.timedelta(seconds=seconds)).isoformat().replace("+00:00", "Z")


def _run(name: str = "job", ns: str = "agents", **status: Any) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": ns, "uid": f"uid-{name}", "creationTimestamp": _ts(0)},
            "spec": {}, "status": status}


# --- guards -------------------------------------------------------------------------------------


def test_only_the_consoles_own_host_name_is_served() -> None:
    own = security.local_host(8123)
    hosts = frozenset({own})
    assert security.host_allowed(own, hosts) and security.host_allowed(own.upper(), hosts)
    for host in ("evil.example:8123", "127.0.0.1:8123", "localhost:8123", own.replace("8123", "8124"),
                 own.split(":")[0], "", None):
        assert not security.host_allowed(host, hosts), host
    assert security.host_allowed("console.example.com", None)  # behind the gateway


@pytest.mark.parametrize(("method", "headers", "allowed"), [
    ("GET", {}, True),
    ("POST", {}, False),  # neither an Origin nor the header: a plain cross-site form could be this
    ("POST", {"x-tether-console": "1"}, True),
    ("POST", {"x-tether-console": "yes"}, False),
    ("POST", {"origin": "http://127.0.0.1:8123"}, True),
    ("POST", {"origin": "https://127.0.0.1:8123"}, True),  # TLS ended at a proxy: host and port decide
    ("POST", {"origin": "http://evil.example", "x-tether-console": "1"}, False),
    ("POST", {"origin": "null"}, False),
    ("DELETE", {"origin": "http://127.0.0.1:9999"}, False),
])
def test_writes_must_come_from_the_console(method: str, headers: dict[str, str], allowed: bool) -> None:
    assert security.write_allowed(method, headers, "127.0.0.1:8123") is allowed


def test_secrets_are_long_random_and_compared_whole() -> None:
    a, b = security.new_secret(), security.new_secret()
    assert a != b and len(a) >= 40
    assert security.same_secret(a, a) and not security.same_secret(a[:-1], a) and not security.same_secret(None, a)
    assert security.local_host(8123) != security.local_host(8123)


def _local_client() -> tuple[TestClient, str]:
    cfg = KubeConfig(server="https://127.0.0.1:1", ssl_context=ssl.create_default_context())
    secret, host = security.new_secret(), security.local_host(8123)
    app = build_local_app(cfg, "agents", host, secret)
    return TestClient(app, base_url=f"http://{host}", follow_redirects=False), secret


def test_the_url_token_becomes_a_strict_httponly_cookie_and_leaves_the_address() -> None:
    client, secret = _local_client()
    assert client.get("/").status_code == 401
    assert client.get("/", params={"token": "guess"}).status_code == 401
    resp = client.get("/budgets", params={"token": secret})
    assert resp.status_code == 303 and resp.headers["location"] == "/budgets"
    cookie = resp.headers["set-cookie"]
    assert cookie.startswith("tether_console=") and "HttpOnly" in cookie and "SameSite=strict" in cookie


def test_the_local_console_refuses_other_hosts_and_cross_site_writes() -> None:
    client, secret = _local_client()
    client.cookies.set(security.SESSION_COOKIE, secret)
    assert client.get("/", headers={"host": "rebound.example:8123"}).status_code == 421
    path = "/api/runs/agents/job/stop"
    assert client.post(path, headers={"origin": "http://evil.example"}).status_code == 403
    assert client.post(path).status_code == 403
    # Without the cookie a same-origin write is still no one's.
    client.cookies.clear()
    assert client.post(path, headers={"x-tether-console": "1"}).status_code == 401


def test_pass_through_keeps_the_trust_but_not_the_identity() -> None:
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    fresh = without_client_certificate(ctx)
    assert fresh is not ctx and (fresh.check_hostname, fresh.verify_mode) == (False, ssl.CERT_NONE)


# --- what is shown ------------------------------------------------------------------------------


def test_filters_by_namespace_phase_and_budget() -> None:
    a = _run("a", "one", phase="Running")
    a["spec"]["budget"] = {"budgetRef": {"name": "team"}}
    b = _run("b", "two", phase="Succeeded")
    new = {"metadata": {"name": "c", "namespace": "one"}, "spec": {}}
    assert views.Filters().matches(a) and views.Filters().matches(new)
    assert [r["metadata"]["name"] for r in (a, b, new) if views.Filters(namespace="one").matches(r)] == ["a", "c"]
    assert views.Filters(phase="Pending").matches(new) and not views.Filters(phase="Pending").matches(a)
    assert views.Filters(budget="team").matches(a) and not views.Filters(budget="team").matches(b)
    assert views.Filters(namespace="one", budget="team").query() == "namespace=one&budget=team"


def test_pending_requests_and_the_start_gate_before_status_review() -> None:
    waiting = _run(phase="AwaitingApproval")
    assert pending_requests(waiting) == [{"gate": "Start", "attempt": 0, "requestedAt": _ts(0)}]
    reviewed = _run(phase="Running", review={"requests": [
        {"gate": "Start", "attempt": 0, "requestedAt": _ts(0), "decision": "Approve"},
        {"gate": "send-email", "attempt": 1, "requestedAt": _ts(30), "details": "to the customer"},
        {"gate": "Result", "attempt": 1, "requestedAt": _ts(20)}]})
    assert [r["gate"] for r in pending_requests(reviewed)] == ["Result", "send-email"]
    assert normalize_gate("start") == "Start" and normalize_gate("RESULT") == "Result"
    assert normalize_gate("send-email") == "send-email"


def test_the_review_queue_is_oldest_first_across_runs() -> None:
    late = _run("late", phase="AwaitingReview", review={"requests": [
        {"gate": "Result", "attempt": 2, "requestedAt": _ts(90)}]})
    early = _run("early", phase="Running", review={"requests": [
        {"gate": "deploy", "attempt": 1, "requestedAt": _ts(10)}]})
    gated = _run("gated", phase="AwaitingApproval")
    gated["metadata"]["creationTimestamp"] = _ts(50)
    queue = views.review_queue([late, early, gated, _run("done", phase="Succeeded")])
    assert [(run["metadata"]["name"], r["gate"]) for run, r in queue] == [
        ("early", "deploy"), ("gated", "Start"), ("late", "Result")]
    late["status"]["result"] = {"summary": "<b>done</b>"}
    html = views.review_fragment("/console", [late])
    assert 'data-gate="Result"' in html and 'data-attempt="2"' in html
    assert "&lt;b&gt;done&lt;/b&gt;" in html  # the result under review, escaped
    assert 'data-action="/console/api/runs/agents/late/decide"' in html


def test_names_are_escaped() -> None:
    run = _run("x", phase="Running", holder="<script>alert(1)</script>")
    assert "<script>" not in views.run_row("", run) and "&lt;script&gt;" in views.run_row("", run)


# --- timeline -----------------------------------------------------------------------------------


def _lost_then_succeeded() -> dict[str, Any]:
    return _run(phase="Succeeded", finishedAt=_ts(100), attempts=[
        {"attempt": 1, "fence": 1, "holder": "job-a1", "startedAt": _ts(0), "endedAt": _ts(40),
         "outcome": "LeaseLost", "message": "no renewal observed for 10s", "usage": {"cents": 5, "tokens": 50}},
        {"attempt": 2, "fence": 3, "holder": "job-a2", "startedAt": _ts(41), "endedAt": _ts(100),
         "outcome": "Succeeded", "usage": {"cents": 7, "tokens": 70}}])


def test_bars_span_each_attempt_on_one_time_axis() -> None:
    run = _lost_then_succeeded()
    scale = charts.scale_for(run, [], T0 + dt.timedelta(seconds=500))
    assert (scale.t0, scale.t1) == (T0.timestamp(), T0.timestamp() + 100)
    t = charts.timeline(run, [], scale, T0 + dt.timedelta(seconds=500))
    lost, done = t.bars
    assert (lost.outcome, done.outcome) == ("LeaseLost", "Succeeded")
    assert lost.x == charts.LEFT and done.x + done.width == pytest.approx(charts.WIDTH - charts.RIGHT)
    assert lost.width == pytest.approx((charts.WIDTH - charts.LEFT - charts.RIGHT) * 0.4)
    assert done.y > lost.y
    kinds = [(m.kind, m.x) for m in t.marks]
    assert kinds.count(("revoked", lost.x + lost.width)) == 1 and ("lapse", lost.x + lost.width) in kinds
    assert "fence 1 -> 2" in next(m.title for m in t.marks if m.kind == "revoked")
    svg = charts.timeline_svg(t)
    assert 'data-outcome="LeaseLost"' in svg and 'data-outcome="Succeeded"' in svg


def test_an_open_attempt_runs_to_now_and_events_are_marked() -> None:
    now = T0 + dt.timedelta(seconds=60)
    run = _run(phase="Running", attempts=[{"attempt": 1, "fence": 1, "startedAt": _ts(30)}])
    stale = {"metadata": {"name": "e1", "namespace": "agents"}, "reason": "ResultRejected", "count": 2,
             "lastTimestamp": _ts(45), "message": "fence 1 is stale"}
    other = {"metadata": {"name": "e2", "namespace": "agents"}, "reason": "LeaseRenewed", "lastTimestamp": _ts(45)}
    scale = charts.scale_for(run, [], now)
    t = charts.timeline(run, [stale, other], scale, now)
    (bar,) = t.bars
    assert bar.outcome == "Running" and bar.x + bar.width == pytest.approx(charts.WIDTH - charts.RIGHT)
    (mark,) = t.marks
    assert mark.kind == "stale result" and "x2" in mark.title and mark.x == pytest.approx(scale.x(T0.timestamp() + 45))


def test_usage_series_records_changes_and_each_attempts_end() -> None:
    series: list[Point] = []
    run = _run(usage={"cents": 1, "tokens": 10}, checkpoint={"cursor": "3"})
    record(series, run, 1.0)
    record(series, run, 2.0)  # nothing moved
    run["status"]["checkpoint"] = {"cursor": "4"}
    record(series, run, 3.0)
    assert [(p.time, p.cursor) for p in series] == [(1.0, "3"), (3.0, "4")]
    points = charts.usage_points(_lost_then_succeeded(), [])
    assert [(p.cents, p.tokens) for p in points] == [(0, 0), (5, 50), (5, 50), (12, 120)]  # each start, each end
    trimmed = _lost_then_succeeded()
    trimmed["status"]["trimmedUsage"] = {"cents": 100, "tokens": 7}  # attempts no longer listed spent it
    assert [(p.cents, p.tokens) for p in charts.usage_points(trimmed, [])] == [(100, 7), (105, 57), (105, 57),
                                                                               (112, 127)]
    svg = charts.usage_svg(sorted(series + points, key=lambda p: p.time), charts.Scale(0, T0.timestamp() + 100), T0)
    assert "12 cents" in svg and 'class="checkpoint"' in svg


def _polyline(svg: str, css: str) -> list[tuple[float, float]]:
    points = re.search(rf'<polyline class="{css}" points="([^"]*)"', svg)
    assert points is not None, svg
    return [(float(x), float(y)) for x, y in (xy.split(",") for xy in points[1].split())]


def test_a_run_that_ended_before_the_console_opened_has_its_usage_drawn_from_its_attempts() -> None:
    """The watch's only sample comes after the end; the attempt records say what each attempt spent
    from its start to its end, and the line climbs through them instead of sitting at the end."""
    run = _lost_then_succeeded()
    run["status"]["usage"] = {"cents": 12, "tokens": 120}
    opened = T0 + dt.timedelta(seconds=500)
    series: list[Point] = []
    record(series, run, opened.timestamp())
    scale = charts.scale_for(run, series, opened)
    cents = _polyline(charts.usage_svg(charts.usage_points(run, series), scale, opened), "cents")
    bottom, top = 88.0, 8.0

    def at(seconds: float, spent: int) -> tuple[float, float]:
        return round(scale.x(T0.timestamp() + seconds), 1), round(bottom - spent / 12 * (bottom - top), 1)

    # Straight from each attempt's start to its end, 0 -> 5 cents over attempt 1 and 5 -> 12 over
    # attempt 2, then held: the sample after the end adds nothing.
    vertices = [c for i, c in enumerate(cents) if i == 0 or c != cents[i - 1]]
    assert vertices == [at(0, 0), at(40, 5), at(41, 5), at(100, 12)], cents


def test_an_attempt_the_watch_saw_keeps_its_observed_steps() -> None:
    run = _run(phase="Succeeded", finishedAt=_ts(60), usage={"cents": 6, "tokens": 60}, attempts=[
        {"attempt": 1, "fence": 1, "startedAt": _ts(0), "endedAt": _ts(60), "outcome": "Succeeded",
         "usage": {"cents": 6, "tokens": 60}}])
    seen = [Point(T0.timestamp() + 10, 2, 20, None), Point(T0.timestamp() + 30, 6, 60, None)]
    points = charts.usage_points(run, seen)
    assert [(p.time - T0.timestamp(), p.cents, p.ramp) for p in points] == [
        (0, 0, False), (10, 2, False), (30, 6, False), (60, 6, False)]


def test_budget_gauges_show_spent_against_each_limit() -> None:
    budget = {"metadata": {"name": "team", "namespace": "agents"}, "spec": {"limitCents": 200, "period": "Daily"},
              "status": {"spent": {"cents": 170, "tokens": 5}, "periodStart": _ts(0)}}
    charging = _run("a", usage={"cents": 170})
    charging["spec"]["budget"] = {"budgetRef": {"name": "team"}}
    html = views.budgets_fragment("", [budget], [charging, _run("b")])
    assert 'data-share="0.850"' in html and "fill high" in html and "170 of 200" in html
    assert "tokens: 5 spent, no limit" in html and ">a</a>" in html and ">b</a>" not in html


def test_schedules_show_their_slots_why_they_skipped_and_their_runs_newest_first() -> None:
    sched = {"metadata": {"name": "nightly", "namespace": "agents"},
             "spec": {"schedule": "30 2 * * *", "timeZone": "Europe/Berlin", "concurrencyPolicy": "Forbid"},
             "status": {"lastScheduleTime": _ts(0), "nextScheduleTime": _ts(86400), "skippedCount": 2,
                        "lastSkipped": {"reason": "ConcurrencyForbid", "message": "nightly-1 is active"}}}
    older, newer, manual, other = _run("nightly-1796607000"), _run("nightly-1796693400"), _run("nightly-mabc123xyz"), _run("x")
    for run, slot in ((older, "2026-12-06T01:30:00Z"), (newer, "2026-12-07T01:30:00Z"), (manual, None)):
        run["metadata"]["labels"] = {"tether.dev/schedule": "nightly"}
        if slot:
            run["metadata"]["annotations"] = {"tether.dev/scheduled-at": slot}
    html = views.schedules_fragment("", [sched], [older, other, manual, newer])
    assert "30 2 * * * Europe/Berlin, Forbid" in html and f'class="next">{_ts(86400)}' in html
    assert "ConcurrencyForbid" in html and "skipped 2" in html and ">x</a>" not in html
    assert html.index("nightly-mabc123xyz") < html.index("nightly-1796693400") < html.index("nightly-1796607000")
    assert "manual start" in html
    suspended = {**sched, "spec": {**sched["spec"], "suspend": True}}
    assert "suspended" in views.schedules_fragment("", [suspended], [])
    assert "no WorkerRunSchedules" in views.schedules_fragment("", [], [older])


# --- queues -------------------------------------------------------------------------------------


def test_a_queued_run_shows_where_it_waits_and_its_evictions_on_the_timeline() -> None:
    run = _run(phase="Running", preemptions=1, queue={"name": "agents", "clusterQueue": "team-a", "workload": "w"},
               attempts=[{"attempt": 1, "fence": 1, "startedAt": _ts(0), "endedAt": _ts(30), "outcome": "Preempted",
                          "message": "evicted by Kueue (Preempted); yielded", "admission": {"clusterQueue": "team-a"}},
                         {"attempt": 2, "fence": 3, "startedAt": _ts(50)}])
    row = views.run_row("", run)
    assert "<th>" not in row and "<td>agents → team-a</td>" in row
    assert views.run_row("", _run(phase="Running")).endswith("<td>-</td></tr>")  # not queued
    now = T0 + dt.timedelta(seconds=60)
    t = charts.timeline(run, [], charts.scale_for(run, [], now), now)
    (evicted,) = [m for m in t.marks if m.kind == "evicted"]
    assert "attempt 1 evicted by Kueue from ClusterQueue team-a" in evicted.title
    assert evicted.x == pytest.approx(t.bars[0].x + t.bars[0].width)
    assert 'data-outcome="Preempted"' in charts.timeline_svg(t) and "Preempted" in charts.legend()
    summary = views.run_fragments("", run, [], [], now)["summary"]
    assert "queue agents → team-a" in summary and "1 evicted by Kueue" in summary


def test_a_runs_page_shows_its_parent_and_its_children() -> None:
    parent = {"metadata": {"name": "planner", "namespace": "ns", "uid": "u-p"}, "spec": {},
              "status": {"phase": "Running", "children": {"admitted": 2, "reservedCents": 10, "spentCents": 7}}}
    child = {"metadata": {"name": "planner-1a2b", "namespace": "ns", "uid": "u-c",
                          "annotations": {"tether.dev/child-key": "search:1"}, "creationTimestamp": "2026-01-01T00:00:01Z"},
             "spec": {"parentRef": {"name": "planner", "uid": "u-p", "holder": "planner-a2", "fence": 3, "depth": 1}},
             "status": {"phase": "Succeeded", "usage": {"cents": 7}, "result": {"hits": 3}}}
    html = views.tree_fragment("", parent, [child])
    assert "2 children admitted; they hold 10 cents and spent 7 cents" in html
    assert '<a href="/runs/ns/planner-1a2b">planner-1a2b</a>' in html and "search:1" in html
    assert "Succeeded" in html and "{&quot;hits&quot;: 3}" in html
    up = views.tree_fragment("", child, [])
    assert 'child of <a href="/runs/ns/planner">planner</a>, spawned by planner-a2 at fence 3' in up
    assert "no parent, no children" in views.tree_fragment("", {**parent, "status": {}}, [])
    page = views.run_fragments("", parent, [], [], dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc), children=[child])
    assert page["tree"] == html


def test_a_runs_children_are_those_its_uid_owns() -> None:
    parent = {"metadata": {"name": "p", "namespace": "ns", "uid": "u-p"}}
    mine = {"metadata": {"name": "c1", "namespace": "ns", "ownerReferences": [{"uid": "u-p"}]}, "spec": {"parentRef": {}}}
    namesakes = {"metadata": {"name": "c2", "namespace": "ns", "ownerReferences": [{"uid": "u-old"}]},
                 "spec": {"parentRef": {}}}
    owned_only = {"metadata": {"name": "w", "namespace": "ns", "ownerReferences": [{"uid": "u-p"}]}, "spec": {}}
    assert views.children_of(parent, [mine, namesakes, owned_only, parent]) == [mine]
