"""Which WorkerClass a run takes, what it takes from it, and the bounds it breaks (pure).

The API server refuses a run that breaks its class's bounds at admission (policies/workerclass-
bounds.yaml); `violations` says the same in the same words before a run's first attempt, for the
runs admission could not judge: one created before its class, or waiting while its class was
tightened. A run that is pinned (api/workerclass.py) is judged by nothing here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from tether.api import workerclass as wc
from tether.api.models import WorkerRun
from tether.api.workerclass import WorkerClass


@dataclass(frozen=True)
class KnownClass:
    """A WorkerClass as the operator holds it: parsed, and its defaults as served."""

    model: WorkerClass
    defaults: Mapping[str, Any]

    @staticmethod
    def of(body: dict[str, Any]) -> "KnownClass":
        return KnownClass(WorkerClass.model_validate(body), wc.as_dict(wc.as_dict(body.get("spec")).get("defaults")))


@dataclass(frozen=True)
class ClassResolution:
    """What an unpinned run takes: the class (None: it names none and there is no default), its
    defaults, and why the run may not start yet (the class is missing, or a bound is broken)."""

    name: str | None
    defaults: Mapping[str, Any] = field(default_factory=dict)  # the class's spec.defaults
    missing: bool = False
    violations: tuple[str, ...] = ()
    # The operator could not list the classes yet (unknown: nothing may start that a class would
    # have shaped; deletion and finished runs go on).
    unknown: str | None = None


def class_holds(r: ClassResolution | None) -> str | None:
    """Why the run's class keeps it from starting (None: it does not): also why its Kueue Workload
    must hold no quota meanwhile."""
    if r is None:
        return None
    if r.unknown is not None:
        return f"the WorkerClasses could not be listed ({r.unknown})"
    if r.missing:
        return f"its WorkerClass {r.name} does not exist"
    if r.violations:
        return "; ".join(r.violations)
    return None


def default_class(classes: Mapping[str, KnownClass]) -> KnownClass | None:
    """The class marked default; of several, the newest (as Kubernetes picks a default StorageClass)."""
    marked = [k for k in classes.values() if k.model.is_default]
    if not marked:
        return None
    return max(marked, key=lambda k: (k.model.metadata.creation_timestamp is not None,
                                      k.model.metadata.creation_timestamp, k.model.metadata.name))


def resolve(body: dict[str, Any], classes: Mapping[str, KnownClass]) -> tuple[ClassResolution, WorkerRun]:
    """The class of an unpinned run (its body as served), what it takes from it, and the run as its
    decisions read it (those defaults applied; parsed once, here)."""
    spec = wc.as_dict(body.get("spec"))
    named = spec.get("className")
    if isinstance(named, str) and named:
        known = classes.get(named)
        if known is None:
            return ClassResolution(named, missing=True), WorkerRun.model_validate(body)
        judges = [known]
    else:
        known = default_class(classes)
        if known is None:
            return ClassResolution(None), WorkerRun.model_validate(body)
        # Every default class's bounds, as the admission policy judges them; the newest's defaults.
        judges = [k for k in classes.values() if k.model.is_default]
    run = WorkerRun.model_validate(wc.with_defaults(body, known.defaults))
    broken = tuple(v for judge in judges for v in violations(run, judge.model))
    return ClassResolution(known.model.metadata.name, known.defaults, violations=broken), run


def violations(run: WorkerRun, cls: WorkerClass) -> tuple[str, ...]:
    """The bounds of `cls` that `run` (with its class's defaults applied) breaks, as the admission
    policy words them."""
    b, spec, name = cls.spec.bounds, run.spec, cls.metadata.name
    out: list[str] = []

    def over(field_: str, bound_name: str, bound: int | None, value: int | None, unit: str = "") -> None:
        if bound is not None and value is not None and value > bound:
            out.append(f"WorkerClass {name} bounds {field_} at {bound}{unit} ({bound_name}); this run asks for "
                       f"{value}{unit}")

    if b.executors is not None and spec.executor not in b.executors:
        out.append(f"WorkerClass {name} allows executors {', '.join(b.executors)}; this run's is {spec.executor}")
    over("spec.lease.durationSeconds", "maxLeaseDurationSeconds", b.max_lease_duration_seconds,
         spec.lease.duration_seconds, "s")
    over("spec.deadlineSeconds", "maxDeadlineSeconds", b.max_deadline_seconds, spec.deadline_seconds, "s")
    over("spec.retry.maxAttempts", "maxAttempts", b.max_attempts, spec.retry.max_attempts)
    budget = spec.budget
    over("spec.budget.capCents", "maxCapCents", b.max_cap_cents, budget.cap_cents if budget else None)
    over("spec.budget.maxTokens", "maxTokens", b.max_tokens, budget.max_tokens if budget else None)
    pod = (spec.template or {}).get("spec") if spec.executor == "Pod" else None
    if isinstance(pod, dict):
        if b.image_prefixes is not None:
            for container in [*(pod.get("initContainers") or []), *(pod.get("containers") or [])]:
                image = str((container or {}).get("image", ""))
                if not any(image.startswith(p) for p in b.image_prefixes):
                    out.append(f"WorkerClass {name} allows images under {', '.join(b.image_prefixes)}; "
                               f"container {(container or {}).get('name', '')} runs {image}")
        account = pod.get("serviceAccountName")
        if b.service_account_names is not None and account and account not in b.service_account_names:
            out.append(f"WorkerClass {name} allows ServiceAccounts {', '.join(b.service_account_names)}; "
                       f"this run names {account}")
    return tuple(out)
