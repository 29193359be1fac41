"""The console's web app: pages, Server-Sent Events and actions, for two ways of signing in.

- Local (`kubectl tether ui`): the user's kubeconfig; one session, proven by the token in the URL
  the plugin printed (then an HttpOnly SameSite=Strict cookie); served on 127.0.0.1 only, under
  its own random host name only (tether-<random>.localhost, see security).
- Behind the gateway (/console): each user pastes a Kubernetes bearer token, checked with
  TokenReview, kept in an HttpOnly Secure SameSite=Strict cookie, and every API call is made with
  that token (pass-through): the console never acts with the operator's identity.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import functools
import hashlib
import json
import logging
import re
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Protocol
from urllib.parse import parse_qs, urlencode

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope as AsgiScope, Send

from tether.console import logs, security, views
from tether.console.actions import CONTROLS, ActionError, Replaced, control, record_decision, whoami
from tether.console.state import Listener, Scope, object_key
from tether.gateway.app import BodyTooLarge, read_body
from tether.gateway.auth import AuthError, Authenticator
from tether.kube.client import ApiError, KubeClient
from tether.kube.config import KubeConfig

log = logging.getLogger("tether.console")

STATIC = Path(__file__).parent / "static"
KEEPALIVE_SECONDS = 15.0
# A burst of watch events becomes one message per stream: at most one per this many seconds.
COALESCE_SECONDS = {"runs": 0.25, "run": 0.25, "schedules": 1.0, "budgets": 1.0, "review": 0.5}
# Behind the gateway:
IDLE_SCOPE_SECONDS = 300.0  # a signed-in user's watches outlive their last tab this long
MAX_SCOPES = 200  # scopes that list something (a refused one costs a retry a while), for everyone at once
MAX_USER_SCOPES = 4  # one user's (namespaces and tokens): nobody takes every slot
SWEEP_SECONDS = 60.0  # how often held tokens are reviewed again and idle scopes closed
TOKEN_COOKIE, NAMESPACE_COOKIE = "tether_console", "tether_console_ns"
NAMESPACE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")  # a DNS label, as namespaces are named
MAX_FORM_BYTES = 64 * 1024


@dataclass(frozen=True)
class Session:
    scope: Scope
    who: str  # the user's name as the API server knows it


class Backend(Protocol):
    logout: bool

    async def session(self, request: Request) -> Session | Response: ...


class Guard:
    """Host (DNS rebinding) and write (CSRF) checks before anything else runs, and on every answer
    the headers that keep it out of other sites' frames (security.HEADERS)."""

    def __init__(self, app: ASGIApp, hosts: frozenset[str] | None) -> None:
        self.app, self.hosts = app, hosts

    async def __call__(self, scope: AsgiScope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def guarded(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *security.HEADERS]}
            await send(message)

        request = Request(scope)
        host = request.headers.get("host")
        if not security.host_allowed(host, self.hosts):
            await PlainResponse("unknown host name: open the URL kubectl tether ui printed", 421)(
                scope, receive, guarded)
        elif not security.write_allowed(request.method, request.headers, host or ""):
            await PlainResponse("cross-site request refused", 403)(scope, receive, guarded)
        else:
            await self.app(scope, receive, guarded)


def PlainResponse(text: str, status: int) -> Response:  # reads as the response class it returns
    return Response(text, status_code=status, media_type="text/plain")


def _base(request: Request) -> str:
    return str(request.scope.get("root_path", "")).rstrip("/")


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


class LocalBackend:
    """One user (the kubeconfig's), one namespace scope, one session cookie."""

    logout = False

    def __init__(self, cfg: KubeConfig, namespace: str | None, secret: str) -> None:
        self.scope = Scope(cfg.async_client(timeout=10.0), namespace)
        self.secret = secret
        self.who: str | None = None

    async def session(self, request: Request) -> Session | Response:
        offered = request.query_params.get("token")
        if offered is not None:
            if not security.same_secret(offered, self.secret):
                return PlainResponse("wrong token: open the URL kubectl tether ui printed", 401)
            # The token leaves the address bar (and history) at once; the cookie carries the session.
            response = RedirectResponse(request.url.path, status_code=303)
            # Host-only: it goes to this console's own name, never to 127.0.0.1 or localhost.
            response.set_cookie(security.SESSION_COOKIE, self.secret, httponly=True, samesite="strict", path="/")
            return response
        if not security.same_secret(request.cookies.get(security.SESSION_COOKIE), self.secret):
            return PlainResponse("no session: open the URL kubectl tether ui printed", 401)
        if self.who is None:
            try:
                self.who = await whoami(self.scope.http)
            except (ActionError, httpx.HTTPError):
                self.who = "?"  # shown only; the API server still decides everything with the kubeconfig
        self.scope.start()
        return Session(self.scope, self.who)


def without_client_certificate(ctx: ssl.SSLContext) -> ssl.SSLContext:
    """The server's trust settings without its own client certificate: a pass-through request
    must authenticate as the user's token alone (the API server prefers a certificate)."""
    cas = ctx.get_ca_certs(binary_form=True)
    fresh = ssl.create_default_context(cadata=b"".join(cas)) if cas else ssl.create_default_context()
    fresh.check_hostname = ctx.check_hostname
    fresh.verify_mode = ctx.verify_mode
    return fresh


@dataclass(frozen=True)
class Opened:
    evicted: list[Scope]  # to close (idle), whether or not the new scope was opened
    scope: Scope | Response  # the new scope, or why there is none


class ScopeKey(NamedTuple):
    token: str  # its SHA-256: tokens are never kept as keys
    user: str  # whom the token names
    namespace: str


class GatewayBackend:
    """Each user signs in with their own bearer token; their watches and writes use it."""

    logout = True

    def __init__(self, cfg: KubeConfig, authenticator: Authenticator) -> None:
        self.cfg, self.authenticator = cfg, authenticator
        self.scopes: dict[ScopeKey, Scope] = {}
        self._sweeper: asyncio.Task[None] | None = None

    @functools.cached_property
    def verify(self) -> ssl.SSLContext:
        """Made at the first sign-in, not when the gateway is built: a gateway whose console nobody
        opens never needs it."""
        return without_client_certificate(self.cfg.ssl_context)

    @staticmethod
    def _digest(token: str) -> str:
        return hashlib.sha256(token.encode()).hexdigest()

    async def session(self, request: Request) -> Session | Response:
        token = request.cookies.get(TOKEN_COOKIE)
        if not token:
            return self._to_login(request)
        digest = self._digest(token)
        try:
            caller = await self.authenticator.authenticate(f"Bearer {token}")
        except AuthError:
            await self._end(digest)  # expired or revoked since: nothing goes on calling the API server with it
            return self._to_login(request)
        namespace = request.cookies.get(NAMESPACE_COOKIE, "")
        if namespace and not NAMESPACE.fullmatch(namespace):
            return self._to_login(request)
        key = ScopeKey(digest, caller.username, namespace)
        scope = self.scopes.get(key)
        if scope is None:
            opened = self._open(key, token)
            await self._close_all(opened.evicted)
            if isinstance(opened.scope, Response):
                return opened.scope
            scope = opened.scope
        scope.last_used = time.monotonic()
        scope.start()
        return Session(scope, caller.username)

    def _open(self, key: ScopeKey, token: str) -> Opened:
        """Adds the key's scope, or says why not. No await from the caller's lookup to here: two
        first requests at once get one scope, not two of which one is never closed."""
        evicted = self._take_idle()
        mine = sorted((k for k in self.scopes if k.user == key.user), key=lambda k: self.scopes[k].last_used)
        if len(mine) >= MAX_USER_SCOPES:
            idle = [k for k in mine if not self.scopes[k].listeners]
            if not idle:
                return Opened(evicted, PlainResponse(
                    "you watch too many namespaces at once here: close other console pages", 429))
            evicted.append(self.scopes.pop(idle[0]))  # the user's least recently used
        # A scope counts once it lists something: one the API server refuses holds no slot.
        if sum(s.runs.listed for s in self.scopes.values()) >= MAX_SCOPES:
            return Opened(evicted, PlainResponse("too many console users signed in right now; try again later", 503))
        client = httpx.AsyncClient(base_url=self.cfg.server, verify=self.verify, timeout=10.0,
                                   headers={"Authorization": f"Bearer {token}"})
        scope = self.scopes[key] = Scope(client, key.namespace or None)
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.create_task(self._sweep())
        return Opened(evicted, scope)

    def _take(self, chosen: Callable[[ScopeKey], bool]) -> list[Scope]:
        return [self.scopes.pop(k) for k in [k for k in self.scopes if chosen(k)]]

    def _take_idle(self) -> list[Scope]:
        """The scopes no page has streamed from for IDLE_SCOPE_SECONDS."""
        now = time.monotonic()
        return self._take(lambda k: not self.scopes[k].listeners and now - self.scopes[k].last_used > IDLE_SCOPE_SECONDS)

    async def _close(self, chosen: Callable[[ScopeKey], bool]) -> None:
        await self._close_all(self._take(chosen))

    async def _end(self, digest: str) -> None:
        """Closes every scope of one token."""
        await self._close(lambda key: key.token == digest)

    @staticmethod
    async def _close_all(scopes: list[Scope]) -> None:
        for scope in scopes:
            await scope.close()  # its watches stop and its open pages' streams end

    async def _sweep(self) -> None:
        """While any scope is held: closes idle ones, and every scope of a token the API server no
        longer accepts (its watches would call it forever, its open pages would stay live)."""
        while self.scopes:
            await asyncio.sleep(SWEEP_SECONDS)  # the sweep's pace, not a wait for a condition
            await self._close_all(self._take_idle())
            held = {k.token: s.http.headers["authorization"] for k, s in self.scopes.items()}
            for digest, header in held.items():
                try:
                    await self.authenticator.authenticate(header)
                except AuthError:
                    await self._end(digest)
                except (ApiError, httpx.HTTPError) as exc:
                    log.warning("console token review failed: %s", exc, extra={"event": "console_review_failed"})

    def _to_login(self, request: Request) -> Response:
        if request.url.path.endswith(("/events", "/logs")) or request.method != "GET":
            return PlainResponse("sign in again", 401)
        return RedirectResponse(f"{_base(request)}/login", status_code=303)

    async def login_page(self, request: Request) -> Response:
        return HTMLResponse(views.login_page(_base(request)))

    async def login(self, request: Request) -> Response:
        try:
            body = await read_body(request, MAX_FORM_BYTES)
        except BodyTooLarge as exc:
            return PlainResponse(str(exc), 413)
        form = {k: v[0] for k, v in parse_qs(body.decode(errors="replace")).items()}
        token, namespace = form.get("token", "").strip(), form.get("namespace", "").strip()
        if namespace and not NAMESPACE.fullmatch(namespace):
            return HTMLResponse(views.login_page(_base(request), f"{namespace!r} is not a namespace name"),
                                status_code=422)
        try:
            await self.authenticator.authenticate(f"Bearer {token}")
        except AuthError as exc:
            return HTMLResponse(views.login_page(_base(request), exc.message), status_code=401)
        replaced = request.cookies.get(TOKEN_COOKIE)
        if replaced:  # the browser's pages now act with the new cookies: the old ones' watches end
            await self._end(self._digest(replaced))
        response = RedirectResponse(f"{_base(request)}/", status_code=303)
        path = f"{_base(request)}/"
        response.set_cookie(TOKEN_COOKIE, token, httponly=True, secure=True, samesite="strict", path=path)
        response.set_cookie(NAMESPACE_COOKIE, namespace, httponly=True, secure=True, samesite="strict", path=path)
        return response

    async def logout_(self, request: Request) -> Response:
        token = request.cookies.get(TOKEN_COOKIE)
        if token:  # every scope made with the token, whatever namespace each was for
            await self._end(self._digest(token))
        response = RedirectResponse(f"{_base(request)}/login", status_code=303)
        for name in (TOKEN_COOKIE, NAMESPACE_COOKIE):
            response.delete_cookie(name, path=f"{_base(request)}/", secure=True, httponly=True, samesite="strict")
        return response

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        await self._close(lambda _: True)


Handler = Callable[[Request, Session], Awaitable[Response]]


def _signed_in(backend: Backend, handler: Handler) -> Callable[[Request], Awaitable[Response]]:
    async def call(request: Request) -> Response:
        session = await backend.session(request)
        if isinstance(session, Response):
            return session
        return await handler(request, session)

    return call


def _scope_label(session: Session) -> str:
    return f"{session.who} · {f'namespace {session.scope.namespace}' if session.scope.namespace else 'all namespaces'}"


def _runs(session: Session) -> list[dict[str, Any]]:
    return list(session.scope.runs.objects.values())


def _sse(event: str, data: Any) -> str:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n"


class Pages:
    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    def _shell(self, request: Request, session: Session, title: str, page: str, events: str, body: str) -> Response:
        base = _base(request)
        return HTMLResponse(views.shell(base, title, page, f"{base}/events?{events}", body, _scope_label(session),
                                        session.scope.errors(), self.backend.logout),
                            headers={"Cache-Control": "no-store"})

    async def runs(self, request: Request, session: Session) -> Response:
        f = views.Filters.of(request.query_params)
        await _synced(session)
        budgets = sorted({views.budget_of(r) for r in _runs(session)} - {""}
                         | {b["metadata"]["name"] for b in session.scope.budgets.objects.values()})
        body = views.runs_page(_base(request), _runs(session), f, session.scope.namespace, budgets,
                               session.scope.lease_of)
        return self._shell(request, session, "Runs", "runs", "&".join(filter(None, ["page=runs", f.query()])), body)

    async def run(self, request: Request, session: Session) -> Response:
        ns, name = request.path_params["namespace"], request.path_params["name"]
        await _synced(session)
        body = views.run_page(_base(request), ns, name, _run_fragments(request, session, ns, name))
        return self._shell(request, session, f"{ns}/{name}", "run", urlencode({"page": "run", "namespace": ns, "name": name}), body)

    async def budgets(self, request: Request, session: Session) -> Response:
        await _synced(session)
        body = f'<div id="budgets">{_budgets_fragment(request, session)}</div>'
        return self._shell(request, session, "Budgets", "budgets", "page=budgets", body)

    async def schedules(self, request: Request, session: Session) -> Response:
        await _synced(session)
        body = f'<div id="schedules">{_schedules_fragment(request, session)}</div>'
        return self._shell(request, session, "Schedules", "schedules", "page=schedules", body)

    async def review(self, request: Request, session: Session) -> Response:
        await _synced(session)
        body = f'<h2>Review queue <span class="muted">oldest first</span></h2><div id="queue">' \
               f'{views.review_fragment(_base(request), _runs(session))}</div>'
        return self._shell(request, session, "Review queue", "review", "page=review", body)

    async def events(self, request: Request, session: Session) -> Response:
        page = request.query_params.get("page", "runs")
        if page not in COALESCE_SECONDS:
            return PlainResponse("unknown page", 404)
        render = _renderer(request, session, page)
        listener = session.scope.listen()
        return StreamingResponse(_stream(session, listener, render, COALESCE_SECONDS[page]),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})

    async def logs(self, request: Request, session: Session) -> Response:
        """An attempt's worker logs as plain text (GET: reads only, with the session's credential)."""
        ns, name = request.path_params["namespace"], request.path_params["name"]
        await _synced(session)
        run = session.scope.runs.objects.get(f"{ns}/{name}")
        if run is None:
            return PlainResponse(f"no run {ns}/{name} in this console's scope", 404)
        try:
            attempt = int(request.query_params.get("attempt") or (run.get("status") or {}).get("attempt") or 0)
        except ValueError:
            return PlainResponse("attempt is a number", 422)
        where = logs.target(run, session.scope.pods_of(run), attempt)
        answer = where if isinstance(where, logs.Answer) else await logs.read(
            session.scope.http, ns, where, logs.tail_lines(request.query_params.get("tailLines")))
        return Response(answer.text, status_code=answer.status, media_type="text/plain",
                        headers={"Cache-Control": "no-store"})

    async def control(self, request: Request, session: Session) -> Response:
        ns, name, command = (request.path_params[k] for k in ("namespace", "name", "command"))
        if command not in CONTROLS:
            return JSONResponse({"error": f"unknown command {command}"}, status_code=404)
        body = await _json_body(request, "uid")
        if isinstance(body, Response):
            return body
        try:
            await control(session.scope.http, ns, name, command, str(body["uid"]))
        except ActionError as exc:
            return _refused(exc)
        return JSONResponse({"message": f"{name}: {command} requested"})

    async def decide(self, request: Request, session: Session) -> Response:
        ns, name = request.path_params["namespace"], request.path_params["name"]
        body = await _json_body(request, "uid", "gate", "attempt", "decision")
        if isinstance(body, Response):
            return body
        try:
            uid, gate, decision = str(body["uid"]), str(body["gate"]), str(body["decision"])
            reason, attempt = str(body.get("reason", "")), int(body["attempt"])
        except (ValueError, TypeError):
            return JSONResponse({"error": "attempt is a number"}, status_code=422)
        if decision not in ("Approve", "Deny"):
            return JSONResponse({"error": "decision is Approve or Deny"}, status_code=422)
        try:
            done = await record_decision(session.scope.http, ns, name, gate, decision, reason, attempt, uid)
        except ActionError as exc:
            return _refused(exc)
        return JSONResponse({"message": f"{done.decision} {done.gate} of {name} (attempt {done.attempt}) recorded "
                                        f"as {done.name} by {done.approver}"})


async def _json_body(request: Request, *required: str) -> dict[str, Any] | Response:
    """A write's JSON object, read no further than MAX_FORM_BYTES, with the fields it must name."""
    try:
        body = json.loads(await read_body(request, MAX_FORM_BYTES))
    except BodyTooLarge as exc:
        return JSONResponse({"error": str(exc)}, status_code=413)
    except ValueError:
        body = None
    if not isinstance(body, dict) or any(body.get(k) is None for k in required):
        return JSONResponse({"error": f"expected a JSON object with {', '.join(required)}"}, status_code=422)
    return body


def _refused(exc: ActionError) -> Response:
    # 409: the run shown was replaced by a namesake; reloading shows the new one.
    return JSONResponse({"error": str(exc)}, status_code=409 if isinstance(exc, Replaced) else 400)


async def _synced(session: Session) -> None:
    """A page rendered before the first list would show an empty table for a moment; wait briefly
    (a refused list shows its error instead)."""
    watches = (session.scope.runs, session.scope.budgets, session.scope.schedules)
    pending = [asyncio.ensure_future(w.settled.wait()) for w in watches if not w.settled.is_set()]
    if pending:
        _, late = await asyncio.wait(pending, timeout=5.0)
        for task in late:
            task.cancel()


def _run_fragments(request: Request, session: Session, ns: str, name: str) -> dict[str, str]:
    key = f"{ns}/{name}"
    run = session.scope.runs.objects.get(key)
    events = session.scope.run_events(run["metadata"]["uid"]) if run else []
    lease, pods = (session.scope.lease_of(run), session.scope.pods_of(run)) if run else (None, [])
    return views.run_fragments(_base(request), run, session.scope.series.get(key, []), events, _now(), lease, pods,
                               views.children_of(run, _runs(session)) if run else [])


def _schedules_fragment(request: Request, session: Session) -> str:
    return views.schedules_fragment(_base(request), list(session.scope.schedules.objects.values()), _runs(session))


def _budgets_fragment(request: Request, session: Session) -> str:
    return views.budgets_fragment(_base(request), list(session.scope.budgets.objects.values()), _runs(session))


Render = Callable[[set[str] | None], list[str]]


def _renderer(request: Request, session: Session, page: str) -> Render:
    """What a stream sends for a set of changed keys (None: everything, as at the start)."""
    base = _base(request)
    sent: dict[str, str] = {}

    def changed_fragments(fragments: dict[str, str]) -> list[str]:
        fresh = {k: v for k, v in fragments.items() if sent.get(k) != v}
        sent.update(fresh)
        return [_sse("fragments", fresh)] if fresh else []

    def with_errors(keys: set[str] | None, out: list[str]) -> list[str]:
        return changed_fragments({"errors": views.errors_fragment(session.scope.errors())}) + out

    if page == "runs":
        f = views.Filters.of(request.query_params)

        def runs(keys: set[str] | None) -> list[str]:
            if keys is None:
                rows = [[object_key(r), views.run_row(base, r, session.scope.lease_of(r))] for r in views.sorted_runs(_runs(session))
                        if f.matches(r)]
                return with_errors(keys, [_sse("reset", rows)])
            upsert, remove = [], []
            for key in sorted(k[4:] for k in keys if k.startswith("run:") and k != "run:"):
                run = session.scope.runs.objects.get(key)
                if run is not None and f.matches(run):
                    upsert.append([key, views.run_row(base, run, session.scope.lease_of(run))])
                else:
                    remove.append(key)
            return with_errors(keys, [_sse("rows", {"upsert": upsert, "remove": remove})] if upsert or remove else [])

        return runs
    if page == "run":
        ns, name = request.query_params.get("namespace", ""), request.query_params.get("name", "")

        def run(keys: set[str] | None) -> list[str]:
            if keys is not None and f"run:{ns}/{name}" not in keys and "" not in keys:
                return with_errors(keys, [])
            return with_errors(keys, changed_fragments(_run_fragments(request, session, ns, name)))

        return run
    if page == "budgets":
        return lambda keys: with_errors(keys, changed_fragments({"budgets": _budgets_fragment(request, session)}))
    if page == "schedules":
        return lambda keys: with_errors(keys, changed_fragments({"schedules": _schedules_fragment(request, session)}))
    return lambda keys: with_errors(keys, changed_fragments({"queue": views.review_fragment(base, _runs(session))}))


async def _stream(session: Session, listener: Listener, render: Render, coalesce: float) -> AsyncIterator[str]:
    try:
        yield "retry: 1000\n\n"  # the browser reconnects a second after a dropped stream
        for message in render(None):
            yield message
        while True:
            try:
                keys = await asyncio.wait_for(listener.next(), timeout=KEEPALIVE_SECONDS)
            except asyncio.TimeoutError:
                yield ": keep-alive\n\n"  # proxies close silent connections
                continue
            if listener.ended:
                return  # the browser reconnects, and is sent to sign in if it must
            await asyncio.sleep(coalesce)  # the rest of the burst joins this message
            keys |= listener.take()
            for message in render(keys):
                yield message
    finally:
        session.scope.leave(listener)


def _routes(backend: Backend) -> list[Route | Mount]:
    pages = Pages(backend)
    routes: list[Route | Mount] = [
        Route("/", _signed_in(backend, pages.runs)),
        Route("/runs/{namespace}/{name}", _signed_in(backend, pages.run)),
        Route("/budgets", _signed_in(backend, pages.budgets)),
        Route("/schedules", _signed_in(backend, pages.schedules)),
        Route("/review", _signed_in(backend, pages.review)),
        Route("/events", _signed_in(backend, pages.events)),
        Route("/api/runs/{namespace}/{name}/logs", _signed_in(backend, pages.logs)),
        Route("/api/runs/{namespace}/{name}/decide", _signed_in(backend, pages.decide), methods=["POST"]),
        Route("/api/runs/{namespace}/{name}/{command}", _signed_in(backend, pages.control), methods=["POST"]),
        Mount("/static", StaticFiles(directory=STATIC)),
    ]
    return routes


def build_local_app(cfg: KubeConfig, namespace: str | None, host: str, secret: str) -> Starlette:
    """`host`: the console's own (security.local_host), the only one it answers to."""
    backend = LocalBackend(cfg, namespace, secret)

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        backend.scope.start()  # the usage series begin now, not with the first browser
        yield
        await backend.scope.close()

    app = Starlette(routes=_routes(backend), lifespan=lifespan)
    app.state.backend = backend
    app.add_middleware(Guard, hosts=frozenset({host}))
    return app


def build_gateway_console(kube: KubeClient) -> Starlette:
    """The console for the gateway's /console: sign-in by token, every call with that token.

    `kube` (the operator's client) only reviews tokens. They are meant for the API server (no
    audience asked): the console hands each one to the API server as it is."""
    backend = GatewayBackend(kube.cfg, Authenticator(kube, audience=None))
    routes = _routes(backend) + [Route("/login", backend.login_page), Route("/login", backend.login, methods=["POST"]),
                                 Route("/logout", backend.logout_, methods=["POST"])]
    app = Starlette(routes=routes)
    app.state.backend = backend
    app.add_middleware(Guard, hosts=None)
    return app

