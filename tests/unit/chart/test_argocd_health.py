"""Argo CD's health check for WorkerRun, run as Lua with the cases in Argo's health_test.yaml format."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from lupa import LuaRuntime

HERE = Path(__file__).resolve().parents[3] / "gitops" / "argocd" / "tether.dev" / "WorkerRun"
CASES = yaml.safe_load((HERE / "health_test.yaml").read_text())["tests"]


def health(obj: dict[str, Any]) -> dict[str, str]:
    """Runs health.lua the way Argo CD does: the object as global `obj`, a table returned."""
    lua = LuaRuntime(unpack_returned_tuples=True)
    lua.globals().obj = lua.table_from(obj, recursive=True)
    result = lua.execute((HERE / "health.lua").read_text())
    return {"status": result["status"], "message": result["message"]}


@pytest.mark.parametrize("case", CASES, ids=[c["inputPath"] for c in CASES])
def test_health_cases(case: dict[str, Any]) -> None:
    obj = yaml.safe_load((HERE / case["inputPath"]).read_text())
    assert health(obj) == case["healthStatus"]
