"""Tracing's pure parts: the attempt's derived W3C context, traceparent parsing, when the operator
turns tracing on, and the spans it makes (reconcile, attempt) against an in-memory exporter."""

from __future__ import annotations

import datetime as dt
import re
from typing import Any, Iterator

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from tether import tracing
from tether.tracecontext import TraceContext, attempt_context, attempt_traceparent, parse_traceparent

pytestmark = pytest.mark.unit
W3C = re.compile(r"^00-[0-9a-f]{32}-[0-9a-f]{16}-01$")


def test_an_attempts_context_is_stable_and_its_own() -> None:
    one = attempt_traceparent("uid-1", 1, 1)
    assert W3C.match(one) and one == attempt_traceparent("uid-1", 1, 1)  # any replica, any restart
    others = {attempt_traceparent("uid-1", 2, 3), attempt_traceparent("uid-2", 1, 1), attempt_traceparent("uid-1", 1, 2)}
    assert one not in others and len(others) == 3
    # Pinned: a change of the derivation would split the traces of attempts running across an upgrade.
    assert attempt_traceparent("00000000-0000-0000-0000-000000000000", 1, 1) == \
        "00-568ecc7ac7bd65029f962d2a3daf3037-252c63af96933918-01"
    assert parse_traceparent(one) == attempt_context("uid-1", 1, 1)


@pytest.mark.parametrize("value, parsed", [
    ("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
     TraceContext(0x4bf92f3577b34da6a3ce929d0e0e4736, 0x00f067aa0ba902b7, True)),
    ("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00",
     TraceContext(0x4bf92f3577b34da6a3ce929d0e0e4736, 0x00f067aa0ba902b7, False)),
    (" 00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01 ",
     TraceContext(0x4bf92f3577b34da6a3ce929d0e0e4736, 0x00f067aa0ba902b7, True)),
    # A later version may add fields; its first four are read as version 00's.
    ("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-03-extra",
     TraceContext(0x4bf92f3577b34da6a3ce929d0e0e4736, 0x00f067aa0ba902b7, True)),
    ("", None), (None, None), ("garbage", None),
    ("00-00000000000000000000000000000000-00f067aa0ba902b7-01", None),  # all-zero trace id
    ("00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01", None),  # all-zero span id
    ("ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", None),  # forbidden version
    ("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x", None),  # version 00 has four fields
    ("00-4BF92F3577B34DA6A3CE929D0E0E4736-00F067AA0BA902B7-01", None),  # upper case is invalid
    ("00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01", None),  # short trace id
])
def test_traceparent_parsing_follows_w3c(value: str | None, parsed: TraceContext | None) -> None:
    assert parse_traceparent(value) == parsed


@pytest.mark.parametrize("env, on", [
    ({}, False),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, True),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"}, True),
    ({"OTEL_TRACES_EXPORTER": "otlp"}, True),
    ({"OTEL_TRACES_EXPORTER": "console"}, True),
    ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, False),
    ({"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, False),
    ({"OTEL_SDK_DISABLED": "TRUE", "OTEL_TRACES_EXPORTER": "otlp"}, False),
    ({"OTEL_SDK_DISABLED": "false", "OTEL_TRACES_EXPORTER": "otlp"}, True),
    ({"OTEL_SERVICE_NAME": "tether"}, False),  # a name alone exports nothing
])
def test_tracing_is_on_only_when_an_exporter_is_configured(env: dict[str, str], on: bool) -> None:
    assert tracing.enabled_by(env) is on


def test_an_unconfigured_operator_installs_nothing() -> None:
    assert tracing.configure({}) is False and tracing._provider is None


@pytest.fixture
def spans(monkeypatch: pytest.MonkeyPatch) -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(id_generator=tracing.attempt_ids())
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tracing, "_tracer", provider.get_tracer(tracing.SCOPE))
    monkeypatch.setattr(tracing, "_provider", provider)
    yield exporter
    provider.shutdown()


def _run(attempts: list[dict[str, Any]], holder: str | None = "job-a2") -> Any:
    from tether.api.models import WorkerRun

    return WorkerRun.model_validate({
        "apiVersion": "tether.dev/v1alpha1", "kind": "WorkerRun",
        "metadata": {"name": "job", "namespace": "ns", "uid": "uid-9"},
        "spec": {"executor": "Pod"},
        "status": {"phase": "Running", "attempt": len(attempts), "fence": attempts[-1]["fence"] if attempts else 0,
                   "holder": holder, "attempts": attempts}})


class Again(Exception):
    pass


def test_a_reconcile_span_ends_on_every_path(spans: InMemorySpanExporter) -> None:
    from tether.core.actions import ClearLease

    run = _run([{"attempt": 1, "fence": 1, "outcome": "LeaseLost"}, {"attempt": 2, "fence": 3}])
    with tracing.reconcile_span("ns", "job", benign=(Again,)):
        tracing.on_snapshot(run)
        tracing.on_decision([ClearLease(fence=3)])
    with pytest.raises(Again), tracing.reconcile_span("ns", "job", benign=(Again,)):
        raise Again("conflict")
    with pytest.raises(RuntimeError), tracing.reconcile_span("ns", "job", benign=(Again,)):
        raise RuntimeError("a bug")
    ok, again, bug = spans.get_finished_spans()
    assert ok.name == "reconcile WorkerRun" and ok.parent is None
    assert ok.attributes["tether.run.uid"] == "uid-9" and ok.attributes["tether.attempt"] == 2
    assert ok.attributes["tether.fence"] == 3 and ok.attributes["k8s.namespace.name"] == "ns"
    assert tuple(ok.attributes["tether.decision"]) == ("ClearLease",)
    # Linked to the current attempt's trace, not a child of it (a run reconciles for days).
    assert [(ln.context.trace_id, ln.context.span_id) for ln in ok.links] == \
        [tuple(attempt_context("uid-9", 2, 3))[:2]]
    assert again.attributes["tether.reconcile.result"] == "Again" and again.status.status_code is StatusCode.UNSET
    assert bug.status.status_code is StatusCode.ERROR and bug.events[0].name == "exception"


def test_an_ended_attempt_is_exported_once_as_the_root_of_its_derived_trace(spans: InMemorySpanExporter) -> None:
    t0 = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
    run = _run([{"attempt": 1, "fence": 1, "holder": "job-a1", "startedAt": t0.isoformat(),
                 "endedAt": (t0 + dt.timedelta(days=2)).isoformat(), "outcome": "LeaseLost"}], holder=None)
    with tracing.reconcile_span("ns", "job"):
        tracing.on_status_written(run, grants=False, ends_attempt=True)
    attempt, reconcile = spans.get_finished_spans()
    ctx = attempt_context("uid-9", 1, 1)
    assert attempt.name == "tether.attempt" and attempt.parent is None
    assert (attempt.context.trace_id, attempt.context.span_id) == (ctx.trace_id, ctx.span_id)
    assert attempt.end_time - attempt.start_time == 2 * 86400 * 10**9
    assert attempt.attributes["tether.outcome"] == "LeaseLost" and attempt.status.status_code is StatusCode.ERROR
    # The reconcile that wrote it is a trace of its own, with random ids.
    assert reconcile.context.trace_id != ctx.trace_id


def test_a_grant_links_its_reconcile_to_the_new_attempt(spans: InMemorySpanExporter) -> None:
    granted = _run([{"attempt": 1, "fence": 1}])
    with tracing.reconcile_span("ns", "job"):
        tracing.on_status_written(granted, grants=True, ends_attempt=False)
    (span,) = spans.get_finished_spans()
    assert [(ln.context.trace_id, ln.attributes["tether.granted"]) for ln in span.links] == \
        [(attempt_context("uid-9", 1, 1).trace_id, True)]


def test_the_worker_pod_carries_its_attempts_traceparent() -> None:
    from tether.kube.resources import build_pod

    run = _run([{"attempt": 1, "fence": 1}])
    run.spec.template = {"spec": {"containers": [{"name": "w", "env": [{"name": "TRACEPARENT", "value": "x"}]}]}}
    env = build_pod(run, "job-a1", 1, 1, "job-a1")["spec"]["containers"][0]["env"]
    assert [e["value"] for e in env if e["name"] == "TRACEPARENT"] == [attempt_traceparent("uid-9", 1, 1)]


def test_the_gateway_claim_reply_carries_the_attempts_traceparent() -> None:
    from tests.unit.gateway.test_gateway_envelope import AUTH, OP, _call, held_api
    from tether.gateway.app import build_app
    from tether.gateway.openapi import openapi_document

    resp = _call(build_app(held_api().client(), "tether-gateway"), "POST", f"{OP}/claim", json={"workerId": "w1"},
                 headers=AUTH)
    assert resp.status_code == 200, resp.text
    assert resp.json()["traceparent"] == attempt_traceparent("run-1", 1, 1)
    assert "traceparent" in openapi_document()["components"]["schemas"]["ClaimResponse"]["required"]


def test_a_configured_operator_exports_over_otlp_to_the_receiver() -> None:
    """configure() from the OTEL_* environment, in a process of its own (the global provider is set
    once per process), exporting over OTLP/HTTP protobuf to the tests' receiver."""
    import os
    import subprocess
    import sys

    from tests.support.otlp import OtlpReceiver

    receiver = OtlpReceiver()
    try:
        code = ("from tether import tracing\n"
                "from tests.unit.test_tracing import _run\n"
                "assert tracing.configure()\n"
                "with tracing.reconcile_span('ns', 'job'): pass\n"
                "run = _run([{'attempt': 1, 'fence': 1, 'outcome': 'Succeeded',"
                " 'startedAt': '2026-01-01T00:00:00Z', 'endedAt': '2026-01-01T00:01:00Z'}], holder=None)\n"
                "tracing.export_attempt(run, run.status.attempts[0])\n"
                "tracing.shutdown()\n")
        # The reconcile spans sampled out entirely: the attempt's span is exported all the same.
        env = {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_RESOURCE_ATTRIBUTES": "a=b",
               "OTEL_TRACES_SAMPLER": "always_off"}
        env.pop("OTEL_SERVICE_NAME", None)
        subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60)
        (span,) = receiver.spans()  # shutdown() exported it before the process ended
    finally:
        receiver.close()
    assert (span.name, span.service, span.scope) == ("tether.attempt", "tether-operator", "tether.operator")
    ctx = attempt_context("uid-9", 1, 1)
    assert (span.trace_id, span.span_id, span.parent_span_id) == (ctx.trace_id_hex, ctx.span_id_hex, "")


def test_shutdown_is_bounded_by_the_otlp_timeout_overall(monkeypatch: pytest.MonkeyPatch) -> None:
    """A collector that accepts and never answers: the provider's shutdown exports batch after batch,
    each with the exporter's own timeout (three batches: 3 s at OTEL_EXPORTER_OTLP_TIMEOUT=1, 30 s at
    the default), past the pod's grace period. Now one deadline for all of it."""
    import socket
    import threading
    import time

    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    silent = socket.create_server(("127.0.0.1", 0), backlog=64)
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                held.append(silent.accept()[0])  # read nothing, answer nothing
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "1")
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", raising=False)
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(
        OTLPSpanExporter(endpoint=f"http://127.0.0.1:{silent.getsockname()[1]}/v1/traces"), schedule_delay_millis=60_000))
    for _ in range(1500):  # three batches of 512
        provider.get_tracer("t").start_span("s").end()
    monkeypatch.setattr(tracing, "_provider", provider)
    try:
        began = time.monotonic()
        assert tracing.shutdown() is False  # gave up: what was queued is lost
        took = time.monotonic() - began
    finally:
        silent.close()
        for c in held:
            c.close()
    assert 0.9 <= took < 1.8, took
    assert tracing.shutdown_timeout({"OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "2.5", "OTEL_EXPORTER_OTLP_TIMEOUT": "7"}) == 2.5
    assert tracing.shutdown_timeout({}) == 10.0 and tracing.shutdown_timeout({"OTEL_EXPORTER_OTLP_TIMEOUT": "x"}) == 10.0
