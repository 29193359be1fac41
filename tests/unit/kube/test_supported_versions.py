"""The supported Kubernetes range is stated once (kube/support.py) and everything that states it
agrees; an API server that lacks what a run needs makes the run say so, never wait silently."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from tether.kube import support
from tether.kube.paths import approval_path
from tests.unit.controller.test_controller_review import KEY
from tests.unit.controller.test_namesake_and_revocation import _held, _new_run, controller, fake_api

ROOT = Path(__file__).resolve().parents[3]


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
             if re.search(r"Kubernetes (≥ ?|>= ?)?1\.(2\d|3[0-3])\b|1\.(2\d|3[0-3]) or newer", p.read_text())]
    assert stale == []


@pytest.mark.parametrize("info, said", [
    ({"major": "1", "minor": "34", "gitVersion": "v1.34.4"}, None),
    ({"major": "1", "minor": "32", "gitVersion": "v1.32.13"}, "older than Tether supports (1.34 to 1.36)"),
    ({"major": "1", "minor": "36", "gitVersion": "v1.36.3"}, None),
    ({"major": "1", "minor": "35+", "gitVersion": "v1.35.2-eks"}, None),
    ({"major": "1", "minor": "30", "gitVersion": "v1.30.14"}, "older than Tether supports (1.34 to 1.36)"),
    ({"major": "1", "minor": "37", "gitVersion": "v1.37.0"}, "newer than Tether is tested on"),
    ({}, "reports an unknown version"),
])
def test_the_operator_says_at_start_what_it_thinks_of_the_server(info: dict[str, Any], said: str | None) -> None:
    problem = support.version_problem(info)
    assert (problem is None) if said is None else (problem is not None and said in problem)


def test_a_server_without_crd_field_selectors_still_decides_gates() -> None:
    """Kubernetes 1.30 answers the approvals list by field selector with 400 (on main before the
    fix, the gate waited for ever): the namespace's approvals are listed whole and filtered, so the
    approved start gate grants the run."""
    approval = {"apiVersion": "tether.dev/v1alpha1", "kind": "WorkerRunApproval",
                "metadata": {"name": "ok", "namespace": "ns", "uid": "ap-1", "resourceVersion": "4",
                             "creationTimestamp": "2026-11-29T11:59:00Z"},
                "spec": {"runRef": {"name": "job", "uid": "run-NEW"}, "gate": "Start", "decision": "Approve",
                         "approver": "alice", "reason": "fine"}}
    other = {**approval, "metadata": {**approval["metadata"], "name": "other", "uid": "ap-2"},
             "spec": {**approval["spec"], "runRef": {"name": "another"}, "decision": "Deny"}}

    body = _new_run()
    body["spec"]["review"] = {"start": True}
    api = fake_api(body)
    for obj in (approval, other):
        api.put(approval_path("ns", obj["metadata"]["name"]), obj)
    # An API server older than CRD field selectors refuses them with 400.
    api.before(lambda req: (400, {"kind": "Status", "code": 400, "message": "field label not supported: spec.runRef.name"})
               if req.path.endswith("/workerrunapprovals") and req.params.get("fieldSelector") else None)

    async def go() -> dict[str, Any]:
        ctl = controller(api)
        ctl.on_run("ADDED", _held(api, body))
        await ctl.cache.classes.sync(lambda: ctl.kube.list_objects("/apis/tether.dev/v1alpha1/workerclasses"))
        snap = ctl.cache.snapshot(KEY)
        assert snap is not None
        await ctl.reconciler._pass(snap)
        written = ctl.cache.snapshot(KEY)
        assert written is not None
        return written.body

    status = asyncio.run(go())["status"]
    assert status["holder"] == "job-a1" and status["fence"] == 1, status
