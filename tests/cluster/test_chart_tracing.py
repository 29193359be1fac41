"""The chart's tracing values: off by default (no OTEL_* variable), on with an endpoint (the OTEL_*
environment the operator reads), an endpoint required, and the values typed by values.schema.json."""

from __future__ import annotations

from pathlib import Path

from tests.cluster.test_chart import CHART, helm, render


def _env(docs: list[dict]) -> dict[str, object]:
    dep = next(d for d in docs if d["kind"] == "Deployment")
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}


def test_tracing_is_off_by_default(tools_dir: Path) -> None:
    assert not [name for name in _env(render(tools_dir)) if name.startswith("OTEL_")]


def test_tracing_on_sets_the_standard_otel_environment(tools_dir: Path) -> None:
    env = _env(render(tools_dir, "tracing.enabled=true", "tracing.endpoint=http://collector.obs:4318",
                      "tracing.sampler=parentbased_traceidratio", "tracing.samplerArg=0.25",
                      "tracing.extraEnv[0].name=OTEL_EXPORTER_OTLP_COMPRESSION", "tracing.extraEnv[0].value=gzip"))
    assert env["OTEL_TRACES_EXPORTER"] == "otlp" and env["OTEL_EXPORTER_OTLP_PROTOCOL"] == "http/protobuf"
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://collector.obs:4318"
    assert env["OTEL_SERVICE_NAME"] == "tether-operator"
    assert env["OTEL_TRACES_SAMPLER"] == "parentbased_traceidratio" and env["OTEL_TRACES_SAMPLER_ARG"] == "0.25"
    assert env["OTEL_EXPORTER_OTLP_COMPRESSION"] == "gzip"
    # Kubernetes expands $(POD_NAME): the pod's own variables come first.
    names = list(env)
    assert names.index("POD_NAME") < names.index("OTEL_RESOURCE_ATTRIBUTES")
    assert env["OTEL_RESOURCE_ATTRIBUTES"] == "k8s.pod.name=$(POD_NAME),k8s.namespace.name=$(POD_NAMESPACE)"


def test_tracing_on_needs_an_endpoint_and_typed_values(tools_dir: Path) -> None:
    args = ["template", "rel", str(CHART), "--namespace", "tether-system"]
    no_endpoint = helm(tools_dir, *args, "--set", "tracing.enabled=true")
    assert no_endpoint.returncode != 0 and "endpoint" in no_endpoint.stderr
    bad_sampler = helm(tools_dir, *args, "--set", "tracing.enabled=true,tracing.endpoint=http://c:4318,tracing.sampler=sometimes")
    assert bad_sampler.returncode != 0 and "sampler" in bad_sampler.stderr
    lint = helm(tools_dir, "lint", "--strict", str(CHART), "--set", "tracing.enabled=true,tracing.endpoint=http://c:4318")
    assert lint.returncode == 0, lint.stdout + lint.stderr
