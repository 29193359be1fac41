"""The scenarios that justify Tether: a worker that comes back too late can do no harm."""

from __future__ import annotations

import datetime as dt
import os
import signal
import time
from pathlib import Path
from urllib.parse import urlparse

import pytest

from testkit import runs
from testkit.kube import Kube
from tests.support.netcut import CutProxy
from testkit.receiver import Receiver
from testkit.scenario import app_run, lease, lines, record_measurement, wait_line, watch_last_renewal

SKEW_DIR = Path(__file__).resolve().parents[1] / "support" / "clockskew"


pytestmark = pytest.mark.local_cluster


def _ts(value: str) -> dt.datetime:
    return dt.datetime.fromisoformat(value.replace("Z", "+00:00"))


def test_reference_scenario_network_cut(kube: Kube, namespace: str, operator, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    api = urlparse(kube.config.server)
    api_proxy = CutProxy((api.hostname or "127.0.0.1", api.port or 443))
    receiver = Receiver()
    effect_proxy = CutProxy(("127.0.0.1", receiver.port))
    out, gate = tmp_path / "out.jsonl", tmp_path / "gate"
    body = app_run("ref", {"holdAttempts": [1], "gateFile": str(gate), "outFile": str(out),
                           "effectUrl": f"http://{effect_proxy.url}/effects"},
                   duration=8, renew=1,
                   annotations={"dev.tether.dev/api-server": f"https://{api_proxy.url}"})
    runs.create(kube, namespace, body)
    w1 = wait_line(out, event="started", attempt=1)
    pid = w1["pid"]
    try:
        runs.wait_phase(kube, namespace, "ref", "Running", timeout=30)
        # 1-2. W1 holds the run; it is cut off from the API server and from the receiver,
        #      then sends its side effect, which stays in flight.
        api_proxy.cut(pid)
        effect_proxy.cut(pid)
        gate.touch()
        # 3-4. The lease lapses; W2 takes over with a higher fence and finishes.
        run = runs.wait_phase(kube, namespace, "ref", ("Succeeded", "Failed", "Lost"), timeout=60)
        s = run["status"]
        assert s["phase"] == "Succeeded", s
        a1, a2 = s["attempts"][0], s["attempts"][1]
        assert a1["outcome"] == "LeaseLost" and a1["fence"] == 1
        assert a2["fence"] == 3 and a2["outcome"] == "Succeeded"
        assert s["result"] == {"attempt": 2}
        assert [(e.fence, e.attempt) for e in receiver.accepted()] == [(3, 2)]
        # 5. W1 is reconnected: its late request arrives, its renewal and its result fail.
        api_proxy.heal(pid)
        effect_proxy.heal(pid)
        done = wait_line(out, timeout=60, event="complete", attempt=1)
        w1_lines = [entry for entry in lines(out) if entry["attempt"] == 1]
        effect = next(entry for entry in w1_lines if entry["event"].startswith("effect"))
        assert effect["event"] == "effect" and effect["status"] == 409, effect
        renew = next(entry for entry in w1_lines if entry["event"] == "renew")
        assert renew["renewed"] is False and renew["lost"] is True
        assert done["accepted"] is False and done["error"] == "LeaseLost"
        assert len(receiver.accepted()) == 1 and [e.fence for e in receiver.refused()] == [1]
        final = runs.get(kube, namespace, "ref")["status"]
        assert final["result"] == {"attempt": 2} and final["fence"] == 4
        assert operator.events("heartbeat_lost")
    finally:
        _kill(pid)
        api_proxy.close()
        effect_proxy.close()
        receiver.close()


def _operator_silence(operator) -> float:  # type: ignore[no-untyped-def]
    lost = operator.events("heartbeat_lost")
    assert lost, "the operator logged no heartbeat_lost"
    return float(lost[-1]["silenceSeconds"])


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def test_paused_worker_stops_itself_and_late_writes_are_rejected(kube: Kube, namespace: str, operator,  # type: ignore[no-untyped-def]
                                                                 tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    duration = 8
    runs.create(kube, namespace, app_run("paused", {"holdAttempts": [1], "outFile": str(out)}, duration=duration))
    pid = wait_line(out, event="started", attempt=1)["pid"]
    try:
        runs.wait_phase(kube, namespace, "paused", "Running", timeout=30)
        os.kill(pid, signal.SIGSTOP)
        last_renewal = watch_last_renewal(kube, namespace, "paused", "paused-a1", timeout=duration + 20)
        revoked = time.monotonic()
        run = runs.wait_phase(kube, namespace, "paused", "Succeeded", timeout=60)
        a1, a2 = run["status"]["attempts"][:2]
        lost_after = revoked - last_renewal
        regrant = (_ts(a2["startedAt"]) - _ts(a1["endedAt"])).total_seconds()
        silence = _operator_silence(operator)
        record_measurement("lapse_to_regrant", leaseSeconds=duration, operatorSilence=silence,
                           testObserved=round(lost_after, 3), lostToNextGrant=round(regrant, 3))
        assert duration <= silence <= duration + 2, silence
        assert duration - 1.5 <= lost_after <= duration + 2, lost_after
        assert regrant < 2, regrant
        assert a1["outcome"] == "LeaseLost" and a2["fence"] > a1["fence"]
        os.kill(pid, signal.SIGCONT)
        gate = wait_line(out, timeout=30, event="gate", attempt=1)
        assert gate["owned"] is False  # it stopped itself on its monotonic deadline
        done = wait_line(out, timeout=30, event="complete", attempt=1)
        assert done["accepted"] is False
        assert runs.get(kube, namespace, "paused")["status"]["result"] == {"attempt": 2}
    finally:
        _kill(pid)


@pytest.mark.parametrize("skew", [300, -300])
def test_clock_skew_neither_early_nor_late(kube: Kube, namespace: str, operator, tmp_path: Path, skew: int) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "out.jsonl"
    duration = 8
    env = [{"name": "PYTHONPATH", "value": str(SKEW_DIR)},
           {"name": "TETHER_TEST_CLOCK_SKEW_SECONDS", "value": str(skew)}]
    runs.create(kube, namespace, app_run("skewed", {"holdAttempts": [1], "outFile": str(out)},
                                         duration=duration, renew=1, env=env))
    pid = wait_line(out, event="started", attempt=1)["pid"]
    try:
        runs.wait_phase(kube, namespace, "skewed", "Running", timeout=30)
        renew_time = _ts(lease(kube, namespace, "skewed")["spec"]["renewTime"])
        offset = (renew_time - dt.datetime.now(dt.timezone.utc)).total_seconds()
        assert abs(offset - skew) < 30, f"the worker's clock is not skewed: {offset}"
        # Not early: a skewed but healthy worker keeps the run for several lease durations.
        window_end = time.monotonic() + 2 * duration
        while time.monotonic() < window_end:
            s = runs.get(kube, namespace, "skewed")["status"]
            assert s["attempt"] == 1 and s["phase"] == "Running", s
            time.sleep(0.2)
        # Not late: once it stops renewing, it is lost one lease duration after its last renewal.
        os.kill(pid, signal.SIGSTOP)
        last_renewal = watch_last_renewal(kube, namespace, "skewed", "skewed-a1", timeout=duration + 20)
        lost_after = time.monotonic() - last_renewal
        silence = _operator_silence(operator)
        record_measurement("lapse_with_clock_skew", skew=skew, leaseSeconds=duration,
                           operatorSilence=silence, testObserved=round(lost_after, 3))
        # The operator's own measure: silence since it observed the last renewal. The test's
        # view from outside adds polling noise, hence its wider bound.
        assert duration <= silence <= duration + 2, silence
        assert duration - 1.5 <= lost_after <= duration + 2, lost_after
    finally:
        _kill(pid)
