"""The fault trials' oracle past the run's bounded attempt history (the trials run the operator
with --attempt-history 2): every cent is judged over every attempt any accepted write showed, an
error or a denied result whose attempt record left the history is not "erased", and an ended run's
status.usage that forgot the dropped attempts is caught (issue 33's defect 3, judged from outside)."""

from __future__ import annotations

import json

import pytest

from testkit.oracle import ModelAnswer, judge
from tests.unit.oracle.test_oracle import Log, Run, facts, invariants

pytestmark = pytest.mark.unit


def _trimmed_grant(run: Run, keep: int) -> str:
    """A grant that keeps only the last `keep` attempt records, moving what the dropped ones spent
    into status.trimmedUsage, as the operator does."""
    pod = run.grant()
    s = json.loads(json.dumps(run.status))
    dropped, s["attempts"] = s["attempts"][:-keep], s["attempts"][-keep:]
    cents = sum(a["usage"]["cents"] for a in dropped) + int((s.get("trimmedUsage") or {}).get("cents", 0))
    s["trimmedUsage"] = {"cents": cents, "tokens": 0}
    run.write(**s)
    return pod


def three_attempts(log: Log, usage_counts_trimmed: bool) -> tuple[Run, list[dict[str, object]]]:
    """Attempts 1 and 2 lapse having spent 3 and 4 cents; attempt 3 succeeds with 2. The history
    keeps 1 record, so the final status lists attempt 3 only."""
    run, budgets = Run(log, budget="team"), []
    log.budget("team", 0, {})
    for n, cents in ((1, 3), (2, 4)):
        pod = _trimmed_grant(run, keep=1)
        run.renew(pod, usage=cents)
        run.end("LeaseLost", "Backoff", usage=cents, attempt_error={"code": "E", "message": f"attempt {n}"}
                if n == 1 else None)
    pod = _trimmed_grant(run, keep=1)
    run.renew(pod, usage=2)
    run.publish(pod)
    run.end("Succeeded", "Succeeded", usage=2)
    total = 9 if usage_counts_trimmed else 2
    run.write(usage={"cents": total, "tokens": 0}, budgetCharged=True)
    budgets.append(log.budget("team", total, {run.uid: ("r", total)}))
    return run, budgets


def test_a_history_that_dropped_attempts_passes_when_every_cent_is_counted() -> None:
    log = Log()
    run, budgets = three_attempts(log, usage_counts_trimmed=True)
    assert [a["attempt"] for a in run.status["attempts"]] == [3]
    verdict = judge(log.records, facts(run, budgets=budgets, faulted={(run.uid, "r-a1"), (run.uid, "r-a2")}))
    assert verdict.ok, verdict.violations


def test_an_ended_run_whose_usage_forgot_the_dropped_attempts_is_caught() -> None:
    log = Log()
    run, budgets = three_attempts(log, usage_counts_trimmed=False)
    verdict = judge(log.records, facts(run, budgets=budgets, faulted={(run.uid, "r-a1"), (run.uid, "r-a2")}))
    assert invariants(verdict) == [4]
    evidence = " / ".join(v.evidence for v in verdict.violations)
    assert "ended Succeeded with usage (2, 0), but its 3 attempts recorded (9, 0) in all" in evidence
    assert "run Succeeded with 9 cents / 0 tokens over its attempts, charged 2 / 0" in evidence


def test_an_error_is_erased_only_if_its_attempt_record_is_still_listed_without_it() -> None:
    """The error a worker published moves into its attempt's record; once that record leaves the
    history, its leaving is not an erasure, but an error dropped from a record still listed is."""
    log = Log()
    run = Run(log)
    pod = _trimmed_grant(run, keep=1)
    run.publish(pod, field="error", value={"code": "E", "message": "tool down"})
    run.end("Failed", "Backoff", attempt_error={"code": "E", "message": "tool down"}, error=None)
    second = _trimmed_grant(run, keep=1)  # attempt 1's record (with the error) leaves the history
    run.renew(second)
    run.end("Succeeded", "Succeeded")
    verdict = judge(log.records, facts(run, faulted={(run.uid, pod)}))
    assert verdict.ok, verdict.violations

    log = Log()
    run = Run(log)
    pod = _trimmed_grant(run, keep=2)
    run.publish(pod, field="error", value={"code": "E", "message": "tool down"})
    run.end("Failed", "Failed", error=None)  # neither in status.error nor in the attempt's record
    verdict = judge(log.records, facts(run, faulted={(run.uid, pod)}))
    assert invariants(verdict) == [2] and "erased" in verdict.violations[0].evidence


# --- 12. model answers: a cut one stops the spending, whole ones are all counted ----------------


def metered(outcome: str, recorded_tokens: int) -> tuple[Log, Run]:
    log = Log()
    run = Run(log)
    pod = run.grant()
    run.renew(pod)
    s = json.loads(json.dumps(run.status))
    s["attempts"][-1].update(outcome=outcome, usage={"cents": 3, "tokens": recorded_tokens})
    s.update(fence=s["fence"] + 1, holder=None, phase="Succeeded" if outcome == "Succeeded" else "Failed",
             usage={"cents": 3, "tokens": recorded_tokens})
    log.run_status(run, s)
    run.clear_lease()
    return log, run


def _answers(run: Run, *cut: bool) -> list[ModelAnswer]:
    return [ModelAnswer(run_uid=run.uid, holder="r-a1", tokens=20, cut=c) for c in cut]


@pytest.mark.parametrize("outcome, recorded, cuts, ok", [
    ("Succeeded", 40, (False, False), True),           # both whole answers counted
    ("Succeeded", 40, (False, False, True), True),     # the cut one last: the meter refused the rest
    ("Succeeded", 20, (False, False), True),           # its last report lost before the publication (inv. 4's)
    ("LeaseLost", 20, (False, False), True),           # ended from outside: its last report may be lost
    ("LeaseLost", 60, (False, False), False),          # more than the model billed it
    ("Succeeded", 55, (False, False, True), True),     # the cut answer charged its opening count
    ("Succeeded", 61, (False, False, True), False),    # more than all three billed
    ("Succeeded", 40, (False, True, False), False),    # spent on after a cut answer
])
def test_12_model_answers_are_judged_from_the_models_log(outcome: str, recorded: int, cuts: tuple[bool, ...],
                                                         ok: bool) -> None:
    log, run = metered(outcome, recorded)
    verdict = judge(log.records, facts(run, faulted={(run.uid, "r-a1")}, model_answers=_answers(run, *cuts)))
    assert verdict.stats["model answers"] == len(cuts)
    assert (12 not in invariants(verdict)) is ok, verdict.violations
