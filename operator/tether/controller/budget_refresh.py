"""The WorkerBudget refresh, a reconciler of its own: a budget whose period rolled over (or whose
status is otherwise behind) gets its status brought up to date even when no run charges it, with
the work queue's retries and backoff instead of a task fired and forgotten."""

from __future__ import annotations

import logging

from pydantic import ValidationError

from tether.controller.budgets import BudgetBook
from tether.controller.errors import Again
from tether.controller.loop import Result
from tether.controller.manager import Wake, Watch
from tether.controller.views import BudgetKey
from tether.controller.wakes import BudgetChange
from tether.kube.client import Conflict, NotFound

log = logging.getLogger("tether.budgets")

NAME = "workerbudget"
# Few budgets, and each refresh is one read and at most one write.
WORKERS = 2


class BudgetRefresher:
    def __init__(self, budgets: BudgetBook) -> None:
        self.budgets = budgets

    def exists(self, key: BudgetKey) -> bool:
        return key in self.budgets.cache

    async def reconcile(self, key: BudgetKey) -> Result:
        try:
            await self.budgets.refresh(key)
        except Conflict as exc:
            # A charge (or another replica) wrote first: not a failure, a race; read it again.
            raise Again(f"budget changed under its refresh: {exc}") from exc
        except NotFound:
            pass  # deleted since the read: nothing to refresh
        except ValidationError as exc:
            # The CRD's schema admits what the model does; should they ever disagree, the budget's
            # next change wakes it again (a retry would only repeat the refusal).
            log.warning("budget refresh skipped: the budget does not parse", extra={
                "budget": "/".join(key), "error": str(exc)[:500], "event": "budget_invalid"})
        return Result()


def watches() -> list[Watch[BudgetChange]]:
    """A budget's event wakes its refresh when its status is due one."""
    return [Watch("budget", lambda change: [Wake(change.key)] if change.refresh_due else [])]
