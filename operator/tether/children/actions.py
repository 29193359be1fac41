"""The writes a child's pass asks of its parent's ledger (status.children), executed by
children/capability.py, each a compare-and-swap on the parent as read fresh for the decision."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from tether.api.models import ChildrenStatus
from tether.core.actions import Confirm


@dataclass(frozen=True)
class AdmitChild:
    """Admit the child into its parent's tree: the parent's ledger as it is after (`children`),
    written only if the parent is still at `resource_version` (where it was seen held by the
    attempt that spawned the child)."""

    parent: str
    parent_uid: str
    resource_version: str
    children: ChildrenStatus

    pins_run: ClassVar[bool] = False
    requires: ClassVar[tuple[Confirm, ...]] = ()


@dataclass(frozen=True)
class SettleChild:
    """The ended child leaves its parent's live children: its reservation released, what its
    subtree spent counted, once (conditional on the parent at `resource_version`). `ended` is said
    on the parent as an Event (ChildEnded)."""

    parent: str
    parent_uid: str
    resource_version: str
    children: ChildrenStatus
    ended: str = ""

    pins_run: ClassVar[bool] = False
    requires: ClassVar[tuple[Confirm, ...]] = ()


@dataclass(frozen=True)
class SuspendChild:
    """The child's spec.suspend follows its parent's (marked by ANN_SUSPENDED_BY_PARENT, so that a
    resumed parent resumes only the children it suspended, never one a person suspended), written
    only if the child is still at `resource_version`."""

    suspend: bool
    resource_version: str

    pins_run: ClassVar[bool] = False
    requires: ClassVar[tuple[Confirm, ...]] = ()
