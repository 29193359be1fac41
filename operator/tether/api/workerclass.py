"""WorkerClass: what a kind of run may ask for (bounds, enforced by the API server at admission) and
what it gets when it leaves something out (defaults). Mirrors crds/workerclasses.tether.dev.yaml.

How a run takes its class's defaults (`applied_defaults`), on the bodies as the API server serves
them, because "left out" is a key that is absent, which a parsed model no longer says:

- lease and retry as a whole (their fields depend on each other: a lease's duration must exceed
  twice its renew interval); deadlineSeconds, progressDeadlineSeconds, stopGraceSeconds and
  ttlSecondsAfterFinished each on their own;
- budget and review field by field (a run that sets its own cap keeps the class's WorkerBudget);
- the Kueue queue and priority class as the run's `kueue.x-k8s.io/*` labels, unless it has them.

The class's defaults are recorded in `status.class` and fixed once the run's first attempt is
granted or its start approval is asked for (`pinned`): a class edited later never changes a run that
started, and a field the run removes from its spec later falls back to the class's default as it
was (never to no bound at all).
"""

from __future__ import annotations

import copy
import datetime as dt
from typing import Any, Literal, Mapping

from pydantic import Field

from tether.api.constants import LABEL_PRIORITY_CLASS, LABEL_QUEUE_NAME
from tether.api.models import BudgetSpec, LeaseSpec, RetrySpec, ReviewSpec, RunClassStatus, WorkerRun, _Model

CLASS_PLURAL = "workerclasses"
# On the class a run uses when it names none (as storageclass.kubernetes.io/is-default-class).
ANN_DEFAULT_CLASS = "tether.dev/is-default-class"

WHOLE_FIELDS = ("lease", "retry", "deadlineSeconds", "progressDeadlineSeconds", "stopGraceSeconds",
                "ttlSecondsAfterFinished")
BY_KEY_FIELDS = ("budget", "review")
LABEL_FIELDS = {"queueName": LABEL_QUEUE_NAME, "priorityClassName": LABEL_PRIORITY_CLASS}


class ClassDefaults(_Model):
    lease: LeaseSpec | None = None
    retry: RetrySpec | None = None
    budget: BudgetSpec | None = None
    review: ReviewSpec | None = None
    deadline_seconds: int | None = None
    progress_deadline_seconds: int | None = None
    stop_grace_seconds: int | None = None
    ttl_seconds_after_finished: int | None = None
    queue_name: str | None = None
    priority_class_name: str | None = None


class ClassBounds(_Model):
    max_lease_duration_seconds: int | None = None
    max_deadline_seconds: int | None = None
    max_cap_cents: int | None = None
    max_tokens: int | None = None
    max_attempts: int | None = None
    executors: list[Literal["Pod", "External"]] | None = None
    image_prefixes: list[str] | None = None
    service_account_names: list[str] | None = None
    # Which classes its runs may spawn as child runs (None: any), how many each, and how deep.
    child_classes: list[str] | None = None
    max_children: int | None = None
    max_depth: int | None = None


class WorkerClassSpec(_Model):
    defaults: ClassDefaults = Field(default_factory=ClassDefaults)
    bounds: ClassBounds = Field(default_factory=ClassBounds)
    # What its runs are (tool type, model, provider): tether_workerclass_info's labels.
    labels: dict[str, str] = Field(default_factory=dict)


class ClassMeta(_Model):
    name: str
    uid: str = ""
    resource_version: str = ""
    creation_timestamp: dt.datetime | None = None
    annotations: dict[str, str] = Field(default_factory=dict)


class WorkerClass(_Model):
    metadata: ClassMeta
    spec: WorkerClassSpec = Field(default_factory=WorkerClassSpec)

    @property
    def is_default(self) -> bool:
        return self.metadata.annotations.get(ANN_DEFAULT_CLASS) == "true"


def as_dict(value: Any) -> dict[str, Any]:
    """`value` if it is an object, else an empty one (bodies as served may lack any key)."""
    return value if isinstance(value, dict) else {}


def applied_defaults(spec: Mapping[str, Any], labels: Mapping[str, str], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """What a run whose spec and labels are these takes from a class's `spec.defaults` (both as served)."""
    out: dict[str, Any] = {}
    for name in WHOLE_FIELDS:
        if name in defaults and name not in spec:
            out[name] = copy.deepcopy(defaults[name])
    for name in BY_KEY_FIELDS:
        given = as_dict(spec.get(name))
        taken = {k: copy.deepcopy(v) for k, v in as_dict(defaults.get(name)).items() if k not in given}
        if taken:
            out[name] = taken
    for name, label in LABEL_FIELDS.items():
        if name in defaults and label not in labels:
            out[name] = defaults[name]
    return out


def with_applied(body: dict[str, Any], applied: dict[str, Any]) -> dict[str, Any]:
    """The run's body as its decisions read it: `applied` merged into spec (and labels); `body`
    itself is left as it is (its resourceVersion is what writes are conditional on)."""
    if not applied:
        return body
    spec = dict(as_dict(body.get("spec")))
    meta = dict(as_dict(body.get("metadata")))
    labels = dict(as_dict(meta.get("labels")))
    for name, value in applied.items():
        if name in LABEL_FIELDS:
            labels.setdefault(LABEL_FIELDS[name], value)
        elif name in BY_KEY_FIELDS:
            spec[name] = {**as_dict(value), **as_dict(spec.get(name))}
        else:
            spec.setdefault(name, value)
    meta["labels"] = labels
    return {**body, "metadata": meta, "spec": spec}


def recorded(body: dict[str, Any]) -> RunClassStatus | None:
    """status.class as written (None: none yet, or one this version cannot read)."""
    raw = as_dict(body.get("status")).get("class")
    if not isinstance(raw, dict):
        return None
    try:
        return RunClassStatus.model_validate(raw)
    except ValueError:
        return None


def pinned(body: dict[str, Any]) -> bool:
    """Whether what the run took from its class is fixed: its first attempt was granted, or its
    start approval asked for (what a person approves is what runs). A run that started before
    classes existed is pinned with nothing taken."""
    status = as_dict(body.get("status"))
    if int(status.get("attempt") or 0) > 0 or status.get("executionDigest"):
        return True
    requests = as_dict(status.get("review")).get("requests")
    return any(as_dict(r).get("gate") == "Start" and as_dict(r).get("executionDigest")
               for r in (requests if isinstance(requests, list) else []))


def with_defaults(body: dict[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """The run's body with a class's `spec.defaults` taken for what it leaves out."""
    spec, meta = as_dict(body.get("spec")), as_dict(body.get("metadata"))
    return with_applied(body, applied_defaults(spec, as_dict(meta.get("labels")), defaults))


def effective_body(body: dict[str, Any]) -> dict[str, Any]:
    """A run's body with the class defaults it recorded (for a pinned run, what it has for good: the
    gateway's and the console's view; the operator resolves unpinned runs against the current class)."""
    taken = recorded(body)
    return with_defaults(body, taken.defaults) if taken is not None else body


def class_name(run: WorkerRun) -> str:
    """The class a run took ("" for none yet): the metrics' `class` label. Only classes that existed
    are recorded, so a run naming made-up classes makes no series."""
    taken = run.status.class_
    return (taken.name if taken is not None else None) or ""
