"""The API server's audit log, read into typed records.

The local control plane writes it when started with `audit=True` (the test session's
cluster does; TETHER_TEST_AUDIT_LOG names the file). It is an account of every write
that Tether's own code did not produce, so the fault trials' oracle judges from it:
who wrote which Lease or status, with which body, and what the API server answered.
Only events of stage ResponseComplete are kept: one per finished request.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

POD_NAME_KEY = "authentication.kubernetes.io/pod-name"
POD_UID_KEY = "authentication.kubernetes.io/pod-uid"
VALIDATION_FAILURE = "validation.policy.admission.k8s.io/validation_failure"
WRITE_VERBS = frozenset({"create", "update", "patch", "delete", "deletecollection"})
_STAMP = re.compile(r"tether-apiproxy\(client=(?P<client>[^;()]+);sent=(?P<sent>[^;()]+)\)")


@dataclass(frozen=True)
class ProxyStamp:
    """What the test API proxy (testkit/apiproxy.py) appends to the User-Agent of a client it
    knows by name: which client sent the request and when the proxy received it. The audit log
    keeps the User-Agent, so it tells the operator's replicas (one proxy, one identity) apart, and
    says when a request was sent even if a fault held it up before it reached the API server."""

    client: str
    sent: dt.datetime

    def user_agent(self, original: str) -> str:
        return f"{original} tether-apiproxy(client={self.client};sent={self.sent.isoformat()})".strip()

    @classmethod
    def parse(cls, user_agent: str) -> "ProxyStamp | None":
        m = _STAMP.search(user_agent)
        return cls(m["client"], dt.datetime.fromisoformat(m["sent"])) if m else None


@dataclass(frozen=True)
class ObjectRef:
    resource: str
    namespace: str
    name: str
    api_group: str = ""
    subresource: str = ""

    @classmethod
    def parse(cls, doc: dict[str, Any]) -> "ObjectRef":
        return cls(resource=doc.get("resource", ""), namespace=doc.get("namespace", ""),
                   name=doc.get("name", ""), api_group=doc.get("apiGroup", ""),
                   subresource=doc.get("subresource", ""))


@dataclass(frozen=True)
class User:
    username: str
    groups: tuple[str, ...] = ()
    extra: dict[str, tuple[str, ...]] = field(default_factory=dict)

    @property
    def pod(self) -> str | None:
        """The pod a pod-bound service-account token names (the kubelet's tokens do)."""
        names = self.extra.get(POD_NAME_KEY, ())
        return names[0] if len(names) == 1 else None

    @property
    def pod_uid(self) -> str | None:
        """The UID of that pod: tells a pod from a namesake created after it was deleted."""
        uids = self.extra.get(POD_UID_KEY, ())
        return uids[0] if len(uids) == 1 else None

    @classmethod
    def parse(cls, doc: dict[str, Any]) -> "User":
        return cls(username=doc.get("username", ""), groups=tuple(doc.get("groups") or ()),
                   extra={k: tuple(v) for k, v in (doc.get("extra") or {}).items()})


@dataclass(frozen=True)
class AuditRecord:
    audit_id: str
    verb: str
    request_uri: str
    user: User
    object_ref: ObjectRef | None
    code: int
    message: str
    request_object: dict[str, Any] | None
    response_object: dict[str, Any] | None
    received: dt.datetime
    completed: dt.datetime
    annotations: dict[str, str]
    user_agent: str = ""
    impersonated: User | None = None  # whom the user acted as (Impersonate-User), if anyone

    @property
    def stamp(self) -> ProxyStamp | None:
        """Who sent it and when, if it came through the test API proxy as a named client."""
        return ProxyStamp.parse(self.user_agent)

    @property
    def accepted(self) -> bool:
        return 200 <= self.code < 300

    @property
    def is_write(self) -> bool:
        return self.verb in WRITE_VERBS

    @property
    def dry_run(self) -> bool:
        """Admitted or refused like a write, but never stored."""
        return "dryRun=" in self.request_uri

    @property
    def denied_by(self) -> list[str]:
        """Admission policies that refused the request (their bindings audit refusals)."""
        raw = self.annotations.get(VALIDATION_FAILURE)
        return [entry["policy"] for entry in json.loads(raw)] if raw else []

    def about(self, resource: str, namespace: str | None = None, name: str | None = None,
              subresource: str = "") -> bool:
        ref = self.object_ref
        return (ref is not None and ref.resource == resource and ref.subresource == subresource
                and (namespace is None or ref.namespace == namespace) and (name is None or ref.name == name))

    @classmethod
    def parse(cls, doc: dict[str, Any]) -> "AuditRecord":
        status = doc.get("responseStatus") or {}
        ref = doc.get("objectRef")
        return cls(
            audit_id=doc["auditID"], verb=doc["verb"], request_uri=doc.get("requestURI", ""),
            user=User.parse(doc.get("user") or {}),
            object_ref=ObjectRef.parse(ref) if ref else None,
            code=int(status.get("code", 0)), message=status.get("message", ""),
            request_object=doc.get("requestObject"), response_object=doc.get("responseObject"),
            received=_time(doc["requestReceivedTimestamp"]), completed=_time(doc["stageTimestamp"]),
            annotations=doc.get("annotations") or {}, user_agent=doc.get("userAgent", ""),
            impersonated=User.parse(doc["impersonatedUser"]) if doc.get("impersonatedUser") else None,
        )


def _time(text: str) -> dt.datetime:
    return dt.datetime.fromisoformat(text.replace("Z", "+00:00"))


class AuditLog:
    """One audit log file, parsed incrementally: each byte is read once however often it is polled.

    `read()` returns every record seen so far, `follow()` only those new since its last call.
    With `from_end=True` the log starts empty at the moment of construction, so a test sees
    only what it caused, however long the session's log has grown.
    """

    def __init__(self, path: Path | str, from_end: bool = False, namespace: str | None = None) -> None:
        self.path = Path(path)
        self.namespace = namespace  # only requests about objects of this namespace (parsed alone)
        self._records: list[AuditRecord] = []
        self._parsed = 0  # bytes of the file turned into _records (always a line boundary)
        self._cursor = 0  # index into _records where the next follow() starts
        if from_end:
            data = self.path.read_bytes()
            self._parsed = data.rfind(b"\n") + 1

    @classmethod
    def from_env(cls, from_end: bool = False, namespace: str | None = None) -> "AuditLog":
        path = os.environ.get("TETHER_TEST_AUDIT_LOG")
        if not path:
            raise RuntimeError("no audit log: the local control plane sets TETHER_TEST_AUDIT_LOG")
        return cls(path, from_end=from_end, namespace=namespace)

    def read(self) -> list[AuditRecord]:
        """Every completed request logged so far (since construction, with from_end)."""
        self._catch_up()
        return list(self._records)

    def follow(self) -> list[AuditRecord]:
        """Completed requests logged since the previous follow() (all of them the first time)."""
        self._catch_up()
        new, self._cursor = self._records[self._cursor:], len(self._records)
        return new

    def skip_to_end(self) -> None:
        """Makes the next follow() start after everything logged so far."""
        self._catch_up()
        self._cursor = len(self._records)

    def wait_for(self, predicate: Callable[[AuditRecord], bool], timeout: float = 10,
                 what: str = "an audit event") -> AuditRecord:
        """Polls the log (events land as requests complete) for the first record that matches."""
        deadline = time.monotonic() + timeout
        checked = 0
        while True:
            self._catch_up()
            found = next((r for r in self._records[checked:] if predicate(r)), None)
            if found is not None:
                return found
            checked = len(self._records)
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout}s waiting for {what} in {self.path}")
            time.sleep(0.1)

    def _catch_up(self) -> None:
        with self.path.open("rb") as f:
            f.seek(self._parsed)
            data = f.read()
        # The API server may be writing the last line right now: stop at the last newline.
        end = data.rfind(b"\n") + 1
        self._records.extend(record for record, _ in parse_lines(data[:end], self.namespace))
        self._parsed += end


def parse_lines(data: bytes, namespace: str | None = None,
                cut: bool = False) -> Iterator[tuple[AuditRecord, bytes]]:
    """The completed requests in whole audit-log lines, with their line; with `namespace`, only
    those about its objects, and the others are not parsed (late in make test the shared log is
    100 MB, and reading it whole cost seconds per reader). `cut`: a first line cut by a read that
    started mid-line is skipped rather than an error."""
    needle = f'"namespace":"{namespace}"'.encode() if namespace is not None else None
    for line in data.splitlines():
        if not line.strip() or (needle is not None and needle not in line):
            continue
        try:
            doc = json.loads(line)
        except ValueError:
            if cut:
                continue
            raise
        if doc.get("stage") != "ResponseComplete":
            continue
        if namespace is not None and (doc.get("objectRef") or {}).get("namespace") != namespace:
            continue
        yield AuditRecord.parse(doc), line
