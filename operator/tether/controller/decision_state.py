"""What the run controller remembers of its own decisions, apart from the objects it holds (the
stores): the usage at which a held run must be decided at once, and when it last saw a run's
progress held. The cache forgets them with the run they belong to; nothing here is the cluster's."""

from __future__ import annotations

from dataclasses import dataclass, field

from tether.controller.views import RunKey
from tether.core.actions import UsageAlarm


@dataclass
class DecisionState:
    # By run key: the current attempt's usage at which a cap or the budget is reached.
    alarms: dict[RunKey, UsageAlarm] = field(default_factory=dict)
    # By run UID (a namesake starts afresh): monotonic time its progress was last seen held
    # (suspended, or asking); the progress deadline counts from then at the earliest.
    progress_held_at: dict[str, float] = field(default_factory=dict)

    def forget_key(self, key: RunKey) -> None:
        self.alarms.pop(key, None)

    def forget_uid(self, uid: str) -> None:
        self.progress_held_at.pop(uid, None)
