"""Lease-based leader election for HA (kopf's peering is not a lease).

Like client-go's leaderelection: candidates compete for one coordination Lease
with resourceVersion-conditional writes; expiry is judged by when *this*
process observed the holder's last renewal, on its monotonic clock. A leader
that cannot renew within the renew deadline stops acting at once and exits.
Every time stamped around a request errs on the side of the replica that
stamps it: a leader's renew deadline counts from before its write was sent,
a standby's lease duration from after the read that showed the renewal, so
however long either request takes, the standby's wait (the lease duration)
ends after the leader's (the shorter renew deadline) and they never lead at once.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from tether.controller.errors import NotLeader
from tether.kube import resources
from tether.kube.client import Conflict, KubeClient

log = logging.getLogger("tether.leader")


@dataclass
class LeaderElector:
    kube: KubeClient
    namespace: str
    name: str
    identity: str
    lease_seconds: float = 15.0
    renew_deadline: float = 10.0
    retry_period: float = 2.0
    mono: Callable[[], float] = time.monotonic
    # The object whose deletion takes the Lease along (garbage collection): the chart's ServiceAccount,
    # so `helm uninstall` leaves no Lease naming a deleted pod. None outside a cluster.
    owner: dict | None = None
    _renewed_at: float = field(default=float("-inf"), init=False)
    _observed: tuple[str, float] | None = field(default=None, init=False)  # (resourceVersion, first seen)

    @property
    def is_leader(self) -> bool:
        """True only while the last successful renewal is within the renew deadline."""
        return self.mono() - self._renewed_at < self.renew_deadline

    def _body(self, current: dict | None, transitions: int) -> dict:
        now = resources.micro_time(dt.datetime.now(dt.timezone.utc))
        spec = {"holderIdentity": self.identity, "leaseDurationSeconds": int(self.lease_seconds),
                "renewTime": now, "leaseTransitions": transitions}
        owners = [self.owner] if self.owner else []
        if current is None:
            metadata: dict = {"name": self.name, "namespace": self.namespace}
            if owners:
                metadata["ownerReferences"] = owners
            return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": metadata,
                    "spec": {**spec, "acquireTime": now}}
        body = dict(current)
        if self.owner and self.owner not in (current["metadata"].get("ownerReferences") or []):
            # (a Lease from before owners, or from an earlier install whose account was recreated)
            others = [o for o in current["metadata"].get("ownerReferences") or [] if o.get("kind") != "ServiceAccount"]
            body["metadata"] = {**current["metadata"], "ownerReferences": others + owners}
        old = current.get("spec") or {}
        body["spec"] = {**old, **spec}
        if old.get("holderIdentity") != self.identity:
            body["spec"]["acquireTime"] = now
        return body

    async def try_acquire_or_renew(self) -> bool:
        current = await self.kube.get_lease(self.namespace, self.name)
        read_at = self.mono()  # after the answer: see _expired
        try:
            if current is None:
                if self._renewed_at > float("-inf"):
                    # Deleted while this replica led (its owner, the chart's ServiceAccount, was
                    # deleted): another may have made it anew. Stop leading rather than make a second.
                    self._renewed_at = float("-inf")
                    log.warning("leader Lease deleted while held", extra={"event": "leader_lease_deleted"})
                    return False
                return await self._lead_by(self.kube.create_lease(self._body(None, 0)))
            spec = current.get("spec") or {}
            holder = spec.get("holderIdentity")
            if holder and holder != self.identity and not self._expired(current, read_at):
                return False
            transitions = int(spec.get("leaseTransitions") or 0) + (0 if holder == self.identity else 1)
            return await self._lead_by(self.kube.replace_lease(self._body(current, transitions)))
        except Conflict:
            return False

    def _expired(self, lease: dict, read_at: float) -> bool:
        """Whether the holder's renewal has outlived its lease duration since this replica first saw
        it (a new resourceVersion). Seen at `read_at`, after the GET answered: the renewal may have
        landed at any moment while the GET was in flight, so a time from before it would make the
        renewal look older than it is and end the standby's wait early."""
        rv = lease["metadata"]["resourceVersion"]
        if self._observed is None or self._observed[0] != rv:
            self._observed = (rv, read_at)
        duration = float((lease.get("spec") or {}).get("leaseDurationSeconds") or self.lease_seconds)
        return read_at - self._observed[1] >= duration

    async def _lead_by(self, write: Awaitable[dict]) -> bool:
        """Sends a write of the Lease naming this replica; leadership counts from before it was sent:
        a standby may see it as soon as it lands, and its answer may come much later."""
        sent_at = self.mono()
        await write
        if not self.is_leader:
            log.info("became leader", extra={"event": "leader_elected", "identity": self.identity})
        self._renewed_at = sent_at
        return True

    async def acquire(self) -> None:
        log.info("waiting for leadership", extra={"event": "leader_waiting", "identity": self.identity,
                                                  "lease": f"{self.namespace}/{self.name}"})
        while not await self._attempt():
            await asyncio.sleep(self.retry_period)

    async def _attempt(self) -> bool:
        """One try, bounded like client-go's (its context carries the renew deadline): a leader's
        try ends when its leadership would, so a hung call never keeps it acting past that."""
        remaining = self.renew_deadline - (self.mono() - self._renewed_at)
        timeout = remaining if self.is_leader else self.renew_deadline
        try:
            return await asyncio.wait_for(self.try_acquire_or_renew(), timeout=max(timeout, 0.001))
        except asyncio.TimeoutError:
            log.warning("leader election request timed out", extra={"timeoutSeconds": round(timeout, 3)})
            return False
        except Exception as exc:  # noqa: BLE001 - the API may be briefly unavailable
            log.warning("leader election request failed", extra={"error": str(exc)})
            return False

    async def release(self) -> None:
        """Gives the Lease up once this replica has stopped acting (client-go's ReleaseOnCancel), so a
        standby takes over within its retry period instead of after the lease duration. A
        compare-and-swap on the Lease while it still names this replica: a successor's is never
        touched. Also for a replica stopped while acquiring (its write may have landed)."""
        self._renewed_at = float("-inf")
        try:
            # Bounded: it must fit in the pod's grace period even while the API server is slow.
            await asyncio.wait_for(self._give_up(), timeout=5.0)
        except Exception as exc:  # noqa: BLE001 - it lapses on its own anyway
            log.warning("could not release leadership", extra={"error": str(exc) or type(exc).__name__})

    async def _give_up(self) -> None:
        current = await self.kube.get_lease(self.namespace, self.name)
        if current is None or (current.get("spec") or {}).get("holderIdentity") != self.identity:
            return
        body = dict(current)
        body["spec"] = {**current["spec"], "holderIdentity": "", "leaseDurationSeconds": 1}
        await self.kube.replace_lease(body)
        log.info("released leadership", extra={"event": "leader_released", "identity": self.identity})

    async def hold(self) -> None:
        """Renews until leadership is lost, then returns (the caller exits)."""
        while True:
            await asyncio.sleep(self.retry_period)
            await self._attempt()
            if not self.is_leader:
                log.error("lost leadership", extra={"event": "leader_lost", "identity": self.identity})
                return


class Leadership:
    """Whether this replica may still write. Checked before every write of a pass and inside every
    retry loop, not once per reconcile: a deposed leader's passes already under way stop at
    their next step instead of writing on for as long as they take."""

    def __init__(self, may_act: Callable[[], bool] = lambda: True) -> None:
        self.may_act = may_act

    def check(self) -> None:
        if not self.may_act():
            raise NotLeader("this replica is not the leader")
