"""WorkerClass resolution and bounds (core/classes.py, api/workerclass.py), and the class gate in
decide: tables on bodies as the API server serves them."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest

from tether.api import workerclass as wc
from tether.api.models import Phase, WorkerRun
from tether.core.classes import ClassResolution, KnownClass, default_class, resolve, violations
from tether.core.decide import EnsureLease, EnsurePod, Observed, WriteStatus, decide

pytestmark = pytest.mark.unit

T0 = dt.datetime(2026, 12, 7, 12, 0, 0, tzinfo=dt.timezone.utc)
CONTAINERS = [{"name": "w", "image": "registry.example.com/tools/w:1"}]


def body(spec: dict[str, Any] | None = None, status: dict[str, Any] | None = None,
         labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {"metadata": {"name": "job", "namespace": "ns", "uid": "u-1", "generation": 1, "labels": labels or {}},
            "spec": {"executor": "Pod", "template": {"spec": {"containers": CONTAINERS}}, **(spec or {})},
            "status": status or {}}


def klass(name: str = "tool-call", defaults: dict[str, Any] | None = None, bounds: dict[str, Any] | None = None,
          default: bool = False, created: str = "2026-12-01T00:00:00Z") -> KnownClass:
    meta: dict[str, Any] = {"name": name, "creationTimestamp": created}
    if default:
        meta["annotations"] = {wc.ANN_DEFAULT_CLASS: "true"}
    return KnownClass.of({"metadata": meta, "spec": {"defaults": defaults or {}, "bounds": bounds or {}}})


TOOL = {"lease": {"durationSeconds": 20, "renewIntervalSeconds": 5, "startupGraceSeconds": 30},
        "retry": {"maxAttempts": 5}, "budget": {"capCents": 50, "budgetRef": {"name": "team"}},
        "review": {"result": True}, "stopGraceSeconds": 10, "deadlineSeconds": 600, "queueName": "tools"}


@pytest.mark.parametrize("spec,labels,applied", [
    # Nothing set: everything the class has.
    ({}, {}, {**{k: v for k, v in TOOL.items()}}),
    # lease and retry whole: a run's own lease takes nothing of the class's lease.
    ({"lease": {"durationSeconds": 40}}, {}, {k: v for k, v in TOOL.items() if k != "lease"}),
    # budget by field: its own cap keeps the class's WorkerBudget.
    ({"budget": {"capCents": 20}}, {}, {**{k: v for k, v in TOOL.items() if k != "budget"},
                                        "budget": {"budgetRef": {"name": "team"}}}),
    # review by field.
    ({"review": {"start": True}}, {}, TOOL),
    ({"review": {"result": False}}, {}, {k: v for k, v in TOOL.items() if k != "review"}),
    # The run's own queue label wins.
    ({}, {"kueue.x-k8s.io/queue-name": "mine"}, {k: v for k, v in TOOL.items() if k != "queueName"}),
    ({"stopGraceSeconds": 0, "deadlineSeconds": 5}, {}, {k: v for k, v in TOOL.items()
                                                         if k not in ("stopGraceSeconds", "deadlineSeconds")}),
])
def test_a_run_takes_what_it_leaves_out(spec: dict[str, Any], labels: dict[str, str], applied: dict[str, Any]) -> None:
    assert wc.applied_defaults(spec, labels, TOOL) == applied


def test_the_class_defaults_reach_the_parsed_run_and_leave_the_body_alone() -> None:
    b = body({"budget": {"capCents": 20}, "className": "tool-call"})
    r, _ = resolve(b, {"tool-call": klass(defaults=TOOL)})
    run = WorkerRun.model_validate(wc.with_defaults(b, r.defaults))
    assert (run.spec.lease.duration_seconds, run.spec.retry.max_attempts, run.spec.stop_grace_seconds) == (20, 5, 10)
    assert run.spec.budget is not None and run.spec.budget.cap_cents == 20 and run.spec.budget.budget_ref.name == "team"
    assert run.spec.review.result and not run.spec.review.start
    assert run.metadata.labels["kueue.x-k8s.io/queue-name"] == "tools"
    assert "lease" not in b["spec"] and b["metadata"]["labels"] == {}


@pytest.mark.parametrize("classes,named,expected", [
    ({}, None, ClassResolution(None)),
    ({}, "tool-call", ClassResolution("tool-call", missing=True)),
    ({"a": klass("a")}, None, ClassResolution(None)),  # no default class
    ({"a": klass("a", default=True)}, None, ClassResolution("a")),
    # Of two defaults, the newest (as Kubernetes picks a default StorageClass).
    ({"a": klass("a", default=True, created="2026-12-01T00:00:00Z"),
      "b": klass("b", default=True, created="2026-12-02T00:00:00Z")}, None, ClassResolution("b")),
    ({"a": klass("a", default=True), "b": klass("b")}, "b", ClassResolution("b")),
])
def test_which_class_a_run_takes(classes: dict[str, KnownClass], named: str | None,
                                 expected: ClassResolution) -> None:
    got, _ = resolve(body({"className": named} if named else {}), classes)
    assert (got.name, got.missing, got.violations) == (expected.name, expected.missing, expected.violations)


def test_of_two_default_classes_every_ones_bounds_judge_a_run_that_names_none() -> None:
    """As the admission policy does (it checks every default class): the newest's defaults, all bounds."""
    older = klass("older", bounds={"maxLeaseDurationSeconds": 60}, default=True, created="2026-12-01T00:00:00Z")
    newer = klass("newer", defaults={"lease": {"durationSeconds": 3600, "renewIntervalSeconds": 30}},
                  default=True, created="2026-12-02T00:00:00Z")
    r, _ = resolve(body(), {"older": older, "newer": newer})
    assert r.name == "newer"
    assert r.violations == ("WorkerClass older bounds spec.lease.durationSeconds at 60s (maxLeaseDurationSeconds); "
                            "this run asks for 3600s",)


def test_default_class_none_without_a_marked_one() -> None:
    assert default_class({"a": klass("a")}) is None


BOUNDS = {"maxLeaseDurationSeconds": 60, "maxDeadlineSeconds": 3600, "maxCapCents": 100, "maxTokens": 1000,
          "maxAttempts": 5, "executors": ["Pod"], "imagePrefixes": ["registry.example.com/tools/"],
          "serviceAccountNames": ["tools"]}
BOUNDED = {"lease": {"durationSeconds": 30, "renewIntervalSeconds": 5}, "deadlineSeconds": 600,
           "budget": {"capCents": 50, "maxTokens": 500}}


@pytest.mark.parametrize("spec,broken", [
    ({}, []),
    ({"lease": {"durationSeconds": 90, "renewIntervalSeconds": 30}},
     ["WorkerClass c bounds spec.lease.durationSeconds at 60s (maxLeaseDurationSeconds); this run asks for 90s"]),
    ({"deadlineSeconds": 7200},
     ["WorkerClass c bounds spec.deadlineSeconds at 3600s (maxDeadlineSeconds); this run asks for 7200s"]),
    ({"budget": {"capCents": 101}}, ["WorkerClass c bounds spec.budget.capCents at 100 (maxCapCents); this run asks for 101"]),
    ({"budget": {"maxTokens": 1001}}, ["WorkerClass c bounds spec.budget.maxTokens at 1000 (maxTokens); this run asks for 1001"]),
    ({"retry": {"maxAttempts": 6}}, ["WorkerClass c bounds spec.retry.maxAttempts at 5 (maxAttempts); this run asks for 6"]),
    ({"executor": "External", "template": None}, ["WorkerClass c allows executors Pod; this run's is External"]),
    ({"template": {"spec": {"containers": [{"name": "w", "image": "docker.io/evil:1"}]}}},
     ["WorkerClass c allows images under registry.example.com/tools/; container w runs docker.io/evil:1"]),
    ({"template": {"spec": {"initContainers": [{"name": "i", "image": "evil"}], "containers": CONTAINERS}}},
     ["WorkerClass c allows images under registry.example.com/tools/; container i runs evil"]),
    ({"template": {"spec": {"serviceAccountName": "deployer", "containers": CONTAINERS}}},
     ["WorkerClass c allows ServiceAccounts tools; this run names deployer"]),
    ({"template": {"spec": {"serviceAccountName": "tools", "containers": CONTAINERS}}}, []),
])
def test_bounds(spec: dict[str, Any], broken: list[str]) -> None:
    c = klass("c", defaults=BOUNDED, bounds=BOUNDS)
    r, _ = resolve(body({"className": "c", **spec}), {"c": c})
    assert list(r.violations) == broken


def test_violations_judge_the_values_taken_from_the_class_too() -> None:
    # A class edited so that its own default breaks its bound (its CRD refuses that; an older one did not).
    c = klass("c", defaults={"deadlineSeconds": 9000}, bounds={"maxDeadlineSeconds": 3600})
    r, _ = resolve(body({"className": "c"}), {"c": c})
    assert r.violations == ("WorkerClass c bounds spec.deadlineSeconds at 3600s (maxDeadlineSeconds); "
                            "this run asks for 9000s",)
    assert violations(WorkerRun.model_validate(body()), c.model) == ()


@pytest.mark.parametrize("status,pinned", [
    ({}, False),
    ({"attempt": 0, "class": {"name": "a", "applied": {}}}, False),
    ({"attempt": 1}, True),
    ({"executionDigest": "sha256:x"}, True),
    ({"review": {"requests": [{"gate": "Start", "requestedAt": "2026-12-07T00:00:00Z", "executionDigest": "sha256:x"}]}},
     True),
    ({"review": {"requests": [{"gate": "Start", "requestedAt": "2026-12-07T00:00:00Z"}]}}, False),
])
def test_pinned_from_the_first_grant_or_the_start_approval_request(status: dict[str, Any], pinned: bool) -> None:
    assert wc.pinned(body(status=status)) is pinned


def test_a_pinned_run_reads_what_it_recorded_not_the_class() -> None:
    b = body(status={"attempt": 1, "class": {"name": "tool-call", "defaults": {"stopGraceSeconds": 7}}})
    assert WorkerRun.model_validate(wc.effective_body(b)).spec.stop_grace_seconds == 7
    assert WorkerRun.model_validate(wc.effective_body(body(status={"attempt": 1}))).spec.stop_grace_seconds == 30


def test_a_field_removed_after_the_pin_falls_back_to_the_class_default_not_to_none() -> None:
    """A run that set its own cap (within the class's bound) and removes it once started is capped by
    the class's default as pinned, never by nothing."""
    recorded = {"attempt": 1, "class": {"name": "c", "defaults": {"budget": {"capCents": 25}, "deadlineSeconds": 900}}}
    own = WorkerRun.model_validate(wc.effective_body(body({"budget": {"capCents": 80}, "deadlineSeconds": 60}, recorded)))
    assert (own.spec.budget.cap_cents, own.spec.deadline_seconds) == (80, 60)  # type: ignore[union-attr]
    removed = WorkerRun.model_validate(wc.effective_body(body({}, recorded)))
    assert (removed.spec.budget.cap_cents, removed.spec.deadline_seconds) == (25, 900)  # type: ignore[union-attr]


# --- the gate in decide ---------------------------------------------------------------------


def observed(b: dict[str, Any], classes: dict[str, KnownClass]) -> Observed:
    r, _ = resolve(b, classes)
    return Observed(run=WorkerRun.model_validate(wc.with_defaults(b, r.defaults)), lease=None, pods=(),
                    now=T0, mono=100.0, run_class=r)


def test_a_run_of_a_missing_class_waits_pending_and_says_why() -> None:
    d = decide(observed(body({"className": "nope"}), {}))
    [write] = d.actions
    assert isinstance(write, WriteStatus)
    s = write.status
    assert s.phase == Phase.PENDING and s.attempt == 0
    stalled = next(c for c in s.conditions if c.type == "Stalled")
    assert (stalled.status, stalled.reason) == ("True", "ClassNotFound")
    assert "WorkerClass nope does not exist" in (stalled.message or "")
    assert s.class_ is None  # a made-up name is recorded nowhere (nor becomes a metrics label)
    assert [e.reason for e in write.events] == ["ClassNotFound"]


def test_said_once_then_nothing_until_something_changes() -> None:
    first = decide(observed(body({"className": "nope"}), {})).actions[0]
    assert isinstance(first, WriteStatus)
    b = body({"className": "nope"}, status=first.status.dump())
    assert decide(observed(b, {})).actions == []


def test_a_run_that_breaks_a_bound_waits_pending_with_the_bound_named() -> None:
    c = klass("c", defaults=BOUNDED, bounds=BOUNDS)
    d = decide(observed(body({"className": "c", "deadlineSeconds": 7200}), {"c": c}))
    [write] = d.actions
    assert isinstance(write, WriteStatus)
    stalled = next(x for x in write.status.conditions if x.type == "Stalled")
    assert stalled.reason == "ClassBoundsExceeded"
    assert "maxDeadlineSeconds" in (stalled.message or "") and write.status.attempt == 0


def test_the_grant_pins_what_the_run_took_and_uses_it() -> None:
    c = klass("c", defaults={"lease": {"durationSeconds": 20, "renewIntervalSeconds": 5, "startupGraceSeconds": 7}})
    d = decide(observed(body({"className": "c"}), {"c": c}))
    writes = [a for a in d.actions if isinstance(a, WriteStatus)]
    assert writes and writes[-1].status.attempt == 1
    assert writes[-1].status.class_ is not None and writes[-1].status.class_.name == "c"
    assert writes[-1].status.class_.defaults["lease"]["durationSeconds"] == 20
    [ensure] = [a for a in d.actions if isinstance(a, EnsureLease)]
    assert ensure.duration_seconds == 20
    assert any(isinstance(a, EnsurePod) for a in d.actions)
    # From then on the class is not looked at: a pinned body reads its own record.
    pinned = body({"className": "c"}, status=writes[-1].status.dump())
    assert wc.pinned(pinned)
    assert WorkerRun.model_validate(wc.effective_body(pinned)).spec.lease.duration_seconds == 20


def test_a_run_of_no_class_records_none() -> None:
    d = decide(observed(body(), {}))
    writes = [a for a in d.actions if isinstance(a, WriteStatus)]
    assert writes and writes[-1].status.attempt == 1 and writes[-1].status.class_ is None
    assert "class" not in writes[-1].status.dump()


def test_a_run_whose_class_holds_it_keeps_no_kueue_quota() -> None:
    from tether.kueue.decide import held_back

    o = observed(body({"className": "nope"}), {})
    assert held_back(o) == "its WorkerClass nope does not exist"
    c = klass("c", defaults=BOUNDED, bounds=BOUNDS)
    assert "maxDeadlineSeconds" in (held_back(observed(body({"className": "c", "deadlineSeconds": 7200}), {"c": c})) or "")
    assert held_back(observed(body({"className": "c"}), {"c": c})) is None


def test_classes_unknown_hold_a_run_that_is_not_pinned_and_record_nothing() -> None:
    r = ClassResolution(None, unknown="403 forbidden")
    o = Observed(run=WorkerRun.model_validate(body()), lease=None, pods=(), now=T0, mono=100.0, run_class=r)
    d = decide(o)
    [write] = d.actions
    assert isinstance(write, WriteStatus) and write.status.attempt == 0 and write.status.class_ is None
    stalled = next(x for x in write.status.conditions if x.type == "Stalled")
    assert stalled.reason == "ClassesUnknown" and "403 forbidden" in (stalled.message or "")
    assert d.requeue_after is not None and d.requeue_after <= 10


def test_a_run_naming_a_missing_class_records_no_class() -> None:
    [write] = decide(observed(body({"className": "made-up"}), {})).actions
    assert isinstance(write, WriteStatus) and write.status.class_ is None
