"""Adversarial review of the web console: each test is a defect the console has now (they fail
until it is fixed). No cluster: the Kubernetes API is the unit tests' fake API (testkit/fakeapi.py)."""

from __future__ import annotations

import asyncio
import datetime as dt
import re
import ssl
import time
from html.parser import HTMLParser
from typing import Any

import httpx
import pytest
from starlette.testclient import TestClient
from tether.console import app as console_app
from tether.console import security, views
from tether.console.app import build_gateway_console, build_local_app
from tether.console.state import Scope, Watch
from tether.gateway import auth as gateway_auth
from tether.kube.config import KubeConfig
from testkit.fakeapi import FakeApi, Request

PORT = 8123
HOST = security.local_host(PORT)
RUNS = "/apis/tether.dev/v1alpha1/namespaces/agents/workerruns"


def _run(name: str = "job", uid: str = "uid-old", **status: Any) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "agents", "uid": uid, "resourceVersion": "1",
                         "creationTimestamp": "2026-12-01T12:00:00Z"}, "spec": {}, "status": status}


def console_api(listed: list[dict[str, Any]], current: dict[str, Any] | None = None) -> FakeApi:
    """The API server as the console's user sees it: it lists `listed`, and holds `current` as the
    run named job *now* (a namesake may have replaced the one a page showed). It refuses watches
    (the console lists again), and says who the user is."""
    api = FakeApi()
    if current is not None:
        api.put(f"{RUNS}/{current['metadata']['name']}", current)

    def user(req: Request) -> tuple[int, dict[str, Any]] | None:
        if req.method == "GET" and req.params.get("watch"):
            return 403, {"kind": "Status", "code": 403, "message": "watch refused"}
        if req.method == "GET" and req.path == RUNS:
            return 200, {"kind": "List", "metadata": {"resourceVersion": "1"}, "items": listed}
        if req.path.endswith("/selfsubjectreviews"):
            return 201, {"status": {"userInfo": {"username": "alice"}}}
        return None

    api.before(user)
    return api


def _writes(api: FakeApi, method: str, plural: str) -> list[Any]:
    return [r.body for r in api.requests if r.method == method and f"/{plural}" in r.path]


def _local(api: FakeApi) -> tuple[Any, str]:
    cfg = KubeConfig(server="https://api", ssl_context=ssl.create_default_context())
    secret = security.new_secret()
    app = build_local_app(cfg, "agents", HOST, secret)
    app.state.backend.scope = Scope(httpx.AsyncClient(base_url="https://api",
                                                      transport=httpx.MockTransport(api.handle)), "agents")
    return app, secret


def _signed_in(app: Any, secret: str) -> TestClient:
    client = TestClient(app, base_url=f"http://{HOST}", follow_redirects=False)
    client.cookies.set(security.SESSION_COOKIE, secret)
    return client


WRITE = {"x-tether-console": "1"}


# --- 1. a namesake re-created between render and click is the one approved ----------------------


def test_the_decision_form_names_the_run_uid_it_shows() -> None:
    form = views.decision_form("", _run(phase="AwaitingApproval"), {"gate": "Start", "attempt": 0})
    assert 'data-uid="uid-old"' in form, form


def test_a_decision_for_a_run_that_was_replaced_by_a_namesake_is_refused() -> None:
    """The reviewer looked at run uid-old (its image, its result) and clicked Approve; meanwhile
    job was deleted and re-created (uid-new, also AwaitingApproval at attempt 0). The console
    must not approve uid-new's start: the reviewer never saw it."""
    api = console_api([_run(phase="AwaitingApproval")], current=_run(uid="uid-new", phase="AwaitingApproval"))
    app, secret = _local(api)
    with _signed_in(app, secret) as client:
        resp = client.post("/api/runs/agents/job/decide", headers=WRITE,
                           json={"gate": "Start", "attempt": 0, "decision": "Approve", "reason": "ok",
                                 "uid": "uid-old"})
    approvals = _writes(api, "POST", "workerrunapprovals")
    assert not approvals, f"approved a run the page never showed: {approvals} ({resp.status_code} {resp.text})"
    assert resp.status_code in (409, 412, 400)


def test_stop_names_the_run_uid_the_page_showed() -> None:
    """Stop is a merge patch by name only: a namesake created since the page rendered is the one
    stopped. The patch must carry the UID as a precondition (metadata.uid: the API server then
    answers 409 for another object)."""
    run = _run(phase="Running")
    api = console_api([run], current=_run(uid="uid-new", phase="Running"))
    app, secret = _local(api)
    with _signed_in(app, secret) as client:
        client.post("/api/runs/agents/job/stop", headers=WRITE, json={"uid": "uid-old"})
    (patch,) = _writes(api, "PATCH", "workerruns")
    assert (patch.get("metadata") or {}).get("uid") == "uid-old", f"patched by name only: {patch}"
    held = api.get(f"{RUNS}/job")
    assert held is not None and not (held.get("spec") or {}).get("stop"), "the namesake was stopped"
    controls = views.run_fragments("", run, [], [], dt.datetime.now(dt.UTC))["controls"]
    assert "uid-old" in controls, f"the Stop button does not say which run it stops: {controls}"


# --- 2. Enter in the reason field approves ---------------------------------------------------------


class _Buttons(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.buttons: list[dict[str, str | None]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "button":
            self.buttons.append(dict(attrs))


def test_pressing_enter_in_the_reason_does_not_approve() -> None:
    """A reviewer types "not safe, leaks PII" and presses Enter: implicit submission uses the
    form's first submit button as e.submitter, which is Approve, and console.js posts
    decision=e.submitter.value. The intended Deny becomes an Approve."""
    parser = _Buttons()
    parser.feed(views.decision_form("", _run(phase="AwaitingApproval"), {"gate": "Start", "attempt": 0}))
    default = parser.buttons[0]
    assert "disabled" in default or default.get("value") != "Approve", (
        f"the form's default button (Enter) is {default}")


# --- 3. framing (clickjacking) --------------------------------------------------------------------


def test_pages_may_not_be_framed() -> None:
    """No X-Frame-Options / CSP frame-ancestors: a page on the same site (another port of
    127.0.0.1, a sibling host behind the gateway: SameSite=Strict cookies are sent) can frame the
    console and have the user click Suspend/Resume or Approve."""
    api = console_api([_run(phase="Running")], current=_run(phase="Running"))
    app, secret = _local(api)
    with _signed_in(app, secret) as client:
        resp = client.get("/runs/agents/job")
    assert resp.status_code == 200
    csp = resp.headers.get("content-security-policy", "")
    assert resp.headers.get("x-frame-options", "").upper() in ("DENY", "SAMEORIGIN") or "frame-ancestors" in csp, \
        dict(resp.headers)


# --- 4. the local session cookie reaches every port of 127.0.0.1 ------------------------------------


def test_the_local_session_cookie_is_not_sent_to_other_ports() -> None:
    """Cookies are not kept apart by port (RFC 6265 §8.5): the session cookie set for 127.0.0.1
    (or localhost) is sent by the browser to any server on 127.0.0.1, e.g. one another user of the
    machine runs on port 9000; that user then replays it to 127.0.0.1:8123 and acts with the
    victim's kubeconfig. A unique host name per console (tether-<random>.localhost) or no cookie
    (a capability URL) keeps the credential to this console.

    The design chosen: a unique host name. So no cookie is ever set for a shared name (those are
    refused before the token is looked at), and the one set is host-only for a name of this
    console alone, unguessable, which no other server is reached by."""
    cfg = KubeConfig(server="https://api", ssl_context=ssl.create_default_context())
    secret = security.new_secret()
    hosts = {security.local_host(PORT) for _ in range(3)}
    assert len(hosts) == 3, "two consoles share a host name"
    for host in hosts:
        name = host.rsplit(":", 1)[0]
        assert re.fullmatch(r"tether-[0-9a-f]{16}\.localhost", name), host
        app = build_local_app(cfg, "agents", host, secret)
        for shared in (f"127.0.0.1:{PORT}", f"localhost:{PORT}", f"tether.localhost:{PORT}", name):
            client = TestClient(app, base_url=f"http://{shared}", follow_redirects=False)
            assert client.get("/", params={"token": secret}).status_code == 421, shared
            assert not client.cookies.jar, f"a cookie was set for {shared}"
        client = TestClient(app, base_url=f"http://{host}", follow_redirects=False)
        resp = client.get("/", params={"token": secret})
        assert resp.status_code == 303
        assert "domain=" not in resp.headers["set-cookie"].lower()  # host-only: no sibling name gets it
        assert [c.domain for c in client.cookies.jar if c.value == secret] == [name]


# --- 5. behind the gateway: sign-in, scopes and tokens ---------------------------------------------


def token_api(valid: dict[str, str]) -> FakeApi:
    """The operator's side of the API as the console behind the gateway uses it: TokenReview, by
    `valid` (token -> user name; a token removed from it has expired)."""
    api = FakeApi()

    def review(req: Request) -> tuple[int, dict[str, Any]] | None:
        if not req.path.endswith("/tokenreviews"):
            return None
        user = valid.get(req.body["spec"]["token"])
        return 201, {"status": {"authenticated": user is not None, "user": {"username": user or "", "uid": user or ""}}}

    api.before(review)
    return api


@pytest.fixture
def gateway(monkeypatch: pytest.MonkeyPatch) -> tuple[Any, dict[str, str]]:
    """The /console app; every user's pass-through client answers from a stub refusing everything
    (the sign-in and scope bookkeeping is what is under test)."""
    real = httpx.AsyncClient

    def client(*args: Any, **kw: Any) -> httpx.AsyncClient:
        kw.pop("verify", None)
        kw.setdefault("transport", httpx.MockTransport(
            lambda request: httpx.Response(403, json={"message": "forbidden (stub)"})))
        return real(*args, **kw)

    monkeypatch.setattr(console_app.httpx, "AsyncClient", client)
    monkeypatch.setattr(gateway_auth, "CACHE_SECONDS", 0.0)  # every request reviews the token again
    valid = {"alice-token": "alice", "mallory-token": "mallory"}
    return build_gateway_console(token_api(valid).client()), valid


def _as(app: Any, token: str, namespace: str = "") -> TestClient:
    client = TestClient(app, base_url="https://gw.example", follow_redirects=False)
    client.cookies.set(console_app.TOKEN_COOKIE, token)
    client.cookies.set(console_app.NAMESPACE_COOKIE, namespace)
    return client


def test_one_user_cannot_take_every_console_slot(gateway: tuple[Any, dict[str, str]],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Scopes are keyed by (token, namespace cookie) and capped at MAX_SCOPES for the whole
    gateway: any valid token (any service account's, no RBAC needed) forging N namespace cookies
    holds N scopes (3 watches each, retried forever) and locks every other user out with 503."""
    app, _ = gateway
    monkeypatch.setattr(console_app, "MAX_SCOPES", 5)
    with TestClient(app, base_url="https://gw.example") as portal:
        for i in range(5):
            portal.cookies.set(console_app.TOKEN_COOKIE, "mallory-token")
            portal.cookies.set(console_app.NAMESPACE_COOKIE, f"ns-{i}")
            portal.get("/budgets")
        portal.cookies.set(console_app.TOKEN_COOKIE, "alice-token")
        portal.cookies.set(console_app.NAMESPACE_COOKIE, "")
        resp = portal.get("/budgets", follow_redirects=False)
    assert resp.status_code == 200, f"alice locked out by mallory: {resp.status_code} {resp.text}"


def test_an_expired_token_stops_its_watches(gateway: tuple[Any, dict[str, str]]) -> None:
    """alice's token expires (or is revoked): the next request sends her to the login page, but
    her scope stays registered and its three watches keep calling the API server with the dead
    token (retrying forever), until some *other* user signs in after 5 idle minutes."""
    app, valid = gateway
    backend = app.state.backend
    with TestClient(app, base_url="https://gw.example", follow_redirects=False) as portal:
        portal.cookies.set(console_app.TOKEN_COOKIE, "alice-token")
        assert portal.get("/budgets").status_code == 200
        assert len(backend.scopes) == 1
        del valid["alice-token"]
        assert portal.get("/budgets").status_code == 303  # to the login page
    assert not backend.scopes, "the expired token's watches still run"


def test_logout_ends_every_watch_made_with_the_token(gateway: tuple[Any, dict[str, str]]) -> None:
    """alice signed in for namespace a, then again for namespace b (the login form, or another
    tab): log out closes only the (token, b) scope; the gateway keeps watching namespace a with
    her token after she logged out."""
    app, _ = gateway
    backend = app.state.backend
    with TestClient(app, base_url="https://gw.example", follow_redirects=False) as portal:
        portal.cookies.set(console_app.TOKEN_COOKIE, "alice-token")
        for ns in ("a", "b"):
            portal.cookies.set(console_app.NAMESPACE_COOKIE, ns)
            assert portal.get("/budgets").status_code == 200
        assert portal.post("/logout", headers=WRITE).status_code == 303
    assert not backend.scopes, f"still watching with a logged-out token: {list(backend.scopes)}"


def test_an_oversized_login_is_refused_before_it_is_read(gateway: tuple[Any, dict[str, str]]) -> None:
    """/console/login is reachable without signing in (curl sets the X-Tether-Console header), and
    it reads the whole body into memory before comparing it with MAX_FORM_BYTES: a 1 GB POST is
    buffered by the process that is also every external worker's gateway."""
    app, _ = gateway
    chunk = b"a" * (64 * 1024)
    chunks = 64  # 4 MiB, 64x the limit
    read = 0
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        nonlocal read
        read += 1
        return {"type": "http.request", "body": chunk, "more_body": read < chunks}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "https", "path": "/login", "raw_path": b"/login", "root_path": "", "query_string": b"",
             "headers": [(b"host", b"gw.example"), (b"x-tether-console", b"1"),
                         (b"content-type", b"application/x-www-form-urlencoded"),
                         (b"content-length", str(len(chunk) * chunks).encode())],
             "client": ("10.0.0.9", 5555), "server": ("gw.example", 443)}
    asyncio.run(app(scope, receive, send))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    assert status == 413
    assert read <= 2, f"read {read} chunks ({read * len(chunk)} bytes) of a body declared 4 MiB before refusing it"


# --- 6. what was seen stays shown after the API server refuses -------------------------------------


def test_a_refused_list_forgets_what_was_listed_before() -> None:
    """alice's RoleBinding is removed (or her token expires): the next list answers 403, the page
    shows the refusal... next to every run it listed before, and new page loads (her token is
    still valid) keep serving them. The console shows what RBAC no longer allows."""
    calls: list[str] = []

    def api(request: httpx.Request) -> httpx.Response:
        watch = bool(request.url.params.get("watch"))
        calls.append("watch" if watch else "list")
        if calls.count("list") == 1 and not watch:
            return httpx.Response(200, json={"metadata": {"resourceVersion": "5"}, "items": [_run(phase="Running")]})
        return httpx.Response(403, json={"message": 'workerruns is forbidden: User "alice" cannot list'})

    async def go() -> dict[str, Any]:
        async with httpx.AsyncClient(base_url="https://api", transport=httpx.MockTransport(api)) as http:
            watch = Watch(http, RUNS, lambda key, obj: None)
            task = asyncio.create_task(watch.run())
            deadline = time.monotonic() + 3.0
            while (calls.count("list") < 2 or not watch.error) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            task.cancel()
            assert calls.count("list") >= 2, calls
            assert watch.error and "403" in watch.error
            return dict(watch.objects)

    objects = asyncio.run(go())
    assert not objects, f"still served after the API server refused the list: {list(objects)}"


# --- the fixes' own guarantees beyond the findings -------------------------------------------------


def test_held_tokens_are_reviewed_again_without_a_request(gateway: tuple[Any, dict[str, str]],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """alice's tab is closed (no further request): her token's expiry still ends her watches."""
    app, valid = gateway
    backend = app.state.backend
    monkeypatch.setattr(console_app, "SWEEP_SECONDS", 0.05)
    with TestClient(app, base_url="https://gw.example", follow_redirects=False) as portal:
        portal.cookies.set(console_app.TOKEN_COOKIE, "alice-token")
        assert portal.get("/budgets").status_code == 200
        del valid["alice-token"]
        deadline = time.monotonic() + 3.0
        while backend.scopes and time.monotonic() < deadline:
            time.sleep(0.05)
    assert not backend.scopes, "an expired token's watches outlive it until its user comes back"


def test_a_closed_scope_ends_its_open_streams() -> None:
    """Logout or an expired token closes the scope: a page's event stream must end with it, not
    stay live (the browser reconnects and is sent to sign in)."""
    async def go() -> list[str]:
        http = httpx.AsyncClient(base_url="https://api", transport=httpx.MockTransport(console_api([]).handle))
        scope = Scope(http, "agents")
        session = console_app.Session(scope, "alice")
        stream = console_app._stream(session, scope.listen(), lambda keys: [], 0.0)
        sent = [await stream.__anext__()]
        rest = asyncio.ensure_future(_drain(stream))
        for _ in range(3):
            await asyncio.sleep(0)  # let the drain reach its wait on the stream (no time passes)
        await scope.close()
        sent += await asyncio.wait_for(rest, timeout=2.0)
        assert not scope.listeners
        return sent

    async def _drain(stream: Any) -> list[str]:
        return [message async for message in stream]

    assert asyncio.run(go()) == ["retry: 1000\n\n"]


def test_one_user_holds_at_most_a_few_scopes(gateway: tuple[Any, dict[str, str]]) -> None:
    app, _ = gateway
    backend = app.state.backend
    with TestClient(app, base_url="https://gw.example", follow_redirects=False) as portal:
        portal.cookies.set(console_app.TOKEN_COOKIE, "mallory-token")
        for i in range(console_app.MAX_USER_SCOPES + 3):
            portal.cookies.set(console_app.NAMESPACE_COOKIE, f"ns-{i}")
            assert portal.get("/budgets").status_code == 200  # the least recently used idle one made way
        assert len(backend.scopes) == console_app.MAX_USER_SCOPES
        portal.cookies.set(console_app.NAMESPACE_COOKIE, "../../api/v1/secrets")
        assert portal.get("/budgets").status_code == 303  # not a namespace: sign in again
        assert len(backend.scopes) == console_app.MAX_USER_SCOPES


def test_an_oversized_decision_is_refused_and_refusals_carry_the_guards() -> None:
    app, secret = _local(console_api([_run(phase="AwaitingApproval")], current=_run(phase="AwaitingApproval")))
    with _signed_in(app, secret) as client:
        resp = client.post("/api/runs/agents/job/decide", headers=WRITE, content=b"{" + b" " * 70_000 + b"}")
        assert resp.status_code == 413
        missing = client.post("/api/runs/agents/job/stop", headers=WRITE, json={})
        assert missing.status_code == 422, "a control that names no run UID"
        other = TestClient(app, base_url=f"http://127.0.0.1:{PORT}").get("/")
    assert other.status_code == 421 and other.headers["x-frame-options"] == "DENY"
