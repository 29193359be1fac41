"""Tracing end to end: an operator exporting over OTLP (the OTEL_* environment) reconciles a run whose
Python worker renews, flushes a checkpoint, sends a fenced side effect and crashes on its first attempt,
then completes on its second. Every span reaches an in-process OTLP receiver: one trace per attempt
(derived from run UID, attempt and fence), the worker's spans under the operator's attempt span, the
side effect's receiver saw a traceparent of that trace, and the reconciles are traces of their own
linked to the attempts."""

from __future__ import annotations

from pathlib import Path


import pytest

from testkit import runs
from testkit.kube import Kube
from testkit.operator_process import OperatorProcess
from tests.support.otlp import OtlpReceiver, Span
from testkit.receiver import Receiver
from testkit.scenario import app_run
from tether.tracecontext import attempt_context, parse_traceparent

# Export every 200 ms rather than every 5 s: the test polls the receiver with a deadline.
FAST = {"OTEL_BSP_SCHEDULE_DELAY": "200"}


@pytest.mark.local_cluster
def test_each_attempt_is_one_trace_shared_by_operator_worker_and_receiver(kube: Kube, namespace: str,
                                                                           tmp_path: Path) -> None:
    otlp, effects = OtlpReceiver(), Receiver()
    op = OperatorProcess(namespace, str(kube.kubeconfig_path), tmp_path / "op.log", extra_env={
        "TETHER_FOLD_INTERVAL_SECONDS": "1", "OTEL_EXPORTER_OTLP_ENDPOINT": otlp.endpoint,
        "OTEL_SERVICE_NAME": "tether-operator-e2e", **FAST}).start()
    try:
        env = [{"name": k, "value": v} for k, v in {"OTEL_EXPORTER_OTLP_ENDPOINT": otlp.endpoint,
                                                    "OTEL_SERVICE_NAME": "traced-worker", **FAST}.items()]
        body = app_run("traced", {"crashAttempts": [1], "effectUrl": effects.url}, duration=10, renew=1, env=env)
        body["spec"]["template"]["spec"]["containers"][0]["command"] = ["python", "tests/support/traced_worker.py"]
        runs.create(kube, namespace, body)
        status = runs.wait_phase(kube, namespace, "traced", ("Succeeded", "Failed"), timeout=120)["status"]
        assert status["phase"] == "Succeeded", status
        uid = runs.get(kube, namespace, "traced")["metadata"]["uid"]
        a1, a2 = status["attempts"]
        assert a1["outcome"] == "PodFailed" and a2["outcome"] == "Succeeded"
        ctx = {a["attempt"]: attempt_context(uid, a["attempt"], a["fence"]) for a in (a1, a2)}
        fence = {a["attempt"]: a["fence"] for a in (a1, a2)}
        assert ctx[1].trace_id != ctx[2].trace_id  # the second attempt has its own context

        def of_attempt(spans: list[Span], n: int) -> dict[str, list[Span]] | None:
            mine: dict[str, list[Span]] = {}
            for s in spans:
                if s.trace_id == ctx[n].trace_id_hex:
                    mine.setdefault(s.name, []).append(s)
            wanted = {"tether.attempt", "tether.renew", "tether.checkpoint", "tether.effect"} | \
                ({"tether.publish"} if n == 2 else set())
            return mine if wanted <= set(mine) else None

        for n in (1, 2):
            mine: dict[str, list[Span]] = otlp.wait_for(lambda spans: of_attempt(spans, n), timeout=60,
                                                        what=f"attempt {n}'s spans")
            (root,) = mine["tether.attempt"]
            # The operator's attempt span is the trace's root, with the derived span id.
            assert (root.span_id, root.parent_span_id, root.service) == (ctx[n].span_id_hex, "", "tether-operator-e2e")
            assert root.attributes["tether.run.uid"] == uid and root.attributes["tether.attempt"] == n
            assert root.attributes["tether.fence"] == fence[n]
            assert root.attributes["tether.outcome"] == ("PodFailed" if n == 1 else "Succeeded")
            worker = [s for name, spans in mine.items() if name != "tether.attempt" for s in spans]
            assert {s.service for s in worker} == {"traced-worker"}
            for s in worker:
                assert s.attributes["tether.attempt"] == n and s.attributes["tether.fence"] == fence[n], s
                assert s.attributes["tether.run.name"] == "traced" and s.attributes["k8s.namespace.name"] == namespace
            assert all(s.parent_span_id == ctx[n].span_id_hex for s in mine["tether.renew"])
            assert any(s.attributes.get("tether.renewal") == "confirmed" for s in mine["tether.renew"])
            (effect_span,) = mine["tether.effect"]
            # The side effect's receiver saw the effect span's own context: the attempt's trace.
            (sent,) = [e for e in effects.seen() if e.attempt == n]
            assert sent.fence == fence[n]
            seen_ctx = parse_traceparent(sent.traceparent)
            assert seen_ctx is not None and (seen_ctx.trace_id_hex, seen_ctx.span_id_hex) == \
                (ctx[n].trace_id_hex, effect_span.span_id)

        # Reconciles: traces of their own (nothing held open for an attempt's days), linked to the
        # attempts, with the run, attempt, fence and decision as attributes.
        def reconciles(spans: list[Span]) -> list[Span] | None:
            mine = [s for s in spans if s.name == "reconcile WorkerRun" and s.attributes.get("tether.run.uid") == uid]
            granted = [s for s in mine if any("granted" in d for d in s.attributes.get("tether.decision", []))]
            return mine if len(granted) >= 2 else None

        passes: list[Span] = otlp.wait_for(reconciles, timeout=30, what="the granting reconciles")
        assert not {s.trace_id for s in passes} & {c.trace_id_hex for c in ctx.values()}
        linked = {(t, sid) for s in passes for (t, sid, _) in s.links}
        assert {(c.trace_id_hex, c.span_id_hex) for c in ctx.values()} <= linked
        assert all(s.attributes["k8s.namespace.name"] == namespace for s in passes)
        assert {s.attributes.get("tether.attempt") for s in passes} >= {1, 2}
    finally:
        op.stop()
        otlp.close()
        effects.close()
