"""The supported Kubernetes range is stated once (kube/support.py) and everything that states it
agrees; an API server that lacks what a run needs makes the run say so, never wait silently."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from tether.api import constants as c
from tether.controller.controller import Clock, RunController
from tether.kube import support
from tether.kube.client import ApiError
from tests.unit.test_controller_review import KEY, Kube
from tests.unit.test_namesake_and_revocation import T0, _new_run

ROOT = Path(__file__).resolve().parents[2]


def _versions_env() -> dict[str, str]:
    lines = (ROOT / "hack" / "versions.env").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if re.match(r"^[A-Z_]+=", line))


def test_both_ends_of_the_range_are_the_versions_built_and_tested() -> None:
    env = _versions_env()
    minor = lambda v: tuple(int(x) for x in v.lstrip("v").split(".")[:2])  # noqa: E731
    assert minor(env["KUBERNETES_OLDEST_VERSION"]) == support.OLDEST
    assert minor(env["KUBERNETES_VERSION"]) == support.NEWEST


def test_the_chart_readme_and_docs_state_the_same_range() -> None:
    chart = yaml.safe_load((ROOT / "charts" / "tether" / "Chart.yaml").read_text())
    assert chart["kubeVersion"] == f">={support.OLDEST[0]}.{support.OLDEST[1]}.0-0"
    assert f"Kubernetes {support.SUPPORTED}" in (ROOT / "README.md").read_text()
    stale = [p.name for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
                              ROOT / "charts" / "tether" / "values.yaml", ROOT / "charts" / "tether" / "values.schema.json"]
             if re.search(r"Kubernetes (≥ ?|>= ?)?1\.(2\d|30|31)\b|1\.(2\d|30|31) or newer", p.read_text())]
    assert stale == []


@pytest.mark.parametrize("info, said", [
    ({"major": "1", "minor": "32", "gitVersion": "v1.32.13"}, None),
    ({"major": "1", "minor": "36", "gitVersion": "v1.36.3"}, None),
    ({"major": "1", "minor": "33+", "gitVersion": "v1.33.2-eks"}, None),
    ({"major": "1", "minor": "30", "gitVersion": "v1.30.14"}, "older than Tether supports (1.32 to 1.36)"),
    ({"major": "1", "minor": "37", "gitVersion": "v1.37.0"}, "newer than Tether is tested on"),
    ({}, "reports an unknown version"),
])
def test_the_operator_says_at_start_what_it_thinks_of_the_server(info: dict[str, Any], said: str | None) -> None:
    problem = support.version_problem(info)
    assert (problem is None) if said is None else (problem is not None and said in problem)


def test_a_server_without_crd_field_selectors_makes_a_gated_run_say_so() -> None:
    """Kubernetes 1.30 answers the approvals list by field selector with 400: the pass decides
    everything but the gate, and the run is Stalled with the reason, not left waiting for ever."""
    class OldServer(Kube):
        async def list_objects(self, path: str, label_selector: str = "", field_selector: str = "") -> list[Any]:
            if "workerrunapprovals" in path and field_selector:
                raise ApiError(400, '{"message": "field label not supported: spec.runRef.name"}', "list approvals")
            return []

    async def go() -> dict[str, Any]:
        kube = OldServer({})
        ctl = RunController(kube, clock=Clock(now=lambda: T0, mono=lambda: 100.0))  # type: ignore[arg-type]
        body = _new_run()
        body["spec"]["review"] = {"start": True}
        ctl.on_run("ADDED", body)
        snap = ctl.cache.snapshot(KEY)
        assert snap is not None
        await ctl.reconciler._pass(snap)
        written = ctl.cache.snapshot(KEY)
        assert written is not None
        return written.body

    status = asyncio.run(go())["status"]
    stalled = next(x for x in status["conditions"] if x["type"] == c.COND_STALLED)
    assert stalled["status"] == "True" and stalled["reason"] == "KubernetesTooOld"
    assert "need Kubernetes 1.31 or newer" in stalled["message"] and "no review gate" in stalled["message"]
