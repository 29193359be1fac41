"""tether.protocol: the one definition of the ownership protocol's vocabulary."""

from __future__ import annotations

import datetime as dt
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tether import protocol
from tether.api import constants as c
from tether.api.models import Signals, Usage


def _lease(holder: str | None, fence: int | None, **ann: str) -> dict:  # type: ignore[type-arg]
    return {"metadata": {"name": "job", "resourceVersion": "7", "annotations": dict(ann)},
            "spec": {"holderIdentity": holder, "leaseTransitions": fence, "leaseDurationSeconds": 9}}


def test_holds_only_for_the_exact_holder_and_fence() -> None:
    lease = _lease("job-a2", 3)
    assert protocol.holds(lease, "job-a2", 3)
    assert not protocol.holds(lease, "job-a2", 2) and not protocol.holds(lease, "job-a1", 3)
    assert not protocol.holds(None, "job-a2", 3)
    # A cleared Lease (revocation) is nobody's, not even a caller that says "no holder".
    assert not protocol.holds(_lease(None, 4), None, 4)
    assert protocol.same_owner("job-a2", 3, "job-a2", 3) and not protocol.same_owner(None, 4, None, 4)


def test_renewal_keeps_the_resource_version_and_carries_progress_on_the_same_write() -> None:
    lease = _lease("job-a1", 1, **{c.ANN_SIGNALS: "{}"})
    now = dt.datetime(2030, 1, 2, 3, 4, 5, 678901, tzinfo=dt.timezone.utc)
    body = protocol.renewal(lease, now, checkpoint="row-7", usage=Usage(cents=3, tokens=4))
    assert body["metadata"]["resourceVersion"] == "7"  # the compare-and-swap
    assert body["spec"]["renewTime"] == "2030-01-02T03:04:05.678901Z"
    ann = body["metadata"]["annotations"]
    assert ann[c.ANN_CHECKPOINT] == "row-7" and json.loads(ann[c.ANN_USAGE]) == {"cents": 3, "tokens": 4}
    assert ann[c.ANN_SIGNALS] == "{}"
    assert lease["metadata"]["annotations"] == {c.ANN_SIGNALS: "{}"} and "renewTime" not in lease["spec"]


def test_time_formats() -> None:
    t = dt.datetime(2030, 1, 2, 4, 4, 5, 6, tzinfo=dt.timezone(dt.timedelta(hours=1)))
    assert protocol.micro_time(t) == "2030-01-02T03:04:05.000006Z"
    assert protocol.rfc3339(t) == "2030-01-02T03:04:05Z"


@pytest.mark.parametrize("raw", ['{"cents":1.5}', '{"cents":true}', "[1,2]", "NaN", "{", '{"tokens":"3"}',
                                 "[" * 5000])
def test_malformed_usage_is_a_value_error(raw: str) -> None:
    with pytest.raises(ValueError):
        protocol.parse_usage(raw)
    assert protocol.lease_usage(_lease("a", 1, **{c.ANN_USAGE: raw})) is None


def test_usage_round_trip_and_validity() -> None:
    assert protocol.parse_usage(None) is None and protocol.parse_usage("") is None
    assert protocol.parse_usage(protocol.usage_annotation(Usage(cents=5, tokens=6))) == Usage(cents=5, tokens=6)
    assert protocol.parse_usage(protocol.usage_annotation({"cents": 5})) == Usage(cents=5, tokens=0)
    assert protocol.valid_report(Usage(cents=5), Usage(cents=6)) is not None
    assert protocol.valid_report(Usage(cents=protocol.MAX_CENTS + 1), None) == "implausibly large usage"
    assert protocol.valid_report(Usage(cents=6, tokens=1), Usage(cents=6)) is None


def test_signals_on_the_lease() -> None:
    assert protocol.lease_signals(_lease("a", 1)) == Signals()
    assert protocol.lease_signals(_lease("a", 1, **{c.ANN_SIGNALS: "not json"})) is None
    sig = Signals(stop=True, cap_cents=500, base_cents=100)
    assert protocol.lease_signals(_lease("a", 1, **{c.ANN_SIGNALS: json.dumps(sig.dump())})) == sig
    written = protocol.signals_annotation(sig)
    assert protocol.lease_signals(_lease("a", 1, **{c.ANN_SIGNALS: written})) == sig
    assert written == protocol.signals_annotation(Signals.model_validate(json.loads(written)))  # canonical


caps = st.one_of(st.none(), st.integers(0, 10**9))


@given(cap_c=caps, cap_t=caps, base_c=st.integers(0, 10**6), base_t=st.integers(0, 10**6),
       own=st.integers(0, 10**6), later=st.integers(0, 10**6))
def test_the_gateway_reply_and_the_lease_signals_give_the_same_remaining_caps(
        cap_c: int | None, cap_t: int | None, base_c: int, base_t: int, own: int, later: int) -> None:
    """A pod worker computes what is left from the Lease's signals; an external worker from the
    gateway's reply (computed from the same signals with the usage it sent). Both agree, also for
    usage reported after the reply."""
    lease_sig = Signals(cap_cents=cap_c, cap_tokens=cap_t, base_cents=base_c, base_tokens=base_t)
    sent = Usage(cents=own, tokens=own)
    left_c, left_t = protocol.remaining(lease_sig, sent)
    reply = protocol.signals_from_remaining(False, False, None, left_c, left_t, sent)
    now = Usage(cents=own + later, tokens=own + later)
    assert protocol.remaining(reply, now) == protocol.remaining(lease_sig, now)


def test_fenced_patch_tests_fence_and_holder_before_it_adds() -> None:
    patch = protocol.fenced_patch("job-a2", 3, "result", {"ok": True})
    assert patch == [{"op": "test", "path": "/status/fence", "value": 3},
                     {"op": "test", "path": "/status/holder", "value": "job-a2"},
                     {"op": "add", "path": "/status/result", "value": {"ok": True}}]
    with pytest.raises(ValueError):
        protocol.fenced_patch("job-a2", 3, "fence", 9)  # a worker never writes anything else


def test_a_namesakes_lease_is_not_held_when_the_run_uid_is_known() -> None:
    """Seed 378: a run deleted and re-created under its name starts again at holder job-a1 and
    fence 1. The old run's worker, still terminating, must not take the new Lease for its own."""
    lease = _lease("job-a1", 1)
    lease["metadata"]["ownerReferences"] = [{"kind": "WorkerRun", "name": "job", "uid": "new", "controller": True}]
    assert protocol.controller_uid(lease) == "new"
    assert protocol.holds(lease, "job-a1", 1, "new")
    assert not protocol.holds(lease, "job-a1", 1, "old")
    assert not protocol.holds(_lease("job-a1", 1), "job-a1", 1, "new")  # no owner: not provably the run's
    assert protocol.holds(lease, "job-a1", 1)  # callers that do not know the UID keep the old rule


def test_fenced_patch_names_the_run_by_uid_when_known() -> None:
    patch = protocol.fenced_patch("job-a1", 1, "error", {"code": "X"}, run_uid="u-7")
    assert patch[0] == {"op": "test", "path": "/metadata/uid", "value": "u-7"}
    assert patch[-1] == {"op": "add", "path": "/status/error", "value": {"code": "X"}}


def test_a_publication_is_recognised_in_the_run_after_its_answer_was_lost() -> None:
    """Seeds 149 and 184: the result's PATCH landed, its answer was dropped, the retry met the
    moved fence (a success moves it too) and the worker was told LeaseLost."""
    value = {"ok": 1}
    held = {"status": {"holder": "job-a1", "fence": 1, "result": value}}
    assert protocol.publication_recorded(held, "job-a1", 1, "result", value)
    assert not protocol.publication_recorded(held, "job-a1", 1, "result", {"ok": 2})
    done = {"status": {"holder": None, "fence": 2, "result": value, "attempts": [
        {"attempt": 1, "fence": 1, "holder": "job-a1", "outcome": "Succeeded"}]}}
    assert protocol.publication_recorded(done, "job-a1", 1, "result", value)
    assert not protocol.publication_recorded(done, "job-a2", 3, "result", value)  # not this attempt's
    lost = {"status": {"holder": None, "fence": 2, "attempts": [
        {"attempt": 1, "fence": 1, "holder": "job-a1", "outcome": "LeaseLost"}]}}
    assert not protocol.publication_recorded(lost, "job-a1", 1, "result", value)
    failed = {"status": {"holder": "job-a2", "fence": 3, "attempts": [
        {"attempt": 1, "fence": 1, "holder": "job-a1", "outcome": "WorkerFailed"},
        {"attempt": 2, "fence": 3, "holder": "job-a2"}]}}
    assert protocol.publication_recorded(failed, "job-a1", 1, "error", {"code": "X", "message": ""})


def test_invalid_causes_reads_only_a_status_that_names_fields() -> None:
    from tether.protocol import invalid_causes

    assert invalid_causes('{"kind":"Status","reason":"Invalid","details":{},"code":422}') == []
    assert invalid_causes({"details": {"causes": [{"field": "status.result"}]}}) == [{"field": "status.result"}]
    assert invalid_causes("<html>proxy</html>") == [] and invalid_causes(None) == []
    assert invalid_causes({"details": {"causes": "nonsense"}}) == []


def test_only_causes_about_the_published_field_make_a_bad_value() -> None:
    from tether.protocol import refuses_value

    assert refuses_value([{"field": "status.result"}], "result")
    assert refuses_value([{"field": "status.error.code"}, {"field": "<nil>"}], "error")
    assert not refuses_value([{"field": "status.resultant"}], "result")
    assert not refuses_value([{"field": "status.fence"}], "result") and not refuses_value([], "error")


@pytest.mark.parametrize("raw", ['{"stop":"true"}', '{"paused":1}', '{"capCents":"5"}', '{"endsAt":12345}',
                                 '{"baseCents":null}', '[1]', 'not json'])
def test_signals_of_the_wrong_type_are_malformed_and_keep_the_last_good_ones(raw: str) -> None:
    from tether.protocol import lease_signals

    assert lease_signals({"metadata": {"annotations": {"tether.dev/signals": raw}}}) is None


def test_the_operators_own_signals_read_back_exactly() -> None:
    import datetime as dt

    from tether.api.models import Signals
    from tether.protocol import lease_signals, signals_annotation

    sig = Signals(stop=True, reason="cap", ends_at=dt.datetime(2026, 11, 30, tzinfo=dt.timezone.utc), cap_cents=5,
                  base_cents=2)
    assert lease_signals({"metadata": {"annotations": {"tether.dev/signals": signals_annotation(sig)}}}) == sig
