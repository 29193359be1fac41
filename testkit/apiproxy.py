"""A fault-injecting HTTPS reverse proxy in front of the test kube-apiserver.

The proxy terminates TLS on 127.0.0.1 (a free port) with a serving certificate
issued by the cluster's CA when the local cluster's PKI is at hand
($TETHER_TEST_STATE_DIR/pki), otherwise by a CA of its own. It forwards every
request to the API server named by an upstream kubeconfig, streaming
responses (watches included) chunk by chunk, and lets the test thread inject
faults through a small thread-safe API. It runs on its own thread and asyncio
loop, so a test drives it with plain blocking calls.

Credentials. A client that presents the proxy's own token (the one in the
kubeconfig the proxy writes) is forwarded with the upstream kubeconfig's
credentials (client certificate or token). A client that presents any other
bearer token (a worker's service-account token) is forwarded with that token
and no client certificate, so the API server sees the worker's own identity,
RBAC and admission policies. A client with no credentials is anonymous.
Several clients that should share the upstream identity yet be told apart (the
operator's replicas) each get a token of their own from client_token(label);
their requests carry the label, upstream too, in the User-Agent (the audit log
keeps it).

The operator behind a proxy::

    with ApiProxy(os.environ["TETHER_TEST_KUBECONFIG"], seed=7) as proxy:
        op = OperatorProcess(namespace, str(proxy.kubeconfig), tmp_path / "operator.log").start()
        gate = proxy.gate(method="GET", path=r"/leases/my-run$")
        gate.wait_arrived(timeout=30)        # the operator is awaiting its Lease GET
        ...                                   # the test acts on the real API (kube fixture)
        gate.release()                        # the GET reaches the API server now

A worker pod run by the process kubelet: point its kubeconfig at the proxy
with the pod annotation ``dev.tether.dev/api-server: <proxy.url>``. The pod
trusts only the cluster CA, which signed the proxy's certificate, and sends
its pod-bound token, which the proxy passes through. Match one worker's
requests with ``client=r"<namespace>/<pod>"`` (the pod named in its token).
Any other process: ``proxy.write_kubeconfig(path, token=...)``.

Faults are rules matched by method (regex, full match, case-insensitive),
path (regex, search), raw query string (regex, search), watch or not, and
client identity, limited by a count (``times``) and/or drawn with a
probability from the proxy's seeded ``random.Random``. Each acts in one phase:
``"request"`` (before forwarding: the API server never sees it, or sees it
late) or ``"response"`` (after the API server answered: the change is made,
the client learns late, wrongly, or never). Matching rules apply in the order
they were added; a status or drop ends the request.

Every request is recorded (proxy.requests(), proxy.wait_for_request()): method, path,
raw query, watch or not, client identity, whether it reached the API server
and what it answered, what the client got, the faults applied, and times.

Limits: HTTP/1.1 only (no exec/attach/port-forward upgrades); while cut, new
connections are still accepted (the request then hangs, as over a partition
after the handshake); a request whose client gave up while it was held still
reaches the API server when released (a late request arrives late), its
answer is discarded; when the API server cannot be reached, the proxy closes
the client's connection (a reset, not "connection refused").
"""

from __future__ import annotations

import asyncio
import base64
import collections
import datetime as dt
import json
import os
import random
import re
import secrets
import shutil
import socket
import ssl
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Literal, TypedDict
from urllib.parse import parse_qs

import aiohttp
import yaml
from aiohttp import web
from multidict import CIMultiDict
from typing_extensions import Unpack
from yarl import URL

from tether.devcluster import pki
from tether.kube import config as kubeconfig
from testkit.audit import ProxyStamp

Phase = Literal["request", "response"]

# Never forwarded: they describe one hop (RFC 9110 §7.6.1), or aiohttp sets them itself.
_HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection",
                         "te", "trailer", "transfer-encoding", "upgrade", "host", "content-length"})

# What kube-apiserver puts in Status.reason for each code it sends (k8s.io/apimachinery errors.New*).
_REASONS = {400: "BadRequest", 401: "Unauthorized", 403: "Forbidden", 404: "NotFound", 405: "MethodNotAllowed",
            409: "Conflict", 410: "Expired", 422: "Invalid", 429: "TooManyRequests", 500: "InternalError",
            503: "ServiceUnavailable", 504: "Timeout"}
_MESSAGES = {
    410: "The provided continue parameter is too old to display a consistent list result. You can start a new "
         "list without the continue parameter.",
    429: "Too many requests, please try again later.",
    500: "Internal error occurred: injected by the test API proxy",
    503: "The server is currently unable to handle the request",
    504: "Timeout: request did not complete within requested timeout - context deadline exceeded",
}


def status_body(code: int, message: str | None = None, retry_after: int | None = None) -> dict[str, Any]:
    """A metav1.Status as kube-apiserver encodes it for an error `code`."""
    body: dict[str, Any] = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                            "message": message or _MESSAGES.get(code, f"injected by the test API proxy ({code})"),
                            "reason": _REASONS.get(code, "Unknown"), "code": code}
    if retry_after is not None:
        body["details"] = {"retryAfterSeconds": retry_after}
    return body


def expired_watch_event(resource_version: str | None) -> dict[str, Any]:
    """The one event kube-apiserver sends, on a 200 stream, for a watch from a compacted resourceVersion.

    Once a watch request passed authentication, authorization and RV parsing, the API server reports
    errors in-band (the cacher's errWatcher): {"type":"ERROR","object":Status{code:410,reason:Expired}},
    then it closes the stream. Clients (client-go's reflector, kopf) re-list on it.
    """
    rv = int(resource_version) if resource_version and resource_version.isdigit() else 0
    return {"type": "ERROR", "object": status_body(410, f"too old resource version: {rv} ({rv + 1})")}


def _compact(doc: dict[str, Any]) -> bytes:
    """JSON as Go's encoder writes it (no spaces)."""
    return json.dumps(doc, separators=(",", ":")).encode()


def cluster_ca() -> pki.CertPair | None:
    """The local test cluster's CA (cert and key), when this test session started it."""
    state = os.environ.get("TETHER_TEST_STATE_DIR")
    if not state:
        return None
    pair = pki.CertPair(Path(state) / "pki" / "ca.crt", Path(state) / "pki" / "ca.key")
    return pair if pair.cert.exists() and pair.key.exists() else None


@dataclass
class RequestRecord:
    """One request the proxy saw. Times are time.monotonic() of the test process."""

    id: int
    method: str
    path: str
    query: str  # raw query string, as sent
    watch: bool
    # "proxy" (the proxy's own token), a named client's label (client_token), "<namespace>/<pod>" or the
    # token's subject, "anonymous"
    client: str
    started: float
    forwarded: bool = False  # the request was sent to the API server
    upstream_status: int | None = None  # what the API server answered
    status: int | None = None  # what the client got; None: no answer (dropped, or it gave up)
    finished: float | None = None  # set before the last byte goes out, or when the request ends otherwise
    faults: list[str] = field(default_factory=list)
    error: str | None = None
    received_at: dt.datetime | None = None  # wall clock, when the request reached the proxy

    @property
    def params(self) -> dict[str, list[str]]:
        return parse_qs(self.query)


class Criteria(TypedDict, total=False):
    """Which requests a rule applies to; every given criterion must hold."""

    method: str | None  # regex, full match, case-insensitive: "GET", "PUT|PATCH"
    path: str | None  # regex searched in the path: r"/leases/run-1$"
    query: str | None  # regex searched in the raw query string: r"labelSelector="
    watch: bool | None  # watch requests only (True) or none of them (False)
    client: str | None  # regex searched in RequestRecord.client
    times: int | None  # apply to this many matching requests, then the rule is spent
    probability: float  # apply with this probability (the proxy's seeded random)


class _Valve:
    """Open or shut from any thread; coroutines on the proxy's loop wait until it is open."""

    def __init__(self, loop: asyncio.AbstractEventLoop, is_open: bool = True) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._open = is_open
        self._waiters: list[asyncio.Future[None]] = []

    @property
    def is_open(self) -> bool:
        return self._open

    def shut(self) -> None:
        with self._lock:
            self._open = False

    def open(self) -> None:
        with self._lock:
            self._open = True
            waiters, self._waiters = self._waiters, []
        for fut in waiters:
            self._loop.call_soon_threadsafe(_resolve, fut)

    async def wait(self) -> None:
        with self._lock:
            if self._open:
                return
            fut: asyncio.Future[None] = self._loop.create_future()
            self._waiters.append(fut)
        await fut


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class Rule:
    """A fault installed on the proxy. `hits` counts the requests it acted on."""

    def __init__(self, proxy: "ApiProxy", kind: str, phase: Phase, criteria: Criteria, **params: Any) -> None:
        if phase not in ("request", "response"):
            raise ValueError(f"phase must be 'request' or 'response', not {phase!r}")
        self.proxy, self.kind, self.phase, self.params = proxy, kind, phase, params
        method = criteria.get("method")
        path, query, client = criteria.get("path"), criteria.get("query"), criteria.get("client")
        self._method = re.compile(method, re.I) if method else None
        self._path = re.compile(path) if path else None
        self._query = re.compile(query) if query else None
        self._client = re.compile(client) if client else None
        self.watch = criteria.get("watch")
        self.times = criteria.get("times")
        self.probability = criteria.get("probability", 1.0)
        self.hits = 0
        self.removed = False

    def __repr__(self) -> str:
        return f"<Rule {self.kind} {self.phase} {self.params} hits={self.hits}>"

    @property
    def spent(self) -> bool:
        return self.removed or (self.times is not None and self.hits >= self.times)

    def matches(self, rec: RequestRecord) -> bool:
        return ((self._method is None or self._method.fullmatch(rec.method) is not None)
                and (self._path is None or self._path.search(rec.path) is not None)
                and (self._query is None or self._query.search(rec.query) is not None)
                and (self._client is None or self._client.search(rec.client) is not None)
                and (self.watch is None or self.watch == rec.watch))

    def remove(self) -> None:
        self.proxy._remove(self)


class Gate(Rule):
    """Holds matching requests (or their responses) until the test releases them."""

    def __init__(self, proxy: "ApiProxy", phase: Phase, criteria: Criteria) -> None:
        super().__init__(proxy, "gate", phase, criteria)
        self._valve = _Valve(proxy._loop, is_open=False)
        self._cond = threading.Condition()
        self._arrived: list[RequestRecord] = []
        self._held = 0
        self.dropping = False

    @property
    def held(self) -> int:
        """How many requests wait at the gate now."""
        with self._cond:
            return self._held

    @property
    def arrived(self) -> list[RequestRecord]:
        with self._cond:
            return [replace(r) for r in self._arrived]

    def wait_arrived(self, timeout: float = 30.0, count: int = 1) -> list[RequestRecord]:
        """Blocks until `count` matching requests were held here; returns them (snapshots)."""
        with self._cond:
            if not self._cond.wait_for(lambda: len(self._arrived) >= count, timeout=timeout):
                raise TimeoutError(f"{len(self._arrived)} of {count} request(s) reached the gate within {timeout}s "
                                   f"(seen: {[(r.method, r.path) for r in self.proxy.requests()][-10:]})")
            return [replace(r) for r in self._arrived]

    def release(self) -> None:
        """Lets every held request go on, and opens the gate for good (later matches pass)."""
        self.proxy._remove(self)
        self._valve.open()

    def drop(self) -> None:
        """Like release(), but the held requests never reach the API server: their connections close."""
        self.dropping = True
        self.release()

    async def _hold(self, rec: RequestRecord) -> None:
        with self._cond:
            self._arrived.append(rec)
            self._held += 1
            self._cond.notify_all()
        try:
            await self._valve.wait()
        finally:
            with self._cond:
                self._held -= 1


class _Dropped(Exception):
    """The connection was closed on purpose."""


@dataclass
class _Upstream:
    server: str
    admin_tls: ssl.SSLContext  # with the upstream kubeconfig's client certificate, if it has one
    bare_tls: ssl.SSLContext  # trusts the same CA, presents no certificate
    token: str | None
    token_file: Path | None

    def bearer(self) -> str | None:
        if self.token_file is not None:
            return self.token_file.read_text().strip()
        return self.token


def _upstream(path: Path) -> _Upstream:
    cfg = kubeconfig.from_kubeconfig(path)
    bare = ssl.create_default_context()
    if cfg.ssl_context.verify_mode == ssl.CERT_NONE:
        bare.check_hostname = False
        bare.verify_mode = ssl.CERT_NONE
    else:
        cas = cfg.ssl_context.get_ca_certs(binary_form=True)
        if cas:
            bare = ssl.create_default_context(cadata=b"".join(cas))
    return _Upstream(cfg.server, cfg.ssl_context, bare, cfg.token, cfg.token_file)


def _token_identity(auth: str) -> str:
    """Who a bearer token names: the pod it is bound to, else its subject (unverified: matching only)."""
    try:
        payload = auth.split(".")[1]
        claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    except (IndexError, ValueError):
        return "bearer"
    kube = claims.get("kubernetes.io") or {}
    if isinstance(kube, dict) and isinstance(kube.get("pod"), dict):
        return f"{kube.get('namespace', '')}/{kube['pod'].get('name', '')}"
    return str(claims.get("sub") or "bearer")


class ApiProxy:
    """See the module docstring. Construct to start; close() (or the with-block) to stop."""

    def __init__(self, upstream_kubeconfig: str | os.PathLike[str], *, seed: int = 0,
                 ca: pki.CertPair | None = None, workdir: Path | None = None, max_records: int = 200_000) -> None:
        """`ca`: the CA that signs the serving certificate (default: the test cluster's, else a new one)."""
        self._upstream = _upstream(Path(upstream_kubeconfig))
        self.random = random.Random(seed)
        self.token = "tether-apiproxy-" + secrets.token_hex(16)
        self._clients: dict[str, str] = {}  # "Bearer <token>" -> label, for client_token()
        self._own_workdir = workdir is None
        self.workdir = Path(tempfile.mkdtemp(prefix="tether-apiproxy-")) if workdir is None else workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        ca = ca or cluster_ca()
        authority = pki.CertificateAuthority.load(ca, self.workdir) if ca else pki.CertificateAuthority(self.workdir)
        self.ca_pem = authority.pair.cert_pem()
        serving = authority.issue("apiproxy", "tether-apiproxy", server=True)
        self._tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self._tls.load_cert_chain(str(serving.cert), str(serving.key))
        self._tls.set_alpn_protocols(["http/1.1"])  # Go clients would otherwise try h2

        self._sock = _ListeningSocket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.port: int = self._sock.getsockname()[1]
        self.url = f"https://127.0.0.1:{self.port}"

        # Reentrant: predicates handed to requests()/wait_for_request() run under it and may call back.
        self._lock = threading.RLock()
        self._records_changed = threading.Condition(self._lock)
        self._rules: list[Rule] = []
        self._records: collections.deque[RequestRecord] = collections.deque(maxlen=max_records)
        self._next_id = 0
        self._streams: set[_Stream] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._waiting = {"cut": 0, "watch": 0}

        self._loop = asyncio.new_event_loop()
        self._partition = _Valve(self._loop)
        self._watches = _Valve(self._loop)
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"apiproxy:{self.port}", daemon=True)
        self._thread.start()
        self._ready.wait(timeout=30)
        if self._error is not None or not self._ready.is_set():
            self.close()
            raise RuntimeError(f"the API proxy did not start: {self._error!r}")
        self.kubeconfig = self.write_kubeconfig(self.workdir / "kubeconfig")

    # --- test-thread API -------------------------------------------------------------------

    def __enter__(self) -> "ApiProxy":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def write_kubeconfig(self, path: Path, token: str | None = None, namespace: str | None = None) -> Path:
        """A kubeconfig for a client of the proxy: its URL, the CA of its certificate, and a bearer token
        (default: the proxy's own, which means "forward with the upstream credentials")."""
        context: dict[str, Any] = {"cluster": "apiproxy", "user": "apiproxy"}
        if namespace:
            context["namespace"] = namespace
        doc = {
            "apiVersion": "v1", "kind": "Config", "current-context": "apiproxy",
            "clusters": [{"name": "apiproxy", "cluster": {
                "server": self.url, "certificate-authority-data": base64.b64encode(self.ca_pem).decode()}}],
            "users": [{"name": "apiproxy", "user": {"token": token or self.token}}],
            "contexts": [{"name": "apiproxy", "context": context}],
        }
        path.write_text(yaml.safe_dump(doc))
        path.chmod(0o600)
        return path

    def client_token(self, label: str) -> str:
        """A further token of the proxy's own, for one client known by `label` (e.g. one operator
        replica): forwarded with the upstream credentials like the proxy's token, recorded with
        client=label, and sent upstream with a User-Agent stamped with the label and when the proxy
        received the request (audit.ProxyStamp), so the audit log tells such clients apart."""
        token = "tether-apiproxy-" + secrets.token_hex(16)
        with self._lock:
            self._clients[f"Bearer {token}"] = label
        return token

    def delay(self, seconds: float, *, phase: Phase = "request", **criteria: Unpack[Criteria]) -> Rule:
        """Waits `seconds` before forwarding the request (phase "request") or before answering the client
        once the API server has answered ("response": the change is made, the client learns late)."""
        return self._add(Rule(self, "delay", phase, criteria, seconds=seconds))

    def status(self, code: int, *, retry_after: int | None = None, message: str | None = None,
               phase: Phase = "request", **criteria: Unpack[Criteria]) -> Rule:
        """Answers `code` with a kube-apiserver Status body (and Retry-After) instead of the API server's
        answer; with phase "response" the request was served upstream first. A 410 on a watch is sent as
        the API server does: 200, one ERROR event with the Expired Status, end of stream."""
        if code < 400:
            raise ValueError("status() injects errors; use a 4xx or 5xx code")
        return self._add(Rule(self, "status", phase, criteria, code=code, retry_after=retry_after,
                              message=message))

    def answer(self, code: int, body: bytes, *, content_type: str = "application/json", phase: Phase = "request",
               **criteria: Unpack[Criteria]) -> Rule:
        """Answers `code` with `body` as it is, instead of the API server's answer: what a proxy in
        between may send (a sign-in page, a Status where an object belongs). With phase "response"
        the request was served upstream first."""
        return self._add(Rule(self, "answer", phase, criteria, code=code, body=body, content_type=content_type))

    def drop(self, *, phase: Phase = "request", **criteria: Unpack[Criteria]) -> Rule:
        """Closes the client's connection without an answer, before forwarding or after the API server
        answered (the client cannot tell whether its write happened)."""
        return self._add(Rule(self, "drop", phase, criteria))

    def gate(self, *, phase: Phase = "request", **criteria: Unpack[Criteria]) -> Gate:
        """Holds matching requests (phase "request": before they reach the API server; "response": after it
        answered) until Gate.release(). Holds only the first match unless `times` says otherwise
        (times=None: every match until released)."""
        if "times" not in criteria:
            criteria["times"] = 1
        gate = Gate(self, phase, criteria)
        self._add(gate)
        return gate

    def clear(self) -> None:
        """Removes every rule, releases every gate, heals the partition and releases watches."""
        with self._lock:
            rules, self._rules = self._rules, []
        for rule in rules:
            rule.removed = True
            if isinstance(rule, Gate):
                rule._valve.open()
        self.heal()
        self.release_watches()

    def hold_watches(self) -> None:
        """Stops moving bytes on watch streams, open ones and new ones (a stalled watch): the API server's
        events stay queued in the proxy and TCP buffers, the connection stays open."""
        self._watches.shut()

    def release_watches(self) -> None:
        """Resumes held watch streams; queued events arrive, in order, late."""
        self._watches.open()

    def cut(self) -> None:
        """A partition: nothing moves. New requests hang before reaching the API server, answers and
        stream bytes stop; all of it proceeds, late, on heal()."""
        self._partition.shut()

    def heal(self) -> None:
        self._partition.open()

    def reset_watches(self) -> int:
        """Closes every open watch stream now (the connection drops mid-stream); returns how many."""
        with self._lock:
            streams = [s for s in self._streams if s.rec.watch]
        for stream in streams:
            self._update(stream.rec, error="reset")
            self._loop.call_soon_threadsafe(stream.abort)
        return len(streams)

    @property
    def open_watches(self) -> int:
        with self._lock:
            return sum(1 for s in self._streams if s.rec.watch and s.started)

    @property
    def stalled(self) -> dict[str, int]:
        """How many requests/chunks wait right now: {"cut": partition, "watch": hold_watches}."""
        with self._lock:
            return dict(self._waiting)

    def requests(self, predicate: Callable[[RequestRecord], bool] | None = None) -> list[RequestRecord]:
        """Snapshots of the requests seen so far, oldest first."""
        with self._lock:
            return [replace(r) for r in self._records if predicate is None or predicate(r)]

    def wait_for_request(self, predicate: Callable[[RequestRecord], bool], timeout: float = 30.0) -> RequestRecord:
        """Blocks until a request satisfying `predicate` (checked on every change of any record) is seen."""
        deadline = time.monotonic() + timeout
        with self._records_changed:
            while True:
                found = next((r for r in self._records if predicate(r)), None)
                if found is not None:
                    return replace(found)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no matching request within {timeout}s; last seen: "
                                       f"{[(r.method, r.path, r.status) for r in list(self._records)[-10:]]}")
                self._records_changed.wait(left)

    def close(self) -> None:
        """Stops listening, ends every open request and stream, and joins the proxy's thread."""
        if self._thread.is_alive() and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=30)
        if self._thread.is_alive():
            raise RuntimeError("the API proxy thread did not stop")
        self._sock.close()
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    # --- internals -------------------------------------------------------------------------

    def _add(self, rule: Rule) -> Rule:
        with self._lock:
            self._rules.append(rule)
        return rule

    def _remove(self, rule: Rule) -> None:
        with self._lock:
            rule.removed = True
            if rule in self._rules:
                self._rules.remove(rule)

    def _take(self, rec: RequestRecord, phase: Phase) -> list[Rule]:
        """The rules that act on `rec` in `phase`, counted as hit; stops at the first terminal one."""
        out: list[Rule] = []
        with self._lock:
            for rule in self._rules:
                if rule.phase != phase or rule.spent or not rule.matches(rec):
                    continue
                if rule.probability < 1.0 and self.random.random() >= rule.probability:
                    continue
                rule.hits += 1
                rec.faults.append(f"{rule.kind}@{phase}")
                out.append(rule)
                if rule.kind in ("status", "drop"):
                    break
            self._records_changed.notify_all()
        return out

    def _update(self, rec: RequestRecord, **changes: Any) -> None:
        with self._records_changed:
            for key, value in changes.items():
                setattr(rec, key, value)
            self._records_changed.notify_all()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._main())
        except BaseException as exc:  # noqa: BLE001 - reported to the constructor
            self._error = exc
            self._ready.set()
        finally:
            self._loop.run_until_complete(self._loop.shutdown_asyncgens())
            self._loop.run_until_complete(self._loop.shutdown_default_executor())
            self._loop.close()

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        timeout = aiohttp.ClientTimeout(total=None, connect=15, sock_read=None)
        # limit=0: every open watch holds a connection; a cap would queue requests behind watches.
        self._admin = aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=self._upstream.admin_tls, limit=0),
                                            timeout=timeout, auto_decompress=False)
        self._bare = aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=self._upstream.bare_tls, limit=0),
                                           timeout=timeout, auto_decompress=False)
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        # handler_cancellation: a client that hangs up ends its stream here too (watches would linger).
        runner = web.AppRunner(app, handler_cancellation=True, auto_decompress=False, shutdown_timeout=2,
                               access_log=None)
        await runner.setup()
        site = web.SockSite(runner, self._sock, ssl_context=self._tls)
        await site.start()
        self._ready.set()
        try:
            await self._stop.wait()
        finally:
            # Held requests never go upstream once the proxy closes: cancel them before anything opens.
            for task in list(self._tasks):
                task.cancel()
            for stream in list(self._streams):
                stream.abort()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            await runner.cleanup()
            await self._admin.close()
            await self._bare.close()
            await self._close_accepted()

    async def _close_accepted(self, grace: float = 2.0) -> None:
        """Ends connections the server does not know yet (a TLS handshake in progress) or still closes
        (a TLS close_notify exchange): their sockets would outlive the loop and leak."""
        for conn in list(self._sock.accepted):
            if conn.fileno() != -1:
                try:
                    conn.shutdown(socket.SHUT_RDWR)  # the transport sees EOF and closes itself
                except OSError:
                    pass
        deadline = time.monotonic() + grace
        while any(c.fileno() != -1 for c in list(self._sock.accepted)) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    async def _flow(self, watch: bool) -> None:
        """Waits while the partition is cut, or (for watch streams) while watches are held."""
        while True:
            if not self._partition.is_open:
                valve, kind = self._partition, "cut"
            elif watch and not self._watches.is_open:
                valve, kind = self._watches, "watch"
            else:
                return
            with self._lock:
                self._waiting[kind] += 1
            try:
                await valve.wait()
            finally:
                with self._lock:
                    self._waiting[kind] -= 1

    def _identity(self, auth: str) -> str:
        if not auth:
            return "anonymous"
        if auth == f"Bearer {self.token}":
            return "proxy"
        with self._lock:
            if auth in self._clients:
                return self._clients[auth]
        return _token_identity(auth.removeprefix("Bearer ").strip())

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        query = request.query_string
        watch = request.query.get("watch") in ("true", "1") or "/watch/" in request.path
        with self._records_changed:
            self._next_id += 1
            rec = RequestRecord(self._next_id, request.method, request.path, query, watch,
                                self._identity(request.headers.get("Authorization", "")), time.monotonic(),
                                received_at=dt.datetime.now(dt.timezone.utc))
            self._records.append(rec)
            self._records_changed.notify_all()
        try:
            body = await request.read()
            forward = asyncio.ensure_future(self._before_and_forward(request, rec, body))
            self._tasks.add(forward)
            forward.add_done_callback(self._tasks.discard)
            try:
                # Shielded: a client that gave up while its request was held does not take the request back
                # (it is in flight, as over TCP); only the answer is lost.
                result = await asyncio.shield(forward)
            except asyncio.CancelledError:
                forward.add_done_callback(_release_response)
                raise
            if isinstance(result, web.StreamResponse):
                return result
            return await self._respond(request, rec, result)
        except _Dropped:
            self._update(rec, status=None, error="dropped")
            assert request.transport is not None
            request.transport.abort()
            raise asyncio.CancelledError() from None
        except asyncio.CancelledError:
            if rec.error is None:
                self._update(rec, error="cancelled")
            raise
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
            if rec.error is None:
                self._update(rec, error=f"{type(exc).__name__}: {exc}")
            if request.transport is not None:
                request.transport.abort()
            raise asyncio.CancelledError() from None
        finally:
            if rec.finished is None:
                self._update(rec, finished=time.monotonic())
            self._tasks.discard(task)

    async def _apply(self, rules: list[Rule], rec: RequestRecord) -> dict[str, Any] | None:
        """Runs delays and gates; returns a terminal action (status or answer; drop raises) if one matched."""
        for rule in rules:
            if rule.kind == "delay":
                await asyncio.sleep(rule.params["seconds"])
            elif isinstance(rule, Gate):
                await rule._hold(rec)
                if rule.dropping:
                    raise _Dropped()
            elif rule.kind == "drop":
                raise _Dropped()
            elif rule.kind in ("status", "answer"):
                return rule.params
        return None

    async def _before_and_forward(self, request: web.Request, rec: RequestRecord,
                                  body: bytes) -> aiohttp.ClientResponse | web.StreamResponse:
        await self._flow(False)
        injected = await self._apply(self._take(rec, "request"), rec)
        if injected is not None:
            return await self._answer_status(request, rec, injected)
        headers: CIMultiDict[str] = CIMultiDict(
            (k, v) for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP and k.lower() != "authorization")
        auth = request.headers.get("Authorization", "")
        session = self._bare
        with self._lock:
            named = rec.client in self._clients.values()
        if rec.client == "proxy" or named:
            session = self._admin
            bearer = self._upstream.bearer()
            if bearer:
                headers["Authorization"] = f"Bearer {bearer}"
        elif auth:
            headers["Authorization"] = auth
        if named:
            assert rec.received_at is not None
            headers["User-Agent"] = ProxyStamp(rec.client, rec.received_at).user_agent(
                request.headers.get("User-Agent", ""))
        # Without these, aiohttp would add its own: the API server would then gzip an answer the client
        # did not ask to be compressed.
        skip = [h for h in ("Accept-Encoding", "User-Agent", "Accept") if h not in request.headers]
        self._update(rec, forwarded=True)
        resp = await session.request(request.method, URL(self._upstream.server + request.raw_path, encoded=True),
                                     headers=headers, data=body or None, allow_redirects=False,
                                     skip_auto_headers=skip)
        self._update(rec, upstream_status=resp.status)
        return resp

    async def _respond(self, request: web.Request, rec: RequestRecord,
                       upstream: aiohttp.ClientResponse) -> web.StreamResponse:
        stream = _Stream(rec, request, upstream)
        with self._lock:
            self._streams.add(stream)
        try:
            try:
                injected = await self._apply(self._take(rec, "response"), rec)
            except BaseException:
                upstream.release()
                raise
            if injected is not None:
                upstream.release()
                return await self._answer_status(request, rec, injected)
            await self._flow(rec.watch)
            out = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            for key, value in upstream.headers.items():
                if key.lower() not in _HOP_BY_HOP:
                    out.headers.add(key, value)
            length = upstream.headers.get("Content-Length")
            if length is not None:
                out.content_length = int(length)
            elif upstream.status not in (204, 304) and request.method != "HEAD":
                out.enable_chunked_encoding()
            await out.prepare(request)
            stream.started = True
            self._update(rec, status=upstream.status)
            if length is not None:
                # With a Content-Length the client has the whole answer after the last chunk, before
                # write_eof: read it all, so the record is complete before any of it goes out.
                body = await upstream.read()
                await self._flow(rec.watch)
                self._update(rec, finished=time.monotonic())
                await out.write(body)
                await out.write_eof()
                return out
            # iter_any: every chunk as soon as it arrives, so watch events are not held back by buffering.
            async for chunk in upstream.content.iter_any():
                await self._flow(rec.watch)
                await out.write(chunk)
            # Before the terminating chunk: a client holding the whole answer finds its record complete.
            self._update(rec, finished=time.monotonic())
            await out.write_eof()
            return out
        finally:
            upstream.release()
            with self._lock:
                self._streams.discard(stream)

    async def _answer_status(self, request: web.Request, rec: RequestRecord,
                             params: dict[str, Any]) -> web.StreamResponse:
        await self._flow(rec.watch)
        if "body" in params:  # answer(): the body as given
            out = web.Response(status=params["code"], body=params["body"],
                               headers={"Content-Type": params["content_type"]})
            self._update(rec, status=params["code"], finished=time.monotonic())
            return out
        code, retry_after = params["code"], params["retry_after"]
        if code == 429 and retry_after is None:
            retry_after = 1  # kube-apiserver always sends one with a 429
        headers = {"Content-Type": "application/json"}
        if retry_after is not None:
            headers["Retry-After"] = str(retry_after)
        if code == 410 and rec.watch and params["message"] is None:
            out = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
            out.enable_chunked_encoding()
            await out.prepare(request)
            self._update(rec, status=200)
            await out.write(_compact(expired_watch_event(request.query.get("resourceVersion"))) + b"\n")
            self._update(rec, finished=time.monotonic())
            await out.write_eof()
            return out
        body = _compact(status_body(code, params["message"], retry_after)) + b"\n"
        out = web.Response(status=code, body=body, headers=headers)
        self._update(rec, status=code, finished=time.monotonic())
        return out


class _ListeningSocket(socket.socket):
    """The proxy's listening socket; remembers what it accepted so that close() can end all of it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.accepted: weakref.WeakSet[socket.socket] = weakref.WeakSet()

    def accept(self) -> tuple[socket.socket, Any]:
        conn, addr = super().accept()
        self.accepted.add(conn)
        return conn, addr


class _Stream:
    """A response being relayed; the test thread may abort it (reset_watches)."""

    def __init__(self, rec: RequestRecord, request: web.Request, upstream: aiohttp.ClientResponse) -> None:
        self.rec, self.request, self.upstream = rec, request, upstream
        self.started = False

    def abort(self) -> None:
        if self.request.transport is not None:
            self.request.transport.abort()
        self.upstream.close()


def _release_response(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled() and fut.exception() is None and isinstance(fut.result(), aiohttp.ClientResponse):
        fut.result().release()
