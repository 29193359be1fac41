"""Argo CD's health checks (WorkerRun, WorkerRunSchedule), run as Lua with the cases in Argo's
health_test.yaml format."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from lupa import LuaRuntime

ROOT = Path(__file__).resolve().parents[3] / "gitops" / "argocd" / "tether.dev"
CASES = [(kind, case) for kind in ("WorkerRun", "WorkerRunSchedule")
         for case in yaml.safe_load((ROOT / kind / "health_test.yaml").read_text())["tests"]]


def health(obj: dict[str, Any], kind: str = "WorkerRun") -> dict[str, str]:
    """Runs health.lua the way Argo CD does: the object as global `obj`, a table returned."""
    lua = LuaRuntime(unpack_returned_tuples=True)
    lua.globals().obj = lua.table_from(obj, recursive=True)
    result = lua.execute((ROOT / kind / "health.lua").read_text())
    return {"status": result["status"], "message": result["message"]}


@pytest.mark.parametrize("kind, case", CASES, ids=[f"{k}/{c['inputPath']}" for k, c in CASES])
def test_health_cases(kind: str, case: dict[str, Any]) -> None:
    obj = yaml.safe_load((ROOT / kind / case["inputPath"]).read_text())
    assert health(obj, kind) == case["healthStatus"]
