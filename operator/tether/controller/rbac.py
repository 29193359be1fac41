"""The worker identity of a pod run, as the controller makes it (tether.kube.identity): an account
Tether did not make for the run is a spec error the run says (Stalled, WorkerIdentityTaken)."""

from __future__ import annotations

from tether.api.models import WorkerRun
from tether.controller.errors import SpecError
from tether.kube.identity import IdentityTaken, WorkerIdentity


class WorkerRbac(WorkerIdentity):
    async def ensure(self, run: WorkerRun) -> None:
        try:
            await super().ensure(run)
        except IdentityTaken as exc:
            raise SpecError("WorkerIdentityTaken", exc) from None
