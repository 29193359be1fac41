"""The ownership protocol's vocabulary, in one place: pure functions, no I/O.

Every party that speaks the protocol uses these, so they cannot drift apart:
the pod worker's transport (worker/transport.py), the SDK (worker/run.py), the
gateway that speaks it for external workers (gateway/), and the operator
(kube/, controller/). What lives here:

- whether an answer is a Lease at all (`parse_lease`), and whether it is held by a given holder
  and fence (`holds`);
- whether a gateway's 200 is its reply to this attempt's renewal or claim (`gateway_reply`,
  `claim_reply`);
- the renewal a worker writes (`renewal`) and the fenced result patch (`fenced_patch`);
- the usage annotation: its format, its parser and which reports are acceptable;
- the control signals on the Lease and the cap arithmetic on them;
- the approval requests a worker writes on its Lease, and their limits;
- wire formats: the JSON-patch content type and Kubernetes time stamps.

It imports only the API models, so the SDK stays independent of the controller.
"""

from __future__ import annotations

import copy
import datetime as dt
import json
import re
from dataclasses import dataclass
from typing import Any, Mapping

from tether.api import constants as c
from tether.api.models import Signals, Usage

JSON_PATCH: dict[str, str] = {"Content-Type": "application/json-patch+json"}

# Reports beyond these are treated as malformed, not as spending (the CRD's own bounds).
MAX_CENTS = 10**11
MAX_TOKENS = 10**14


# --- time stamps ----------------------------------------------------------------


def micro_time(t: dt.datetime) -> str:
    """Kubernetes MicroTime (Lease times): RFC 3339, UTC, microseconds."""
    return t.astimezone(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def rfc3339(t: dt.datetime) -> str:
    """Kubernetes Time (whole seconds, UTC): Events, and the gateway's replies."""
    return t.astimezone(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(text: str | None) -> dt.datetime | None:
    """An API timestamp (RFC 3339, `Z`, either of the above) as an aware datetime; None for none."""
    return dt.datetime.fromisoformat(text.replace("Z", "+00:00")) if text else None


# --- who holds the Lease ----------------------------------------------------------


def parse_lease(body: str | bytes) -> dict[str, Any] | None:
    """An answer's body as a Lease, or None when it is not one: not JSON (a proxy's HTML page), JSON of
    another shape (a Status, null, a proxy's error), or a Lease whose fields the protocol reads have
    other types. Such an answer says nothing about ownership (docs/protocol.md §5.2): unconfirmed.
    The TypeScript and Go SDKs draw the same line (sdk/vectors/leases.json)."""
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):
        return None
    return doc if _is_lease(doc) else None


_STR_OR_NULL = (str, type(None))


def _is_lease(doc: Any) -> bool:
    if not isinstance(doc, dict) or doc.get("kind") not in (None, "Lease") \
            or doc.get("apiVersion") not in (None, "coordination.k8s.io/v1"):
        return False
    # Absent and null are alike, as Go's decoder has them.
    meta, spec = doc.get("metadata"), _or_empty(doc.get("spec"), {})
    if not isinstance(meta, dict) or not isinstance(spec, dict):
        return False
    rv, fence = meta.get("resourceVersion"), spec.get("leaseTransitions")
    ann, refs = _or_empty(meta.get("annotations"), {}), _or_empty(meta.get("ownerReferences"), [])
    return (isinstance(rv, str) and rv != ""  # without one, a renewal's PUT is not a compare-and-swap
            and isinstance(ann, dict) and all(isinstance(v, str) for v in ann.values())
            and isinstance(refs, list) and all(_is_owner_ref(r) for r in refs)
            and isinstance(spec.get("holderIdentity"), _STR_OR_NULL)
            and (fence is None or (isinstance(fence, int) and not isinstance(fence, bool))))


def _is_owner_ref(ref: Any) -> bool:
    return isinstance(ref, dict) and isinstance(ref.get("kind"), _STR_OR_NULL) \
        and isinstance(ref.get("uid"), _STR_OR_NULL) and isinstance(ref.get("controller"), (bool, type(None)))


def _or_empty(value: Any, empty: Any) -> Any:
    return empty if value is None else value


def annotations(obj: Mapping[str, Any] | None) -> dict[str, str]:
    return dict(((obj or {}).get("metadata") or {}).get("annotations") or {})


def lease_holder(lease: Mapping[str, Any] | None) -> tuple[str | None, int | None]:
    """(holderIdentity, leaseTransitions): the Lease's holder and the fence it was granted with."""
    spec = (lease or {}).get("spec") or {}
    return spec.get("holderIdentity"), spec.get("leaseTransitions")


def holder_renewed(lease: Mapping[str, Any] | None) -> str | None:
    """When the holder last renewed the Lease (its renewTime, on the worker's clock). None when
    nobody holds it, or when its holder never renewed: a grant writes renewTime as its acquireTime,
    and that is no sign of a worker (one whose pod was refused never ran)."""
    spec = (lease or {}).get("spec") or {}
    renewed = spec.get("renewTime")
    if not spec.get("holderIdentity") or not renewed or renewed == spec.get("acquireTime"):
        return None
    return str(renewed)


def controller_uid(obj: Mapping[str, Any] | None) -> str | None:
    """The UID of the WorkerRun that controls this object (its Lease, pod or Secret), if any."""
    for ref in ((obj or {}).get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("kind") == "WorkerRun" and ref.get("controller"):
            return str(ref.get("uid"))
    return None


def same_owner(lease_holder_identity: str | None, lease_fence: int | None, holder: str | None,
               fence: int | None) -> bool:
    """Whether a Lease's (holderIdentity, leaseTransitions) name exactly this holder and fence.
    Nobody (None) holds anything: a cleared Lease matches no holder, so a revoked attempt cannot
    mistake it for its own."""
    return holder is not None and (lease_holder_identity, lease_fence) == (holder, fence)


def holds(lease: Mapping[str, Any] | None, holder: str | None, fence: int | None,
          run_uid: str | None = None) -> bool:
    """Whether the Lease object names exactly this holder and fence (see `same_owner`) and, when
    `run_uid` is given, belongs to that run: a run deleted and re-created under the same name
    starts again at holder `<name>-a1` and fence 1, and only the UID tells the two apart."""
    return (lease is not None and same_owner(*lease_holder(lease), holder, fence)
            and (run_uid is None or controller_uid(lease) == run_uid))


# --- the gateway's replies --------------------------------------------------------


def gateway_reply(body: str | bytes, holder: str, fence: int, run_uid: str | None) -> dict[str, Any] | None:
    """An answer's body as the gateway's reply to a renewal (heartbeat, checkpoint, approval) of this
    attempt, or None when it is not one: not a JSON object with the fields the gateway always sends,
    with their types, naming this holder and fence (and this run, when the call named it). Such a 200
    came from something in between (a proxy's `{}`) and confirms nothing (docs/protocol.md §6.4).
    The TypeScript and Go SDKs draw the same line (sdk/vectors/gateway-replies.json)."""
    doc = _json_object(body)
    if doc is None or not _is_renewal_reply(doc) or (doc["holder"], doc["fence"]) != (holder, fence):
        return None
    return doc if run_uid is None or doc["runUid"] == run_uid else None


def claim_reply(body: str | bytes) -> dict[str, Any] | None:
    """An answer's body as the gateway's claim reply (a renewal reply of the attempt it hands out,
    plus the attempt's contract), or None when it is not one (docs/protocol.md §6.4)."""
    doc = _json_object(body)
    if doc is None or not _is_renewal_reply(doc):
        return None
    # Seconds may have a fraction (the CRD's are whole; a test gateway's need not be).
    contract = (doc["holder"] != "" and doc["fence"] >= 1 and doc["runUid"] != ""
                and _is_int(doc.get("attempt")) and doc["attempt"] >= 1
                and all(isinstance(doc.get(k), (int, float)) and not isinstance(doc[k], bool) and doc[k] > 0
                        for k in ("leaseDurationSeconds", "renewIntervalSeconds"))
                and isinstance(doc.get("idempotencyKey"), str)
                and isinstance(_or_empty(doc.get("payload"), {}), dict)
                and isinstance(doc.get("checkpoint"), _STR_OR_NULL)
                and isinstance(doc.get("reviewFeedback"), _STR_OR_NULL))
    return doc if contract else None


def child_reply(body: str | bytes) -> dict[str, Any] | None:
    """An answer's body as the gateway's reply to `spawn` or `child`: the child WorkerRun (an
    object whose metadata.name is a string), or None when something in between answered."""
    doc = _json_object(body)
    child = doc.get("child") if doc is not None else None
    if not isinstance(child, dict) or not isinstance(child.get("metadata"), dict):
        return None
    return child if isinstance(child["metadata"].get("name"), str) else None


def _json_object(body: str | bytes) -> dict[str, Any] | None:
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):
        return None
    return doc if isinstance(doc, dict) else None


def _is_renewal_reply(doc: dict[str, Any]) -> bool:
    # Absent and null are alike for the fields the gateway may leave empty, as Go's decoder has them.
    return (isinstance(doc.get("holder"), str) and _is_int(doc.get("fence")) and isinstance(doc.get("runUid"), str)
            and isinstance(doc.get("stop"), bool) and isinstance(doc.get("paused"), bool)
            and isinstance(doc.get("leaseExpiresAt"), str) and isinstance(doc.get("status"), str)
            and _is_time_or_null(doc.get("endsAt"))
            and all(doc.get(k) is None or _is_int(doc[k]) for k in ("capRemainingCents", "capRemainingTokens"))
            and isinstance(_or_empty(doc.get("decisions"), {}), dict)
            and _is_tool_claim_or_null(doc.get("toolClaim")))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_time_or_null(value: Any) -> bool:
    if value is None:
        return True
    try:
        return isinstance(value, str) and parse_time(value) is not None
    except ValueError:
        return False


def _is_tool_claim_or_null(value: Any) -> bool:
    return value is None or (isinstance(value, dict) and all(
        isinstance(value.get(k), str) for k in ("token", "expiresAt", "serviceAccount")))


# --- usage ------------------------------------------------------------------------


def usage_annotation(usage: Usage | Mapping[str, int]) -> str:
    """The `tether.dev/usage` value: the attempt's cumulative usage, compact JSON."""
    cents, tokens = (usage.cents, usage.tokens) if isinstance(usage, Usage) else \
        (usage.get("cents", 0), usage.get("tokens", 0))
    return json.dumps({"cents": cents, "tokens": tokens}, separators=(",", ":"))


def parse_usage(raw: str | None) -> Usage | None:
    """The usage annotation as written by a worker; None when absent.

    Raises ValueError when it is not `{"cents": int, "tokens": int}` (booleans and floats are
    not integers here: JSON `true` or `1.5` is a malformed report, not one cent)."""
    if not raw:
        return None
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"not JSON: {exc}") from exc
    if not isinstance(doc, dict):
        raise ValueError("not a JSON object")
    cents, tokens = doc.get("cents", 0), doc.get("tokens", 0)
    if isinstance(cents, bool) or isinstance(tokens, bool) or not isinstance(cents, int) \
            or not isinstance(tokens, int):
        raise ValueError("cents and tokens must be integers")
    return Usage(cents=cents, tokens=tokens)


def valid_report(report: Usage, previous: Usage | None) -> str | None:
    """Why a worker's cumulative usage report is refused, or None if it is acceptable."""
    if report.cents < 0 or report.tokens < 0:
        return "negative usage"
    if report.cents > MAX_CENTS or report.tokens > MAX_TOKENS:
        return "implausibly large usage"
    if previous is not None and (report.cents < previous.cents or report.tokens < previous.tokens):
        return "usage decreased; reports are cumulative"
    return None


def lease_usage(lease: Mapping[str, Any] | None) -> Usage | None:
    """The usage the Lease carries now, or None when there is none or it is malformed."""
    try:
        return parse_usage(annotations(lease).get(c.ANN_USAGE))
    except ValueError:
        return None


# --- control signals and caps -----------------------------------------------------


def signals_annotation(signals: Signals) -> str:
    """The `tether.dev/signals` value the operator writes: canonical JSON, so equal signals give
    equal strings and an unchanged signal costs no write. No decisions (no yield), no key: a run
    without requests (never evicted) carries the same signals as before there were any."""
    doc = signals.dump()
    if not doc.get("decisions"):
        doc.pop("decisions", None)
    if not doc.get("yield"):
        doc.pop("yield", None)  # only an eviction says it: every other Lease keeps its signals as they were
    return json.dumps(doc, sort_keys=True, separators=(",", ":"))


def lease_signals(lease: Mapping[str, Any] | None) -> Signals | None:
    """The operator's signals on the Lease; no annotation means no signal (defaults).
    None when the annotation is malformed: keep the last good signals rather than guess."""
    raw = annotations(lease).get(c.ANN_SIGNALS)
    if not raw:
        return Signals()
    try:
        # Strict: the types docs/protocol.md §7 gives ("stop": "true" is malformed, not true),
        # as the TypeScript and Go SDKs read them.
        return Signals.model_validate_json(raw, strict=True)
    except ValueError:
        return None


def cap_remaining(cap: int | None, base: int, own: int) -> int | None:
    """What is left of a run's cap for the current attempt: the cap minus what earlier
    attempts spent (`base`) minus the attempt's own report. None: no cap."""
    return None if cap is None else cap - base - own


def remaining(signals: Signals, own: Usage | None) -> tuple[int | None, int | None]:
    """(cents, tokens) left of the run's caps, counting the attempt's own usage `own`."""
    own = own or Usage()
    return (cap_remaining(signals.cap_cents, signals.base_cents, own.cents),
            cap_remaining(signals.cap_tokens, signals.base_tokens, own.tokens))


def signals_from_remaining(stop: bool, paused: bool, ends_at: str | dt.datetime | None, cents_left: int | None,
                           tokens_left: int | None, own: Usage | None) -> Signals:
    """The inverse of `remaining`: signals equivalent to a reply that states what was left when
    `own` was reported (the gateway's flat reply). `remaining(result, later_own)` then counts
    usage reported after that reply, as it does for a pod worker."""
    own = own or Usage()
    return Signals.model_validate({"stop": stop, "paused": paused, "ends_at": ends_at,
                                   "cap_cents": None if cents_left is None else cents_left + own.cents,
                                   "cap_tokens": None if tokens_left is None else tokens_left + own.tokens})


# --- the worker's two writes -----------------------------------------------------


def renewal(lease: Mapping[str, Any], now: dt.datetime, *, checkpoint: str | None = None,
            usage: Usage | Mapping[str, int] | None = None,
            extra_annotations: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The body of a heartbeat: the Lease as last seen (its resourceVersion makes the PUT a
    compare-and-swap), renewTime set, checkpoint and usage riding on the same write."""
    body = copy.deepcopy(dict(lease))
    body["spec"] = dict(body.get("spec") or {})
    body["spec"]["renewTime"] = micro_time(now)
    meta = body.setdefault("metadata", {})
    ann = dict(meta.get("annotations") or {})
    if checkpoint is not None:
        ann[c.ANN_CHECKPOINT] = checkpoint
    if usage is not None:
        ann[c.ANN_USAGE] = usage_annotation(usage)
    ann.update(extra_annotations or {})
    meta["annotations"] = ann
    return body


RESULT_FIELDS = ("result", "error")


# The attempt outcome that only a published result or error produces.
PUBLISHED_OUTCOME = {"result": "Succeeded", "error": "WorkerFailed"}


def publication_recorded(run: Mapping[str, Any], holder: str, fence: int, field: str, value: Any) -> bool:
    """Whether the run shows that this attempt's `field` was accepted: after a request whose answer
    was lost, the retry is refused (a success moves the fence too), yet the first one landed."""
    status = run.get("status") or {}
    if status.get("holder") == holder and status.get("fence") == fence:
        return status.get(field) == value
    mine = [a for a in status.get("attempts") or [] if a.get("holder") == holder and a.get("fence") == fence]
    return bool(mine) and mine[-1].get("outcome") == PUBLISHED_OUTCOME.get(field) and \
        (field != "result" or status.get("result") == value)


def fenced_patch(holder: str, fence: int, field: str, value: Any, run_uid: str | None = None,
                 resource_version: str | None = None) -> list[dict[str, Any]]:
    """The JSON patch that publishes a result or an error only while `fence` and `holder` are
    still the run's (and, given `run_uid`, only to that run, never to a namesake created since):
    the API server applies the `add` only if every `test` holds (else 422). Given a
    `resource_version`, only onto exactly that version of the run (the gateway's compare-and-swap)."""
    if field not in RESULT_FIELDS:
        raise ValueError(f"a worker publishes only {RESULT_FIELDS}, not {field!r}")
    same_run = [] if run_uid is None else [{"op": "test", "path": "/metadata/uid", "value": run_uid}]
    same_version = [] if resource_version is None else \
        [{"op": "test", "path": "/metadata/resourceVersion", "value": resource_version}]
    return [*same_run,
            {"op": "test", "path": "/status/fence", "value": fence},
            {"op": "test", "path": "/status/holder", "value": holder},
            *same_version,
            {"op": "add", "path": f"/status/{field}", "value": value}]


# etcd refuses a write that would make one object larger than it stores (1.5 MiB; its client's
# 2 MiB past that): the API server passes it on as a 500 with only this message, no reason.
TOO_LARGE_MESSAGES = ("etcdserver: request is too large", "trying to send message larger than max")


def too_large(status: int, status_body: str | bytes | Mapping[str, Any] | None) -> bool:
    """Whether the API server refused a write as too large: 413 (over its request limit) or a 500
    Status with etcd's message. Either refuses the same value every time: a bad result, never an
    outage to retry (sdk/vectors/publications.json, shared with the TypeScript and Go SDKs)."""
    if status == 413:
        return True
    message = _status_doc(status_body).get("message") if status == 500 else None
    return isinstance(message, str) and any(m in message for m in TOO_LARGE_MESSAGES)


def _status_doc(status_body: str | bytes | Mapping[str, Any] | None) -> Mapping[str, Any]:
    """The API server's Status object, or {} when the body is not one (a proxy's page)."""
    doc: Any = status_body
    if isinstance(doc, (str, bytes)):
        try:
            doc = json.loads(doc)
        except (ValueError, RecursionError):
            return {}
    return doc if isinstance(doc, Mapping) else {}


def invalid_causes(status_body: str | bytes | Mapping[str, Any] | None) -> list[dict[str, Any]]:
    """The fields a 422 Status names (`details.causes`); empty when it names none.

    The API server answers 422 for two different things: a JSON-patch `test` that did not hold
    (the patch is never applied; the Status has no details at all) and a value the CRD's schema
    refuses (the Status names the kind and lists each refused field in `details.causes`). For a
    fenced publication every `test` is on a field only a change of ownership moves (uid, fence,
    holder), so "422 without causes" is lost ownership and "422 with causes" is a bad value."""
    details = _status_doc(status_body).get("details")
    causes = details.get("causes") if isinstance(details, Mapping) else None
    return [dict(c) for c in causes if isinstance(c, Mapping)] if isinstance(causes, list) else []


def refuses_value(causes: list[dict[str, Any]], field: str) -> bool:
    """Whether a 422's causes name the published value itself (`status.result...`): only then is
    it a bad value. Causes about other fields say nothing this publication can fix."""
    return any(str(c.get("field") or "").split("[")[0].split(".")[:2] == ["status", field] for c in causes)


# --- approval requests (docs/protocol.md §9) ---------------------------------------

# A request's name: what a WorkerRunApproval's spec.gate names (start and result are the
# run's own gates, Start and Result, which a worker cannot ask for).
REQUEST_NAME = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")  # fullmatch: `$` passes a trailing newline
RESERVED_REQUEST_NAMES = frozenset({"start", "result"})
MAX_REQUESTS_PER_ATTEMPT = 20
MAX_REQUEST_DETAILS = 4096
MAX_REQUEST_TIMEOUT = 31_536_000
# A publication (and the read that checks whether a lost one landed) waits this long for its answer,
# not T (docs/protocol.md §3): its body may be megabytes that the API server decodes and validates
# before answering, and the heartbeat goes on meanwhile, so a long wait costs no liveness, while T
# would count a slow answer as none and send the same megabytes again and again.
PUBLICATION_TIMEOUT = 30.0
# The annotation as a whole (the Lease's annotations share 256 KiB with the operator's signals,
# which must always fit); the admission policy refuses a worker's larger one.
MAX_REQUESTS_BYTES = 65_536


@dataclass(frozen=True)
class ApprovalRequest:
    """One approval a worker asks for: its name, what it wants to do, how long it waits."""

    name: str
    details: str = ""
    timeout_seconds: int | None = None


def request_refusal(name: object, details: object, timeout: object) -> str | None:
    """Why a worker's approval request is malformed, or None."""
    if not isinstance(name, str) or not REQUEST_NAME.fullmatch(name):
        return "a request's name is lower-case letters, digits and '-', 1 to 63 characters"
    if name in RESERVED_REQUEST_NAMES:
        return f"{name!r} names a gate of the run itself (Start, Result), not a request"
    if not isinstance(details, str) or len(details) > MAX_REQUEST_DETAILS:
        return f"details must be a string of at most {MAX_REQUEST_DETAILS} characters"
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, int)
                                or not 1 <= timeout <= MAX_REQUEST_TIMEOUT):
        return f"timeoutSeconds must be an integer from 1 to {MAX_REQUEST_TIMEOUT}"
    return None


def requests_annotation(requests: Mapping[str, ApprovalRequest]) -> str:
    """The `tether.dev/requests` value a worker writes: every request of its attempt, by name."""
    return json.dumps({r.name: {"details": r.details, **({"timeoutSeconds": r.timeout_seconds}
                                                         if r.timeout_seconds is not None else {})}
                       for r in requests.values()}, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def parse_requests(raw: str | None) -> tuple[ApprovalRequest, ...]:
    """The requests annotation; () when absent. Raises ValueError when it is malformed as a whole
    (not a JSON object of objects, a malformed entry, too many): nothing of it is taken, because a
    worker that wrote it cannot tell which part would be."""
    if not raw:
        return ()
    if len(raw.encode()) > MAX_REQUESTS_BYTES:
        raise ValueError(f"larger than {MAX_REQUESTS_BYTES} bytes")
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"not JSON: {exc}") from exc
    if not isinstance(doc, dict) or not all(isinstance(v, dict) for v in doc.values()):
        raise ValueError("not a JSON object of request objects")
    if len(doc) > MAX_REQUESTS_PER_ATTEMPT:
        raise ValueError(f"{len(doc)} requests; an attempt may make at most {MAX_REQUESTS_PER_ATTEMPT}")
    out = []
    for name, body in sorted(doc.items()):
        details, timeout = body.get("details", ""), body.get("timeoutSeconds")
        why = request_refusal(name, details, timeout)
        if why is not None:
            raise ValueError(f"request {str(name)[:70]!r}: {why}")
        out.append(ApprovalRequest(name=name, details=details, timeout_seconds=timeout))
    return tuple(out)
