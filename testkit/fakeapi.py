"""One fake Kubernetes API for unit tests: an in-memory API server behind httpx's MockTransport, so
the operator's real client (tether.kube.client.KubeClient) makes its real requests against it.

It keeps what the operator's safety rests on: resourceVersions from one counter, preconditions
(a PUT's or a merge patch's resourceVersion, a DELETE's UID and resourceVersion, a JSON patch's
`test`), 404 / 409 / 422 as the API server answers them, the status subresource, finalizers that
hold a deletion, generateName, label and field selectors. A test scripts races and refusals with
`before` (runs before a request is served: change the objects, or answer for the server) and
`after` (once it was served, before the answer arrives), and reads what was asked in `calls`.
"""

from __future__ import annotations

import copy
import datetime as dt
import json
import re
import ssl
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

import httpx

from tether.kube.client import KubeClient
from tether.kube.config import KubeConfig

Body = dict[str, Any]
# (method, path, body) -> an answer (status, body) for the server to give, or None to serve it.
Hook = Callable[["Request"], "tuple[int, Body] | None"]

_PATH = re.compile(r"^/(?:api/v1|apis/(?P<group>[^/]+)/(?P<version>[^/]+))"
                   r"(?:/namespaces/(?P<ns>[^/]+))?/(?P<plural>[^/]+)(?:/(?P<name>[^/]+))?(?:/(?P<sub>status))?$")


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    body: Any
    params: dict[str, str]
    content_type: str

    @property
    def call(self) -> str:
        return f"{self.method} {self.path}"


@dataclass
class FakeApi:
    now: Callable[[], dt.datetime] = lambda: dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
    objects: dict[str, Body] = field(default_factory=dict)  # by object path (collection/name)
    calls: list[str] = field(default_factory=list)
    requests: list[Request] = field(default_factory=list)
    answered: list[tuple[str, int]] = field(default_factory=list)  # (call, status code)
    hooks: list[Hook] = field(default_factory=list)
    # Run once a request was served, before its answer reaches the client: (request, status code).
    after_hooks: list[Callable[[Request, int], None]] = field(default_factory=list)
    rv: int = 100

    # --- for tests -------------------------------------------------------------------

    def client(self) -> KubeClient:
        """The operator's own client, talking to this server."""
        # A context without CA certificates: nothing is verified (and loading a bundle costs CPU).
        kube = KubeClient(KubeConfig(server="https://fake-api", ssl_context=ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)))
        kube.http = httpx.AsyncClient(base_url="https://fake-api", transport=httpx.MockTransport(self.handle))
        return kube

    def before(self, hook: Hook) -> None:
        self.hooks.append(hook)

    def after(self, hook: Callable[[Request, int], None]) -> None:
        """`hook` runs once a request was served and before its answer reaches the client (what the
        watch delivers while the answer is on its way)."""
        self.after_hooks.append(hook)

    def put(self, path: str, body: Body) -> Body:
        """Stores an object as if it had been created (a new resourceVersion, a UID if it has none)."""
        stored = copy.deepcopy(body)
        meta = stored.setdefault("metadata", {})
        meta.setdefault("uid", str(uuid.uuid4()))
        meta.setdefault("generation", 1)
        meta.setdefault("creationTimestamp", _time(self.now()))
        meta["resourceVersion"] = self._next_rv()
        self.objects[path] = stored
        return copy.deepcopy(stored)

    def gone(self, path: str) -> None:
        """A deleted pod's kubelet reports it gone (its containers ended): the API server removes it."""
        self.objects.pop(path, None)

    def asked(self, *plurals: str, writes: bool = False) -> list[str]:
        """The requests so far as "METHOD plural/name[/status]" (a create names what it created) of
        these kinds (all when none are named); `writes`: only those that are not GETs."""
        out = []
        for req in self.requests:
            m = _PATH.match(req.path)
            if m is None or (plurals and m["plural"] not in plurals) or (writes and req.method == "GET"):
                continue
            name = m["name"] or (((req.body or {}).get("metadata") or {}).get("name") if req.method == "POST" else None)
            out.append(f"{req.method} {m['plural']}" + (f"/{name}" if name else "") + ("/status" if m["sub"] else ""))
        return out

    def get(self, path: str) -> Body | None:
        found = self.objects.get(path)
        return copy.deepcopy(found) if found is not None else None

    # --- the server ------------------------------------------------------------------

    def handle(self, request: httpx.Request) -> httpx.Response:
        response = self._serve(request)
        self.answered.append((self.calls[-1], response.status_code))
        for hook in list(self.after_hooks):
            hook(self.requests[-1], response.status_code)
        return response

    def landed(self, call: str) -> int:
        """How many times `call` ("METHOD path") was answered with success."""
        return sum(1 for c, code in self.answered if c == call and code < 300)

    def _serve(self, request: httpx.Request) -> httpx.Response:
        raw = request.content.decode() if request.content else ""
        req = Request(request.method, request.url.path, json.loads(raw) if raw else None,
                      dict(request.url.params), request.headers.get("content-type", ""))
        self.calls.append(req.call)
        self.requests.append(req)
        for hook in list(self.hooks):
            answer = hook(req)
            if answer is not None:
                return _answer(*answer)
        if req.path == "/readyz":
            return httpx.Response(200, text="ok")
        m = _PATH.match(req.path)
        if m is None:
            return _status(404, "NotFound", f"no route {req.path}")
        collection = req.path.rsplit("/status", 1)[0] if m["sub"] else req.path
        if m["name"] is not None:
            collection = collection.rsplit("/", 1)[0]
        name, sub = m["name"], m["sub"]
        if req.method == "GET":
            return self._get(collection, name, req.params)
        if req.method == "POST":
            return self._create(collection, m["ns"], req.body)
        path = f"{collection}/{name}"
        if req.method == "PUT":
            return self._replace(path, req.body, sub)
        if req.method == "PATCH":
            return self._patch(path, req, sub)
        if req.method == "DELETE":
            return self._delete(path, req.body or {}, graceful=m["plural"] == "pods")
        return _status(405, "MethodNotAllowed", req.method)

    def _get(self, collection: str, name: str | None, params: dict[str, str]) -> httpx.Response:
        if name is not None:
            found = self.objects.get(f"{collection}/{name}")
            return _answer(200, found) if found is not None else _status(404, "NotFound", f"{name} not found")
        items = [o for p, o in self.objects.items() if p.rsplit("/", 1)[0] == collection
                 and _labels_match(o, params.get("labelSelector", "")) and _fields_match(o, params.get("fieldSelector", ""))]
        return _answer(200, {"kind": "List", "metadata": {"resourceVersion": str(self.rv)}, "items": items})

    def _create(self, collection: str, ns: str | None, body: Body) -> httpx.Response:
        meta = body.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        path = f"{collection}/{meta['name']}"
        if path in self.objects:
            return _status(409, "AlreadyExists", f"{meta['name']} already exists")
        if ns is not None:
            meta["namespace"] = ns
        meta.pop("resourceVersion", None)
        meta.pop("uid", None)
        return _answer(201, self.put(path, body))

    def _replace(self, path: str, body: Body, sub: str | None) -> httpx.Response:
        held = self.objects.get(path)
        if held is None:
            return _status(404, "NotFound", f"{path} not found")
        wanted = (body.get("metadata") or {}).get("resourceVersion")
        if wanted and wanted != held["metadata"]["resourceVersion"]:
            return _status(409, "Conflict", "the object has been modified; please apply your changes to the "
                                            "latest version and try again")
        if sub == "status":
            new = {**held, "status": copy.deepcopy(body.get("status") or {})}
        else:
            new = {**copy.deepcopy(body), "status": held.get("status")}
            new["metadata"] = {**body.get("metadata", {}), **{k: held["metadata"][k] for k in (
                "uid", "creationTimestamp", "generation") if k in held["metadata"]}}
            if body.get("spec") != held.get("spec"):
                new["metadata"]["generation"] = held["metadata"].get("generation", 1) + 1
        return self._store(path, new)

    def _patch(self, path: str, req: Request, sub: str | None) -> httpx.Response:
        held = self.objects.get(path)
        if held is None:
            return _status(404, "NotFound", f"{path} not found")
        if "json-patch" in req.content_type:
            new = copy.deepcopy(held)
            for op in req.body:
                failed = _json_patch(new, op)
                if failed:
                    return _status(422, "Invalid", failed)
        else:  # merge patch, or a server-side apply (as a merge of what it names)
            patch = req.body if "apply-patch" not in req.content_type else \
                {k: v for k, v in req.body.items() if k in ("metadata", "status", "spec")}
            wanted = (patch.get("metadata") or {}).get("resourceVersion")
            if wanted and wanted != held["metadata"]["resourceVersion"]:
                return _status(409, "Conflict", "the object has been modified")
            uid = (patch.get("metadata") or {}).get("uid")
            if uid and uid != held["metadata"]["uid"]:
                return _status(409, "Conflict", f"Precondition failed: UID in precondition: {uid}, "
                                                f"UID in object meta: {held['metadata']['uid']}")
            if sub == "status":
                patch = {"status": patch.get("status") or {}}
            new = _merge(copy.deepcopy(held), patch)
            new["metadata"]["uid"] = held["metadata"]["uid"]
        return self._store(path, new)

    def _delete(self, path: str, options: Body, graceful: bool) -> httpx.Response:
        """A pod is deleted gracefully, as the API server does for a pod bound to a node: it stays,
        with its deletionTimestamp at the end of its grace period, until its kubelet says it is
        gone (`gone`); anything else goes at once unless a finalizer holds it."""
        held = self.objects.get(path)
        if held is None:
            return _status(404, "NotFound", f"{path} not found")
        pre = options.get("preconditions") or {}
        if pre.get("uid") and pre["uid"] != held["metadata"]["uid"] or \
                pre.get("resourceVersion") and pre["resourceVersion"] != held["metadata"]["resourceVersion"]:
            return _status(409, "Conflict", "Precondition failed")
        if held["metadata"].get("finalizers") or graceful:
            held = copy.deepcopy(held)
            grace = options.get("gracePeriodSeconds", (held.get("spec") or {}).get(
                "terminationGracePeriodSeconds", 30)) if graceful else 0
            held["metadata"].setdefault("deletionTimestamp", _time(self.now() + dt.timedelta(seconds=grace)))
            return self._store(path, held, keep=graceful)
        del self.objects[path]
        return _answer(200, held)

    def _store(self, path: str, new: Body, keep: bool = False) -> httpx.Response:
        meta = new["metadata"]
        if meta.get("deletionTimestamp") and not meta.get("finalizers") and not keep:
            self.objects.pop(path, None)
            return _answer(200, new)
        meta["resourceVersion"] = self._next_rv()
        self.objects[path] = new
        return _answer(200, new)

    def _next_rv(self) -> str:
        self.rv += 1
        return str(self.rv)


def _time(at: dt.datetime) -> str:
    return at.strftime("%Y-%m-%dT%H:%M:%SZ")


def _answer(status: int, body: Body) -> httpx.Response:
    return httpx.Response(status, json=copy.deepcopy(body))


def _status(code: int, reason: str, message: str) -> httpx.Response:
    return _answer(code, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": reason,
                          "message": message, "code": code})


def _merge(into: Any, patch: Any) -> Any:
    """RFC 7386: null removes, objects merge, anything else replaces."""
    if not isinstance(patch, dict) or not isinstance(into, dict):
        return copy.deepcopy(patch)
    for key, value in patch.items():
        if value is None:
            into.pop(key, None)
        else:
            into[key] = _merge(into.get(key), value)
    return into


def _json_patch(doc: Body, op: Body) -> str | None:
    """Applies one RFC 6902 operation (add, remove, replace, test); returns why it failed, if it did."""
    parts = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
    parent: Any = doc
    for part in parts[:-1]:
        try:
            parent = parent[int(part)] if isinstance(parent, list) else parent[part]
        except (KeyError, IndexError, ValueError):
            return f"path {op['path']} does not exist"
    last = parts[-1]
    index = int(last) if isinstance(parent, list) and last != "-" else None
    try:
        if op["op"] == "test":
            current = parent[index] if index is not None else parent[last]
            return None if current == op["value"] else f"test failed at {op['path']}"
        if op["op"] == "remove":
            del parent[index if index is not None else last]
        elif op["op"] == "replace":
            _ = parent[index if index is not None else last]  # must exist
            parent[index if index is not None else last] = op["value"]
        elif op["op"] == "add":
            if isinstance(parent, list):
                parent.insert(len(parent) if last == "-" else int(last), op["value"])
            else:
                parent[last] = op["value"]
    except (KeyError, IndexError):
        return f"path {op['path']} does not exist"
    return None


def _labels_match(obj: Body, selector: str) -> bool:
    labels = (obj.get("metadata") or {}).get("labels") or {}
    for term in filter(None, selector.split(",")):
        key, _, value = term.partition("=")
        if (value and labels.get(key) != value) or (not value and key not in labels):
            return False
    return True


def _fields_match(obj: Body, selector: str) -> bool:
    for term in filter(None, selector.split(",")):
        dotted, _, value = term.partition("=")
        node: Any = obj
        for part in dotted.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if str(node) != value:
            return False
    return True
