"""decide() is total: no exception for any WorkerRun the CRD admits (issue 9).

Specs are generated from the CRD's own OpenAPI schema, so a field or bound added to the CRD is
exercised here without touching this file. Statuses are the ones the operator could have
written: each example drives a simulated run through decide() with random worker, pod, clock,
budget and spec events, applying the decided actions the way the executor does. Every step
checks that decide() returns, that its requeue is in range, and that every status it writes
passes the CRD's status schema (a write the API server refuses would loop forever).

Cross-field CEL rules (lease duration versus renew interval, one matcher per retry rule) are
deliberately not applied: the generated domain is a superset of what the API server admits.
"""

from __future__ import annotations

import datetime as dt
import math
from dataclasses import dataclass, field, replace
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tether.api.models import ErrorInfo, Remaining, Usage, WorkerRun
from tether.core import decide as core
from tether.core.budget import MAX_CENTS, MAX_TOKENS
from tether.core.decide import (
    Action,
    BudgetObservation,
    ClearLease,
    Decision,
    DeletePod,
    LeaseObservation,
    Observed,
    PodObservation,
    Revoke,
    WriteStatus,
    backoff_seconds,
    decide,
)
from tests.support.crd_schema import from_schema, openapi_schema, schema_violations

SCHEMA = openapi_schema("workerruns.tether.dev.yaml")
SPEC_SCHEMA = SCHEMA["properties"]["spec"]
STATUS_SCHEMA = SCHEMA["properties"]["status"]
INT32_MAX = 2**31 - 1

TEMPLATE = {"spec": {"containers": [{"name": "w", "command": ["w"]}]}}
JSON_SCALARS = st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.text(max_size=20)
PAYLOADS = st.dictionaries(st.text(max_size=8), st.recursive(JSON_SCALARS, lambda inner: st.lists(inner, max_size=3)
                                                             | st.dictionaries(st.text(max_size=5), inner, max_size=3),
                                                             max_leaves=8), max_size=4)
# Fields whose schema is x-kubernetes-preserve-unknown-fields: what a user would put there.
OVERRIDES: dict[str, st.SearchStrategy[Any]] = {".template": st.just(TEMPLATE), ".payload": PAYLOADS}


SPECS = from_schema(SPEC_SCHEMA, overrides=OVERRIDES)
# Spec fields that stay mutable once a run started (the CRD's transition rule freezes the rest).
MUTABLE = ["suspend", "stop", "budget", "deadlineSeconds", "progressDeadlineSeconds", "stopGraceSeconds",
           "ttlSecondsAfterFinished"]


# --- a simulated run: the executor's side of each action, the worker's and kubelet's events ---


def steps(actions: list[Action]) -> list[Any]:
    """The actions as the executor performs them: a Revoke is its steps, in its order (its
    tool-claim Secrets leave no trace in this world)."""
    out: list[Any] = []
    for action in actions:
        if isinstance(action, Revoke):
            out += [action.status_write, ClearLease(action.fence), *map(DeletePod, action.pods_to_delete)]
        else:
            out.append(action)
    return out


@dataclass
class World:
    run: WorkerRun
    now: dt.datetime
    mono: float = 1000.0
    lease: LeaseObservation | None = None
    pods: dict[str, PodObservation] = field(default_factory=dict)
    budget: BudgetObservation | None = None
    version: int = 0
    deleted: bool = False

    def rv(self) -> str:
        self.version += 1
        return str(self.version)

    def observed(self) -> Observed:
        return Observed(run=self.run, lease=self.lease, pods=tuple(self.pods.values()), now=self.now,
                        mono=self.mono, budget=self.budget)

    def apply(self, d: Decision) -> None:
        """What the executor does with each action, in order (every write succeeds here)."""
        for action in steps(d.actions):
            kind = type(action).__name__
            if isinstance(action, WriteStatus):
                self.run = self.run.model_copy(update={"status": action.status.model_copy(deep=True)})
            elif kind == "EnsureLease":
                self.lease = LeaseObservation(
                    holder=action.holder, fence=action.fence, resource_version=self.rv(), last_change=self.mono,
                    renewed=False, checkpoint=self.lease.checkpoint if self.lease else None,
                    checkpoint_changed=self.mono, signals=action.signals)
            elif kind == "ClearLease" and self.lease is not None:
                # The cleared Lease keeps the last usage report; the operator settles it from there.
                self.lease = replace(self.lease, holder=None, fence=action.fence, resource_version=self.rv(),
                                     last_change=self.mono, renewed=False, signals=None)
            elif kind == "EnsurePod":
                self.pods.setdefault(action.name, PodObservation(name=action.name, attempt=action.attempt,
                                                                 phase="Running"))
            elif kind == "DeletePod" and action.name in self.pods:
                self.pods[action.name] = replace(self.pods[action.name], deleting=True)
            elif kind == "ReleasePod" and action.name in self.pods:
                pod = replace(self.pods[action.name], has_finalizer=False)
                if pod.deleting:
                    del self.pods[action.name]
                else:
                    self.pods[action.name] = pod
            elif kind == "EnsureSignals" and self.lease is not None and self.lease.fence == action.fence:
                self.lease = replace(self.lease, signals=action.signals, resource_version=self.rv())
            elif kind == "ChargeBudget" and self.budget is not None:
                self.budget = replace(self.budget, charged=action.total)
            elif kind == "DeleteRun":
                self.deleted = True


EVENTS = ["tick", "tick", "renew", "renew", "pod_exit", "pod_deleted", "kubelet", "result", "error", "spec",
          "budget", "requeue"]


def step(world: World, data: st.DataObject, last: Decision | None) -> None:
    """One thing happening in the world between two decisions."""
    event = data.draw(st.sampled_from(EVENTS), label="event")
    s = world.run.status
    if event == "tick" or (event == "requeue" and (last is None or last.requeue_after is None)):
        seconds = data.draw(st.sampled_from([1.0, 30.0, 3600.0, 86400.0, 604800.0, 31536000.0])
                            | st.floats(0, 4e7, allow_nan=False), label="seconds")
        world.now, world.mono = core.after(world.now, seconds), world.mono + seconds
    elif event == "requeue":
        assert last is not None and last.requeue_after is not None
        world.now, world.mono = core.after(world.now, last.requeue_after), world.mono + last.requeue_after
    elif event == "renew" and world.lease is not None and world.lease.holder is not None:
        lease = world.lease
        before = lease.usage or Usage()
        usage = Usage(cents=data.draw(st.integers(before.cents, MAX_CENTS), label="cents"),
                      tokens=data.draw(st.integers(before.tokens, MAX_TOKENS), label="tokens"))
        # Lease annotations admit up to 256 KiB, far beyond status.checkpoint.cursor's maxLength.
        checkpoint = data.draw(st.none() | st.text(max_size=20) | st.text(min_size=1020, max_size=1100),
                               label="checkpoint")
        moved = checkpoint is not None and checkpoint != lease.checkpoint
        world.lease = replace(lease, resource_version=world.rv(), last_change=world.mono, renewed=True,
                              usage=usage, checkpoint=checkpoint if moved else lease.checkpoint,
                              checkpoint_changed=world.mono if moved else lease.checkpoint_changed)
    elif event == "pod_exit" and world.pods:
        name = data.draw(st.sampled_from(sorted(world.pods)), label="pod")
        code = data.draw(st.sampled_from([0, 1, 137, -(2**31), INT32_MAX]), label="exit code")
        world.pods[name] = replace(world.pods[name], phase="Succeeded" if code == 0 else "Failed", exit_code=code)
    elif event == "pod_deleted" and world.pods:
        name = data.draw(st.sampled_from(sorted(world.pods)), label="pod")
        world.pods[name] = replace(world.pods[name], deleting=True)
    elif event == "kubelet":
        # Deleted pods' processes end; the finalizer keeps them visible until Tether releases them.
        for name, pod in world.pods.items():
            if pod.deleting and not pod.terminated:
                world.pods[name] = replace(pod, phase="Failed", exit_code=137)
    elif event in ("result", "error") and s.holder is not None:
        # The holder's fenced patch: it only lands while the fence and holder are its own.
        status = s.model_copy(deep=True)
        if event == "result":
            status.result = data.draw(PAYLOADS, label="result")
        else:
            status.error = ErrorInfo(code="E", message=data.draw(st.text(max_size=50), label="message"))
        world.run = world.run.model_copy(update={"status": status})
    elif event == "spec":
        name = data.draw(st.sampled_from(MUTABLE), label="field")
        value = data.draw(st.none() | from_schema(SPEC_SCHEMA["properties"][name], f".{name}", OVERRIDES),
                          label="value")
        body = world.run.spec.dump()
        body.pop(name, None) if value is None else body.__setitem__(name, value)
        meta = world.run.metadata.model_copy(update={"generation": world.run.metadata.generation + 1})
        world.run = world.run.model_copy(update={"spec": type(world.run.spec).model_validate(body), "metadata": meta})
    elif event == "budget" and world.run.spec.budget is not None and world.run.spec.budget.budget_ref is not None:
        big = 2**63 - 1
        world.budget = BudgetObservation(
            name=world.run.spec.budget.budget_ref.name, missing=data.draw(st.booleans(), label="missing"),
            exhausted=data.draw(st.booleans(), label="exhausted"),
            # None: the budget sets no such limit.
            remaining=Remaining(cents=data.draw(st.none() | st.integers(0, big), label="left cents"),
                                tokens=data.draw(st.none() | st.integers(0, big), label="left tokens")),
            charged=world.budget.charged if world.budget else Usage(),
            next_reset_seconds=data.draw(st.none() | st.floats(0, 3.2e7, allow_nan=False), label="reset"))


def check(world: World, d: Decision) -> None:
    assert d.requeue_after is None or 0 <= d.requeue_after <= core.MAX_REQUEUE_SECONDS, d.requeue_after
    for action in steps(d.actions):
        if isinstance(action, WriteStatus):
            before = world.run.status
            problems = schema_violations(action.status.dump(), STATUS_SCHEMA, ".status")
            assert not problems, f"the API server would refuse this status write: {problems}"
            assert action.status.fence >= before.fence  # the CRD's transition rule on status.fence
        if type(action).__name__ in ("EnsureLease", "ClearLease", "EnsureSignals"):
            assert 0 <= action.fence <= INT32_MAX  # Lease.spec.leaseTransitions is an int32
    spec = world.run.spec
    for ended in range(0, world.run.status.attempt + 2):
        delay = backoff_seconds(world.run, ended)
        assert math.isfinite(delay) and 0 <= delay <= spec.retry.backoff.max_seconds


NAMES = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-", min_size=1, max_size=58)
# Any time the operator's clock could show, from the epoch to far beyond any deployment.
NOW = st.datetimes(min_value=dt.datetime(1970, 1, 1), max_value=dt.datetime(2400, 1, 1),
                   timezones=st.just(dt.timezone.utc))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(spec=SPECS, name=NAMES, now=NOW, data=st.data())
def test_decide_is_total_over_the_admitted_domain(spec: dict[str, Any], name: str, now: dt.datetime,
                                                  data: st.DataObject) -> None:
    run = WorkerRun.model_validate({"metadata": {"name": name, "namespace": "ns", "uid": "u"}, "spec": spec})
    world = World(run=run, now=now)
    last: Decision | None = None
    for _ in range(data.draw(st.integers(1, 40), label="steps")):
        d = decide(world.observed())
        check(world, d)
        world.apply(d)
        event(f"reached {world.run.status.phase.value if world.run.status.phase else 'no phase'}")
        if world.run.status.checkpoint is not None:
            event("a checkpoint was folded into the status")
        if world.deleted:
            return
        last = d
        step(world, data, last)


@pytest.mark.parametrize("field", ["deadlineSeconds", "ttlSecondsAfterFinished", "progressDeadlineSeconds"])
def test_the_generator_reaches_the_bounds(field: str) -> None:
    # The property above is only as good as its domain: the CRD's maximum must be in it.
    schema = SPEC_SCHEMA["properties"][field]
    seen: set[int] = set()

    @settings(max_examples=100, database=None)
    @given(from_schema(schema, f".{field}"))
    def sample(value: int) -> None:
        seen.add(value)

    sample()
    assert schema["maximum"] in seen and schema["minimum"] in seen
