"""The capabilities the operator runs with (controller.capability): each is one package, and
registered here by one line. Without a line, the operator runs as if its capability did not exist."""

from __future__ import annotations

from tether.children.capability import CAPABILITY as CHILDREN
from tether.controller.capability import Capability
from tether.kueue.capability import CAPABILITY as KUEUE
from tether.schedules.capability import CAPABILITY as SCHEDULES

CAPABILITIES: tuple[Capability, ...] = (
    KUEUE,  # queueing through Kueue: tether/kueue
    SCHEDULES,  # WorkerRunSchedule, a run at each slot of a schedule: tether/schedules
    CHILDREN,  # child runs, spawned by a parent's attempt under one budget for the tree: tether/children
)
