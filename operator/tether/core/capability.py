"""A capability's say in the pure decision (Kueue's queueing is one: tether/kueue).

The core decides every run the same way; a capability adds, from its own package, what it alone
knows: its slice of the observation (`Observed.part`), its gates in the ordered tuple before a
grant (`decide.gates`), a stop it causes for a held attempt, what it must hear of every pass,
and what a deleted run must wait for. It asks for its own actions (executed and confirmed by its
package) and confirmations (`StatusBuilder.rest_on`). Every method's default says nothing.
"""

from __future__ import annotations

from tether.core.actions import Decision
from tether.core.enforcement import Stop
from tether.core.lifecycle import StatusBuilder
from tether.core.observe import Observed


class Rules:
    name = "capability"

    def enter(self, o: Observed, b: StatusBuilder, d: Decision) -> bool:
        """The first gate of a run nobody holds (before a person, money or a changed spec may hold
        it back): False stops the pass here (the gate said why in `b` and `d`)."""
        return True

    def admit(self, o: Observed, b: StatusBuilder, d: Decision) -> bool:
        """The last gate before a grant."""
        return True

    def stop(self, o: Observed) -> Stop | None:
        """A stop this capability causes for the held attempt (after spec.stop and the caps)."""
        return None

    def after(self, o: Observed, d: Decision) -> None:
        """On every pass of a run that is not being deleted, after the core decided."""

    def deleting(self, o: Observed, d: Decision) -> bool:
        """A deleted run whose attempt, pods and books are settled: True while its finalizer must
        stay (this asked for what must happen first, or waits)."""
        return False
