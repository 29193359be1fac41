"""A worker for the tracing e2e test (it runs inside process-kubelet pods): it sets up the
OpenTelemetry SDK from the OTEL_* environment, as an application would (the Tether SDK itself uses
only the API), then renews, flushes a checkpoint, sends one fenced side effect, and either exits 1
without publishing (attempts in payload.crashAttempts: the next attempt follows) or completes."""

from __future__ import annotations

import sys

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from tether import logs
from tether.worker import WorkerRun


def main() -> int:
    logs.setup()
    provider = TracerProvider(resource=Resource.create())
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    run = WorkerRun.from_env()
    crash = run.attempt in run.payload.get("crashAttempts", [])
    try:
        run.start()
        run.renew()
        run.checkpoint(f"attempt-{run.attempt}", flush=True)
        with run.http_client() as http:
            http.effect("POST", run.payload["effectUrl"], "charge", json={"attempt": run.attempt})
        if not crash:
            run.complete({"attempt": run.attempt})
    finally:
        run.stop()
        provider.shutdown()  # exports what is queued before the process ends
    return 1 if crash else 0


if __name__ == "__main__":
    sys.exit(main())
