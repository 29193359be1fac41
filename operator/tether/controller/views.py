"""Typed read-only views over the bodies the cache holds (lean dicts, as the watch delivered
them). The reconciler reads runs through the pydantic models; the cache's own bookkeeping and the
metrics read these, so no module spells `(body.get("status") or {}).get(...)` chains."""

from __future__ import annotations

from typing import Any

from tether import protocol
from tether.api import constants as c
from tether.api.models import LeaseSpec

RunKey = tuple[str, str]  # (namespace, name)
BudgetKey = tuple[str, str]  # (namespace, name)


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


class ObjectView:
    """Metadata every object has."""

    __slots__ = ("body",)

    def __init__(self, body: dict[str, Any]) -> None:
        self.body = body

    @property
    def meta(self) -> dict[str, Any]:
        return _dict(self.body.get("metadata"))

    @property
    def name(self) -> str:
        return str(self.meta.get("name", ""))

    @property
    def namespace(self) -> str:
        return str(self.meta.get("namespace", ""))

    @property
    def uid(self) -> str:
        return str(self.meta.get("uid", ""))

    @property
    def resource_version(self) -> str:
        return str(self.meta.get("resourceVersion", ""))

    @property
    def generation(self) -> int | None:
        return self.meta.get("generation")

    @property
    def deleting(self) -> bool:
        return bool(self.meta.get("deletionTimestamp"))

    @property
    def finalizers(self) -> list[str]:
        return list(self.meta.get("finalizers") or [])

    @property
    def labels(self) -> dict[str, str]:
        return _dict(self.meta.get("labels"))

    @property
    def controller_uid(self) -> str | None:
        return protocol.controller_uid(self.body)


class RunView(ObjectView):
    __slots__ = ()

    @property
    def key(self) -> RunKey:
        return self.namespace, self.name

    @property
    def spec(self) -> dict[str, Any]:
        return _dict(self.body.get("spec"))

    @property
    def status(self) -> dict[str, Any]:
        return _dict(self.body.get("status"))

    @property
    def fence(self) -> int:
        return int(self.status.get("fence") or 0)

    @property
    def holder(self) -> str | None:
        return self.status.get("holder") or None

    @property
    def phase(self) -> str | None:
        return self.status.get("phase") or None

    @property
    def class_name(self) -> str:
        """The class it took ("" for none yet): api/workerclass.class_name."""
        return str(_dict(self.status.get("class")).get("name") or "")

    @property
    def class_defaults(self) -> dict[str, Any]:
        """Its WorkerClass's defaults as last recorded (status.class.defaults): what it leaves out."""
        return _dict(_dict(self.status.get("class")).get("defaults"))

    @property
    def budget(self) -> BudgetKey:
        """The WorkerBudget it draws on ("" for none), its own or its class's; a budgetRef never changes."""
        ref = _dict(_dict(self.spec.get("budget")).get("budgetRef")) or \
            _dict(_dict(self.class_defaults.get("budget")).get("budgetRef"))
        return self.namespace, str(ref.get("name") or "")

    @property
    def lease_seconds(self) -> float:
        lease = _dict(self.spec.get("lease")) or _dict(self.class_defaults.get("lease"))
        return float(lease.get("durationSeconds") or LeaseSpec().duration_seconds)

    @property
    def suspended(self) -> bool:
        return bool(self.spec.get("suspend"))

    @property
    def pending_gates(self) -> list[str]:
        """The gates of status.review.requests still waiting for a decision."""
        requests = _dict(self.status.get("review")).get("requests") or []
        return [str(r.get("gate")) for r in requests if isinstance(r, dict) and "decision" not in r]

    @property
    def pending_gates_since(self) -> list[tuple[str, str | None]]:
        """The gates still waiting, each with its request's requestedAt (as written)."""
        requests = _dict(self.status.get("review")).get("requests") or []
        return [(str(r.get("gate")), r.get("requestedAt") if isinstance(r.get("requestedAt"), str) else None)
                for r in requests if isinstance(r, dict) and "decision" not in r]


class LeaseView(ObjectView):
    __slots__ = ()

    @property
    def run_key(self) -> RunKey | None:
        """The run it is labelled for, when a WorkerRun controls it (else not Tether's)."""
        name = self.labels.get(c.LABEL_RUN)
        return (self.namespace, name) if name and self.controller_uid is not None else None

    @property
    def renew_time(self) -> str | None:
        return _dict(self.body.get("spec")).get("renewTime")


class PodView(ObjectView):
    __slots__ = ()

    @property
    def run_key(self) -> RunKey | None:
        name = self.labels.get(c.LABEL_RUN)
        return (self.namespace, name) if name else None

    @property
    def held_by_tether(self) -> bool:
        """Tether's finalizer keeps it until its attempt's end is recorded."""
        return c.POD_FINALIZER in self.finalizers


class BudgetView(ObjectView):
    __slots__ = ()

    @property
    def status(self) -> dict[str, Any]:
        return _dict(self.body.get("status"))

    def holds_mark_of(self, run_uid: str) -> bool:
        """Its ledger still holds a mark of that run."""
        return run_uid in _dict(self.status.get("charges"))

    @property
    def gate(self) -> tuple[Any, ...]:
        """What of it decides whether runs may spend: its spec, period and exhaustion."""
        conditions = self.status.get("conditions") or []
        exhausted = next((x.get("status") for x in conditions if isinstance(x, dict) and x.get("type") == "Exhausted"),
                         None)
        return self.generation, self.status.get("periodStart"), exhausted


class ApprovalView(ObjectView):
    __slots__ = ()

    @property
    def run_key(self) -> RunKey | None:
        name = _dict(_dict(self.body.get("spec")).get("runRef")).get("name")
        return (self.namespace, str(name)) if name else None
