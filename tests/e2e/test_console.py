"""The web console in a real browser (Debian's Chromium, driven by Playwright) against the real
control plane and operator: `kubectl tether ui` as a limited user, and /console behind the gateway
with token sign-in. What the browser shows is checked in the page; what it did, in the API.

The screenshots (console-*.png) are taken here: into docs/ only for `make screenshots`
(TETHER_SCREENSHOTS=docs), otherwise outside the tree, so `make test` leaves it clean.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import re
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import Browser, Page, expect, sync_playwright

from tests.cluster.test_approvals import APPROVALS
from tests.e2e.test_gateway import _up
from tests.e2e.test_review import _gated
from tests.e2e.test_review_gates import _asking, _reviewed
from tests.e2e.test_schedules import SCHEDULES, _schedule
from testkit import runs
from testkit.kube import Kube, eventually
from tests.support.users import console_user
from testkit.scenario import app_run, lease

ROOT = Path(__file__).resolve().parents[2]


def screenshot_dir() -> Path:
    """TETHER_SCREENSHOTS (relative to the repository) when set, else under $TETHER_CACHE or the
    system's temporary directory."""
    chosen = os.environ.get("TETHER_SCREENSHOTS")
    if chosen:
        return ROOT / chosen
    return Path(os.environ.get("TETHER_CACHE") or tempfile.gettempdir()) / "tether-screenshots"


# What gives a test away on a page: the namespace fixture's names (t-<test name>-<5 hex digits>),
# pytest's temporary folders, this machine's temporary directory.
TEST_TRACES = re.compile(r"\bt-[a-z0-9-]+-[0-9a-f]{5}\b|pytest-of-|/pytest-\d|" + re.escape(tempfile.gettempdir() + "/"))


def _screenshot(page: Page, name: str, full_page: bool = False) -> None:
    """Saves the page as docs/`name` (make screenshots) once it shows what a user's would: a user's
    namespace and names, no test's (each screenshot test names its namespace)."""
    traces = sorted(set(TEST_TRACES.findall(page.inner_text("body"))))
    assert not traces, f"{name} would show a test's names or paths: {traces}"
    target = screenshot_dir()
    target.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(target / name), full_page=full_page)


CHROMIUM = "/usr/bin/chromium"


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: `make test` installs it (hack/install-browser.sh)")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield b
        b.close()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    context = browser.new_context(viewport={"width": 1280, "height": 560})
    page = context.new_page()
    page.set_default_timeout(30_000)
    refused: list[str] = []  # what the pages' Content-Security-Policy blocked: the pages must need nothing of it
    page.on("console", lambda m: refused.append(m.text) if "Content Security Policy" in m.text else None)
    yield page
    context.close()  # closes the event streams before the servers stop
    assert not refused, refused


@pytest.fixture
def alice(kube: Kube, namespace: str, tmp_path: Path) -> tuple[str, str, Path]:
    return console_user(kube, namespace, tmp_path)


@pytest.fixture
def console(alice: tuple[str, str, Path], namespace: str) -> Iterator[str]:
    """`kubectl tether ui` as alice; yields the URL it printed (with its session token)."""
    plugin = Path(sys.executable).parent / "kubectl-tether"
    proc = subprocess.Popen([str(plugin), "ui", "--kubeconfig", str(alice[2]), "-n", namespace, "--no-open"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines = [proc.stdout.readline() for _ in range(2)]  # type: ignore[union-attr]
        url = lines[1].strip()
        # Its own host name: the session cookie goes to no other server on 127.0.0.1.
        assert re.fullmatch(r"http://tether-[0-9a-f]{16}\.localhost:\d+/\?token=\S+", url), (lines, proc.poll())
        yield url
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        print("--- kubectl tether ui stderr ---", proc.stderr.read() if proc.stderr else "")  # type: ignore[union-attr]


def _phase_cell(page: Page, ns: str, name: str) -> Any:
    return page.locator(f'tr[data-key="{ns}/{name}"] .phase')


def _budget(name: str, cents: int) -> dict[str, Any]:
    return {"apiVersion": "tether.dev/v1alpha1", "kind": "WorkerBudget", "metadata": {"name": name},
            "spec": {"limitCents": cents, "limitTokens": 5000, "period": "Daily"}}


@pytest.mark.parametrize("namespace", ["research"], indirect=True)  # screenshots: a user's namespace
def test_runs_change_live_and_budgets_fill(kube: Kube, namespace: str, operator, console: str,  # type: ignore[no-untyped-def]
                                           page: Page) -> None:
    kube.ok(kube.post(f"/apis/tether.dev/v1alpha1/namespaces/{namespace}/workerbudgets", _budget("research", 40)))
    page.goto(console)
    assert "token=" not in page.url  # the session moved into the cookie
    page.evaluate("window.__sameDocument = true")
    expect(page.locator("#live.on")).to_be_visible()
    assert page.locator("#rows tr").count() == 0

    body = runs.example("short-job.yaml", payload={"steps": 8, "stepSeconds": 1, "centsPerStep": 2})
    body["spec"]["budget"] = {"budgetRef": {"name": "research"}}
    runs.create(kube, namespace, body)
    runs.create(kube, namespace, runs.example("short-job.yaml", payload={"steps": 1, "stepSeconds": 0.1}),
                name="quick-job")
    runs.create(kube, namespace, _gated(), name="gated-job")
    # Pushed, not reloaded: the row appears and its phase moves on in the same document.
    expect(_phase_cell(page, namespace, "short-job")).to_have_text("Running", timeout=60_000)
    expect(_phase_cell(page, namespace, "quick-job")).to_have_text("Succeeded", timeout=60_000)
    expect(_phase_cell(page, namespace, "gated-job")).to_have_text("AwaitingApproval", timeout=60_000)
    expect(page.locator(f'tr[data-key="{namespace}/short-job"] td').nth(7)).not_to_have_text("0", timeout=30_000)
    _screenshot(page, "console-runs.png")

    page.select_option("select[name=phase]", "AwaitingApproval")
    expect(page.locator("#rows tr")).to_have_count(1)
    assert "phase=AwaitingApproval" in page.url
    page.select_option("select[name=phase]", "")
    page.select_option("select[name=budget]", "research")
    expect(page.locator("#rows tr")).to_have_count(1)
    expect(_phase_cell(page, namespace, "short-job")).to_have_text("Succeeded", timeout=60_000)
    assert page.evaluate("window.__sameDocument") is True

    page.click("nav >> text=Budgets")
    gauge = page.locator(f'section[data-budget="{namespace}/research"] .gauge').first
    expect(gauge).to_contain_text("16 of 40", timeout=30_000)  # 8 steps of 2 cents, charged once
    expect(page.locator(f'section[data-budget="{namespace}/research"] table')).to_contain_text("short-job")
    _screenshot(page, "console-budgets.png", full_page=True)


def _seconds_ago(ts: str) -> float:
    return (dt.datetime.now(dt.timezone.utc) - dt.datetime.fromisoformat(ts.replace("Z", "+00:00"))).total_seconds()


def test_the_lease_age_is_read_from_the_lease(kube: Kube, namespace: str, operator, console: str,  # type: ignore[no-untyped-def]
                                             page: Page) -> None:
    """A holding worker renews its Lease every second while its progress stands still, so the
    operator folds status.lastRenewTime no more: the age shown must be the Lease's."""
    runs.create(kube, namespace, app_run("holder", {"holdAttempts": [1], "holdSeconds": 120}, duration=10))
    runs.wait_phase(kube, namespace, "holder", "Running", timeout=60)

    def folded_long_ago() -> bool:
        status = runs.get(kube, namespace, "holder").get("status") or {}
        renewed = lease(kube, namespace, "holder")["spec"].get("renewTime")
        return bool(renewed) and _seconds_ago(renewed) < 3 and (
            not status.get("lastRenewTime") or _seconds_ago(status["lastRenewTime"]) > 20)

    eventually(folded_long_ago, timeout=60, interval=0.5, what="a fresh Lease and an old status.lastRenewTime")
    page.goto(console)
    small = re.compile(r"^[0-9]s ago$")  # one digit: renewed within ten seconds
    expect(page.locator(f'tr[data-key="{namespace}/holder"] td').nth(6)).to_have_text(small)
    page.goto(page.url.rstrip("/") + f"/runs/{namespace}/holder")
    expect(page.locator("#summary")).to_contain_text(re.compile(r"lease renewed [0-9]s ago"))

    # Its worker's logs, through the API server's pod log endpoint: what the API server answers the
    # admin for that pod is what the page shows (on the process kubelet, which serves no logs, its error).
    (attempt,) = runs.get(kube, namespace, "holder")["status"]["attempts"]
    asked = kube.get(f"/api/v1/namespaces/{namespace}/pods/{attempt['pod']}/log", params={"container": "worker"})
    # (An error names the URL asked, whose query differs: its reason after the URL is compared.)
    said = (asked.text.strip().splitlines() or ["nothing"])[-1] if asked.status_code == 200 else \
        asked.json()["message"].split('": ')[-1]
    page.click('#attempts tr[data-attempt="1"] button[data-logs]')
    expect(page.locator("#log-title")).to_contain_text("attempt 1: " + ("the last lines" if asked.status_code == 200
                                                                        else "no logs"))
    expect(page.locator("#log-output")).to_contain_text(said)


def test_the_run_page_shows_what_the_run_did(kube: Kube, namespace: str, operator, console: str,  # type: ignore[no-untyped-def]
                                            page: Page) -> None:
    """Its result, each attempt's exit code, its spec and payload; and on the runs page, a run
    waiting on a budget that does not exist is flagged."""
    runs.create(kube, namespace, runs.example("short-job.yaml", payload={"steps": 2, "stepSeconds": 0.1}))
    unfunded = runs.example("short-job.yaml")
    unfunded["spec"]["budget"] = {"budgetRef": {"name": "missing"}}
    runs.create(kube, namespace, unfunded, name="unfunded")
    page.goto(console)
    badge = page.locator(f'tr[data-key="{namespace}/unfunded"] .badge.stuck')
    expect(badge).to_have_text("no budget", timeout=60_000)
    assert "WorkerBudget missing does not exist" in (badge.get_attribute("title") or "")
    expect(page.locator(f'tr[data-key="{namespace}/short-job"] .badge.stuck')).to_have_count(0)

    page.goto(page.url.rstrip("/") + f"/runs/{namespace}/short-job")
    expect(page.locator("#phase")).to_have_text("Succeeded", timeout=60_000)
    expect(page.locator("#result")).to_contain_text("steps: 2")
    expect(page.locator("#spec")).to_contain_text("stepSeconds: 0.1")
    expect(page.locator("#spec")).to_contain_text("image: ")
    # Recorded by the operator from the pod's containerStatuses (or read from the pod while it exists).
    expect(page.locator('#attempts tr[data-attempt="1"] .exit-code')).to_have_text("0", timeout=30_000)


def test_the_schedules_page_shows_a_schedules_slots_skips_and_runs_as_they_happen(  # type: ignore[no-untyped-def]
        kube: Kube, namespace: str, operator, console: str, page: Page) -> None:
    """A Forbid schedule on 5 s slots whose first run stays active: the page shows that run, then the
    slots it skips and why, its next slot moving on, and its suspension, all pushed into one document."""
    page.goto(console)
    page.click("nav >> text=Schedules")
    expect(page.locator("#schedules")).to_contain_text("no WorkerRunSchedules")
    page.evaluate("window.__sameDocument = true")
    kube.ok(kube.post(SCHEDULES.format(ns=namespace), _schedule("nightly", concurrencyPolicy="Forbid")))
    section = page.locator(f'section[data-schedule="{namespace}/nightly"]')
    expect(section).to_contain_text("@every 5s, Forbid", timeout=30_000)
    first = eventually(lambda: kube.ok(kube.get(Kube.wr_path(namespace), params={
        "labelSelector": "tether.dev/schedule=nightly"}))["items"], timeout=30, what="the first slot's run")[0]
    expect(section.locator("table")).to_contain_text(first["metadata"]["name"], timeout=30_000)
    expect(section).to_contain_text("last: ConcurrencyForbid", timeout=30_000)
    shown = section.locator(".next").inner_text()
    expect(section.locator(".next")).not_to_have_text(shown, timeout=30_000)  # the next slot, pushed
    assert section.locator(".next").inner_text() > shown  # later, not just different (RFC 3339 UTC sorts)
    kube.ok(kube.patch(f"{SCHEDULES.format(ns=namespace)}/nightly", {"spec": {"suspend": True}}))
    expect(section.locator(".p-Suspended")).to_have_text("suspended", timeout=30_000)
    assert page.evaluate("window.__sameDocument") is True


@pytest.mark.parametrize("namespace", ["billing"], indirect=True)  # screenshots: a user's namespace
def test_a_start_gate_approved_from_the_page(kube: Kube, namespace: str, operator, alice: tuple[str, str, Path],  # type: ignore[no-untyped-def]
                                            console: str, page: Page) -> None:
    username = alice[0]
    # Each kind of gate waits in the queue: a worker's request, a result, a start.
    runs.create(kube, namespace, _asking(), name="report-job")
    runs.create(kube, namespace, _reviewed(), name="summary-job")
    created = runs.create(kube, namespace, _gated())
    runs.wait_phase(kube, namespace, "short-job", "AwaitingApproval", timeout=30)
    page.goto(console)
    page.click("nav >> text=Review queue")
    for gate in ("send-report", "Result", "Start"):
        expect(page.locator(f'#queue form.decide[data-gate="{gate}"]')).to_have_count(1, timeout=60_000)
    item = page.locator(f'form.decide[data-action$="/{namespace}/short-job/decide"][data-gate="Start"]')
    # What is being approved: the image, the payload and the limits.
    image = created["spec"]["template"]["spec"]["containers"][0]["image"]
    expect(item.locator(".starts .image")).to_have_text(image)
    expect(item.locator(".starts pre.yaml")).to_contain_text("steps:")
    expect(item.locator(".starts .limits")).to_contain_text("attempts")
    item.locator("input[name=reason]").fill("estimate checked")
    _screenshot(page, "console-review.png", full_page=True)
    item.locator("input[name=reason]").press("Enter")  # decides nothing: only Approve or Deny does
    item.locator("button.approve").click()
    expect(page.locator("#flash")).to_contain_text("Approve Start of short-job (attempt 0) recorded", timeout=15_000)
    expect(page.locator("#flash")).to_contain_text(username)
    expect(item).to_have_count(0, timeout=30_000)
    expect(page.locator('#queue form.decide[data-gate="Result"] input[name=reason]')).to_have_value("")

    (approval,) = kube.ok(kube.get(APPROVALS.format(ns=namespace)))["items"]
    spec = approval["spec"]
    assert (spec["approver"], spec["decision"], spec["gate"], spec["reason"]) == (
        username, "Approve", "Start", "estimate checked")
    assert spec["runRef"] == {"name": "short-job", "uid": created["metadata"]["uid"]}
    assert spec.get("attempt", 0) == 0
    assert runs.wait_phase(kube, namespace, "short-job", ("Succeeded", "Failed"), timeout=60)["status"]["phase"] == \
        "Succeeded"


def test_a_workers_request_approved_on_its_run_page(kube: Kube, namespace: str, operator,  # type: ignore[no-untyped-def]
                                                    alice: tuple[str, str, Path], console: str, page: Page) -> None:
    """A mid-run request is decided by the same form and call as a start gate; the decision reaches
    the worker (it publishes what it was told) and names the request's attempt."""
    runs.create(kube, namespace, _asking())
    page.goto(console)
    page.goto(page.url.rstrip("/") + f"/runs/{namespace}/short-job")
    form = page.locator('#review form.decide[data-gate="send-report"]')
    expect(form).to_contain_text("POST the report to finance", timeout=60_000)
    assert form.get_attribute("data-attempt") == "1"
    form.locator("input[name=reason]").fill("numbers checked")
    form.locator("button.approve").click()
    expect(page.locator("#flash")).to_contain_text("Approve send-report of short-job (attempt 1) recorded")
    expect(page.locator("#phase")).to_have_text("Succeeded", timeout=60_000)
    expect(page.locator("#review table")).to_contain_text("numbers checked")
    run = runs.get(kube, namespace, "short-job")
    assert run["status"]["result"]["approval"] == {"decision": "Approve", "reason": "numbers checked",
                                                   "approver": alice[0]}
    (approval,) = kube.ok(kube.get(APPROVALS.format(ns=namespace)))["items"]
    assert (approval["spec"]["gate"], approval["spec"]["attempt"]) == ("send-report", 1)


def test_controls_act_as_the_user(kube: Kube, namespace: str, operator, console: str, page: Page) -> None:  # type: ignore[no-untyped-def]
    runs.create(kube, namespace, runs.example("short-job.yaml", payload={"steps": 60, "stepSeconds": 1}))
    runs.wait_phase(kube, namespace, "short-job", "Running", timeout=60)
    page.goto(console)
    page.goto(page.url.rstrip("/") + f"/runs/{namespace}/short-job")
    page.click("#controls >> text=Suspend")
    expect(page.locator("#controls")).to_contain_text("Resume", timeout=15_000)
    assert runs.get(kube, namespace, "short-job")["spec"]["suspend"] is True
    page.once("dialog", lambda d: d.accept())
    page.click("#controls >> text=Stop")
    expect(page.locator("#phase")).to_have_text("Cancelled", timeout=60_000)
    assert runs.get(kube, namespace, "short-job")["spec"]["stop"] is True


@pytest.mark.local_cluster
@pytest.mark.parametrize("namespace", ["nightly-reports"], indirect=True)  # screenshots: a user's namespace
def test_the_timeline_of_a_frozen_and_lost_worker(kube: Kube, namespace: str, operator, console: str,  # type: ignore[no-untyped-def]
                                                  page: Page) -> None:
    # No outFile in the payload: the page shows it, and it would be a pytest temporary path.
    runs.create(kube, namespace, app_run("invoice-export", {"holdAttempts": [1], "usageCents": 4,
                                                            "checkpoint": "row-17", "workSeconds": 2}, duration=8))
    runs.wait_phase(kube, namespace, "invoice-export", "Running", timeout=30)
    pod = kube.ok(kube.get(f"/api/v1/namespaces/{namespace}/pods/invoice-export-a1"))
    pid = int(pod["status"]["containerStatuses"][0]["containerID"].removeprefix("process://"))
    try:
        page.goto(console)
        page.goto(page.url.rstrip("/") + f"/runs/{namespace}/invoice-export")
        expect(page.locator("svg.timeline rect[data-outcome=Running]")).to_have_count(1)
        os.kill(pid, signal.SIGSTOP)  # frozen: no more renewals, the lease lapses
        # Drawn live as the operator revokes attempt 1 and attempt 2 finishes.
        expect(page.locator("svg.timeline rect[data-outcome=LeaseLost]")).to_have_count(1, timeout=60_000)
        expect(page.locator("svg.timeline rect[data-outcome=Succeeded]")).to_have_count(1, timeout=60_000)
    finally:
        # Revocation deleted its pod, so the kubelet may have ended the frozen process already.
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    expect(page.locator("#phase")).to_have_text("Succeeded")
    expect(page.locator('svg.timeline .mark[data-kind="lapse"]')).to_have_count(1)
    expect(page.locator('svg.timeline .mark[data-kind="revoked"]')).to_have_count(2)
    expect(page.locator("svg.usage .checkpoint")).not_to_have_count(0)
    expect(page.locator("#events")).to_contain_text("LeaseLost")
    expect(page.locator("#conditions")).to_contain_text("Succeeded")
    _screenshot(page, "console-run.png", full_page=True)


def _gateway(namespace: str, tmp_path: Path) -> Any:
    from tests.e2e.test_ship import _free_port
    from testkit.operator_process import OperatorProcess

    port = _free_port()
    op = OperatorProcess(namespace, os.environ["TETHER_TEST_KUBECONFIG"], tmp_path / "op.log",
                         extra_args=[f"--gateway-port={port}", "--gateway-host=127.0.0.1"],
                         extra_env={"TETHER_FOLD_INTERVAL_SECONDS": "1"}).start()
    eventually(lambda: _up(f"http://127.0.0.1:{port}"), timeout=30, what="the gateway")
    return op, f"http://localhost:{port}/console"


@pytest.mark.local_cluster  # its own operator process serves the gateway
def test_the_console_behind_the_gateway_signs_in_with_a_token(kube: Kube, namespace: str, tmp_path: Path,
                                                              alice: tuple[str, str, Path], browser: Browser) -> None:
    username, token, _ = alice
    op, url = _gateway(namespace, tmp_path)
    context = browser.new_context()
    try:
        page = context.new_page()
        page.goto(url + "/")
        assert page.url.endswith("/console/login")
        page.fill("textarea[name=token]", "not-a-token")
        page.click("text=Log in")
        expect(page.locator("#login-error")).to_contain_text("not valid")
        assert context.cookies() == []

        # All namespaces: alice may list runs in hers only, and the console has no other rights.
        page.fill("textarea[name=token]", token)
        page.click("text=Log in")
        expect(page.locator("header .who")).to_contain_text(f"{username} · all namespaces")
        expect(page.locator("#errors")).to_contain_text("forbidden")
        (cookie,) = [c for c in context.cookies() if c["name"] == "tether_console"]
        assert cookie["httpOnly"] and cookie["secure"] and cookie["sameSite"] == "Strict"
        page.click("text=log out")

        page.fill("textarea[name=token]", token)
        page.fill("input[name=namespace]", namespace)
        page.click("text=Log in")
        runs.create(kube, namespace, _gated())
        expect(_phase_cell(page, namespace, "short-job")).to_have_text("AwaitingApproval", timeout=30_000)
        expect(page.locator("#errors")).to_be_empty()
        page.click(f'tr[data-key="{namespace}/short-job"] a')
        form = page.locator('#review form.decide[data-gate="Start"]')
        form.locator("input[name=reason]").fill("too expensive")
        form.locator("button.deny").click()
        expect(page.locator("#flash")).to_contain_text("Deny Start of short-job (attempt 0) recorded")
        expect(page.locator("#phase")).to_have_text("Rejected", timeout=30_000)
        (approval,) = kube.ok(kube.get(APPROVALS.format(ns=namespace)))["items"]
        assert approval["spec"]["approver"] == username  # the user's own token, not the operator's
    finally:
        context.close()
        op.stop()
