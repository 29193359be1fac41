"""Child runs as a capability (controller.capability): an index of runs by their parent, the parent
read for each child's pass (fresh before the child is admitted and when it is settled, from the
cache otherwise), a parent's change waking its children, and the two writes on the parent's ledger.
Registered by one line in tether/capabilities.py."""

from __future__ import annotations

from typing import Any

from tether.api.models import WorkerRun
from tether.api.workerclass import effective_body
from tether.children.actions import AdmitChild, SettleChild, SuspendChild
from tether.children.api import ANN_SUSPENDED_BY_PARENT, LABEL_PARENT
from tether.children.decide import RULES, ParentRead
from tether.children import ledger
from tether.controller.capability import Attached, Context, Step
from tether.controller.errors import Again
from tether.controller.manager import Wake, Watch
from tether.controller.snapshot import Snapshot
from tether.controller.views import RunKey
from tether.kube.client import Conflict, Invalid, NotFound
from tether.kube.paths import run_path

BY_PARENT = "parent"
REASON_CHILD_ENDED = "ChildEnded"


def parent_key(body: dict[str, Any]) -> RunKey | None:
    """The parent a run's label names (children/api.py): the index's value."""
    meta = body.get("metadata") or {}
    parent = (meta.get("labels") or {}).get(LABEL_PARENT)
    return (str(meta.get("namespace", "")), str(parent)) if parent else None


class Children:
    name = "children"
    rules = RULES
    sources = ()

    def attach(self, ctx: Context) -> Attached:
        ctx.cache.runs.add_index(BY_PARENT, parent_key)

        def bounds_of(parent: WorkerRun) -> Any:
            taken = parent.status.class_.name if parent.status.class_ is not None else None
            known = ctx.cache.classes.classes.get(taken) if taken else None
            return known.model.spec.bounds if known is not None else None

        async def observe(run: WorkerRun) -> ParentRead | None:
            ref = run.spec.parent_ref
            if ref is None:
                return None
            ns = run.metadata.namespace
            cached = ctx.cache.runs.get((ns, ref.name))
            phase = run.status.phase
            ending = (phase is not None and phase.terminal) or run.metadata.deletion_timestamp is not None
            cached_parent = _parsed(cached, ref.uid)
            # Fresh before it is admitted, and when it is to be settled (it ended or is deleted, and
            # the cache says it is live in the ledger; the fresh read says whether it still is). A
            # live child the cache shows admitted is (only its own settlement removes the entry), so
            # one waiting long for its first attempt (a queue, a review) costs no read per pass.
            listed = cached_parent is not None and ledger.live_entry(cached_parent, run.metadata.uid) is not None
            fresh = (run.status.attempt == 0 and not ending and not listed) or (ending and listed)
            if not fresh:
                return ParentRead(parent=cached_parent, body=None, fresh=False)
            body = await ctx.kube.get_object(run_path(ns, ref.name))
            if body is not None:
                ctx.manager.feed("run-read", None, body)
            parent = _parsed(body, ref.uid)
            lease = ctx.cache.leases.get(ref.uid)
            reported = lease.usage if lease is not None and parent is not None and \
                (lease.holder, lease.fence) == (parent.status.holder, parent.status.fence) else None
            return ParentRead(parent=parent, body=body, fresh=True,
                              bounds=bounds_of(parent) if parent is not None else None, reported=reported)

        async def write_ledger(snap: Snapshot, action: AdmitChild | SettleChild) -> Snapshot:
            """The parent's status.children, if the parent is still as read for this decision (a
            JSON patch whose `test`s hold only then)."""
            ctx.leadership.check()
            patch: list[dict[str, Any]] = [
                {"op": "test", "path": "/metadata/uid", "value": action.parent_uid},
                {"op": "test", "path": "/metadata/resourceVersion", "value": action.resource_version},
                {"op": "add", "path": "/status/children", "value": action.children.dump()}]
            try:
                written = await ctx.kube.patch_run_status(snap.run.metadata.namespace, action.parent, patch)
            except (Invalid, NotFound):
                raise Again(f"parent {action.parent} changed since it was read") from None
            ctx.manager.feed("run-read", None, written)
            if isinstance(action, SettleChild):
                await ctx.kube.post_event(written, "Normal", REASON_CHILD_ENDED, action.ended)
            return snap

        async def suspend_child(snap: Snapshot, action: SuspendChild) -> Snapshot:
            """The child's spec.suspend as its parent's, if the child is still as decided on."""
            ctx.leadership.check()
            meta = snap.run.metadata
            try:
                written = await ctx.kube.merge_patch(run_path(meta.namespace, meta.name), {
                    "metadata": {"resourceVersion": action.resource_version,
                                 "annotations": {ANN_SUSPENDED_BY_PARENT: "true" if action.suspend else None}},
                    "spec": {"suspend": action.suspend}}, f"suspend child {meta.namespace}/{meta.name}")
            except (Conflict, NotFound):
                raise Again(f"child {meta.name} changed since it was read") from None
            ctx.manager.feed("run-read", None, written)
            return snap

        steps: dict[type, Step] = {AdmitChild: write_ledger, SettleChild: write_ledger, SuspendChild: suspend_child}
        return Attached(
            # The parent changed (a new holder, its ledger, its end): its children decide again.
            run_watches=[Watch("run", lambda change: [Wake(k) for k in ctx.cache.runs.by(BY_PARENT, change.key)])],
            observe=observe,
            steps=steps,
        )


def _parsed(body: dict[str, Any] | None, uid: str) -> WorkerRun | None:
    """The parent the child names: that name with that UID (a namesake is not it), with what it
    took from its class applied (a cap or budgetRef of the class's defaults is the tree's too)."""
    if body is None or (body.get("metadata") or {}).get("uid") != uid:
        return None
    return WorkerRun.model_validate(effective_body(body))


CAPABILITY = Children()
