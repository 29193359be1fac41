"""The chart rendered with the cached helm (helm template only, no cluster): an OTEL_* variable named
in tracing.extraEnv or extraEnv replaces the chart's built-in one, never doubles it; the alerts need
the operator scraped."""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

CHART = Path(__file__).resolve().parents[3] / "charts" / "tether"


def _env(tools_dir: Path, *sets: str) -> list[tuple[str, object]]:
    args = [str(tools_dir / "helm"), "template", "rel", str(CHART), "--namespace", "tether-system",
            "--kube-version", "1.36.3"]
    for s in sets:
        args += ["--set", s]
    out = subprocess.run(args, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    dep = next(d for d in yaml.safe_load_all(out.stdout) if d and d["kind"] == "Deployment")
    return [(e["name"], e.get("value", e.get("valueFrom")))
            for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]]


def test_an_extra_env_entry_replaces_the_built_in_otel_variable(tools_dir: Path) -> None:
    env = _env(tools_dir, "tracing.enabled=true", "tracing.endpoint=http://collector.obs:4318",
               "tracing.extraEnv[0].name=OTEL_EXPORTER_OTLP_PROTOCOL", "tracing.extraEnv[0].value=grpc",
               "tracing.extraEnv[1].name=OTEL_SERVICE_NAME", "tracing.extraEnv[1].value=tether-eu",
               "extraEnv[0].name=OTEL_TRACES_SAMPLER", "extraEnv[0].value=always_on",
               "tracing.samplerArg=0.5")
    names = [n for n, _ in env]
    assert len(names) == len(set(names)), names
    values = dict(env)
    assert values["OTEL_EXPORTER_OTLP_PROTOCOL"] == "grpc" and values["OTEL_SERVICE_NAME"] == "tether-eu"
    assert values["OTEL_TRACES_SAMPLER"] == "always_on" and values["OTEL_TRACES_SAMPLER_ARG"] == "0.5"
    assert values["OTEL_TRACES_EXPORTER"] == "otlp" and values["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://collector.obs:4318"


def test_the_endpoint_may_come_from_a_secret_or_config_map_instead(tools_dir: Path) -> None:
    env = dict(_env(tools_dir, "tracing.enabled=true", "tracing.endpoint=http://unused:4318",
                    "tracing.extraEnv[0].name=OTEL_EXPORTER_OTLP_ENDPOINT",
                    "tracing.extraEnv[0].valueFrom.configMapKeyRef.name=otel",
                    "tracing.extraEnv[0].valueFrom.configMapKeyRef.key=endpoint"))
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == {"configMapKeyRef": {"name": "otel", "key": "endpoint"}}


def _template(tools_dir: Path, *sets: str) -> subprocess.CompletedProcess[str]:
    args = [str(tools_dir / "helm"), "template", "rel", str(CHART), "--namespace", "tether-system",
            "--kube-version", "1.36.3"]
    for s in sets:
        args += ["--set", s]
    return subprocess.run(args, capture_output=True, text=True)


def test_the_alerts_need_the_operator_scraped(tools_dir: Path) -> None:
    """The PrometheusRule without a ServiceMonitor: nothing scrapes the operator, so TetherOperatorDown
    (absent(tether_build_info)) fired on a fresh install. Now the chart refuses it unless told otherwise."""
    alone = _template(tools_dir, "metrics.prometheusRule.enabled=true")
    assert alone.returncode != 0 and "metrics.serviceMonitor.enabled" in alone.stderr
    for other in ("metrics.serviceMonitor.enabled=true", "metrics.prometheusRule.scrapedElsewhere=true"):
        out = _template(tools_dir, "metrics.prometheusRule.enabled=true", other)
        assert out.returncode == 0, out.stderr
        assert any(d and d["kind"] == "PrometheusRule" for d in yaml.safe_load_all(out.stdout))
