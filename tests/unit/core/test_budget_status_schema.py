"""Every WorkerBudget status the operator computes passes the CRD's status schema (issue 9).

A status the API server refuses (422) is retried forever and the budget's status never moves:
spent, remaining and the Exhausted condition go stale while runs keep charging. Specs come from
the CRD's OpenAPI schema, so a bound added there is exercised here.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from tether.api.models import MAX_STATUS_NUMBER, ObjectMeta, Usage, WorkerBudget, WorkerBudgetSpec
from tether.core import budget as b
from tests.support.crd_schema import from_schema, openapi_schema, schema_violations

SCHEMA = openapi_schema("workerbudgets.tether.dev.yaml")
# A valid IANA zone; the schema's free text would mostly fall back to UTC.
SPECS = from_schema(SCHEMA["properties"]["spec"], overrides={".timeZone": st.sampled_from(["UTC", "Europe/Berlin"])})
# A run's cumulative usage as its status holds it (decide's sums saturate at the CRD's maximum).
TOTALS = st.tuples(st.sampled_from(["u1", "u2", "u3"]), st.integers(0, MAX_STATUS_NUMBER),
                   st.integers(0, MAX_STATUS_NUMBER))


def _violations(budget: WorkerBudget) -> list[str]:
    return schema_violations(budget.status.dump(), SCHEMA["properties"]["status"], ".status")


@settings(max_examples=300, deadline=None)
@given(spec=SPECS, charges=st.lists(TOTALS, max_size=12),
       now=st.datetimes(dt.datetime(2000, 1, 1), dt.datetime(2300, 1, 1), timezones=st.just(dt.timezone.utc)))
def test_budget_statuses_pass_the_crd_schema(spec: dict[str, Any], charges: list[tuple[str, int, int]],
                                             now: dt.datetime) -> None:
    budget = WorkerBudget(metadata=ObjectMeta(name="team", namespace="ns"),
                          spec=WorkerBudgetSpec.model_validate(spec))
    budget = budget.model_copy(update={"status": b.refresh(budget, now)})
    assert not _violations(budget)
    for uid, cents, tokens in charges:
        mark = b.charged(budget, uid)
        total = Usage(cents=max(cents, mark.cents), tokens=max(tokens, mark.tokens))  # totals only grow
        budget = budget.model_copy(update={"status": b.apply_charge(budget, uid, uid, total, now)})
        assert not _violations(budget), budget.status.dump()


def test_a_budget_without_a_token_limit_passes_the_schema() -> None:
    # limitCents only: "no token limit" used to be written as remaining.tokens = 2**62, above the
    # CRD's maximum (2**53 - 1), so every status write of such a budget was refused.
    budget = WorkerBudget(metadata=ObjectMeta(name="team", namespace="ns"), spec=WorkerBudgetSpec(limit_cents=500))
    status = b.refresh(budget, dt.datetime(2026, 11, 29, tzinfo=dt.timezone.utc))
    assert not schema_violations(status.dump(), SCHEMA["properties"]["status"], ".status"), status.dump()
