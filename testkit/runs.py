"""Helpers to create WorkerRuns from the examples and wait for their phases."""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import yaml

from testkit.kube import Kube

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def example(name: str, **spec_overrides: Any) -> dict[str, Any]:
    body = yaml.safe_load((EXAMPLES / name).read_text())
    body = copy.deepcopy(body)
    use_test_image(body)
    for key, value in spec_overrides.items():
        if isinstance(value, dict) and isinstance(body["spec"].get(key), dict):
            body["spec"][key] = {**body["spec"][key], **value}
        else:
            body["spec"][key] = value
    return body


def use_test_image(body: dict[str, Any], image: str | None = None) -> dict[str, Any]:
    """On another cluster (make e2e-kind, tests/kind) pods run the image built from this checkout."""
    image = image or os.environ.get("TETHER_TEST_WORKER_IMAGE")
    if image:
        for container in body["spec"]["template"]["spec"]["containers"]:
            container["image"] = image
            container["imagePullPolicy"] = "Never"
    return body


def create(kube: Kube, ns: str, body: dict[str, Any], name: str | None = None) -> dict[str, Any]:
    body = copy.deepcopy(body)
    if name:
        body["metadata"]["name"] = name
    return kube.ok(kube.post(Kube.wr_path(ns), body))


def get(kube: Kube, ns: str, name: str) -> dict[str, Any]:
    return kube.ok(kube.get(Kube.wr_path(ns, name)))


def wait_phase(kube: Kube, ns: str, name: str, phases: str | tuple[str, ...], timeout: float = 90) -> dict[str, Any]:
    wanted = (phases,) if isinstance(phases, str) else phases
    return kube.wait_for(Kube.wr_path(ns), name, lambda run: (run.get("status") or {}).get("phase") in wanted,
                         timeout, f"{ns}/{name} in {wanted}")


def condition(run: dict[str, Any], type_: str) -> dict[str, Any] | None:
    return next((c for c in (run.get("status") or {}).get("conditions", []) if c["type"] == type_), None)


def events(kube: Kube, ns: str, name: str) -> list[str]:
    items = kube.ok(kube.get(f"/api/v1/namespaces/{ns}/events",
                             params={"fieldSelector": f"involvedObject.name={name}"}))["items"]
    return [e["reason"] for e in sorted(items, key=lambda e: e["metadata"]["creationTimestamp"])]
