"""The CRDs generated from the WorkerRun CRD are what their scripts write: a class's defaults
(hack/workerclass_crd.py) and a schedule's runTemplate.spec (hack/schedule_crd.py) are checked by
exactly the schemas (and rules) of a run's own fields."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("script", ["workerclass_crd.py", "schedule_crd.py"])
def test_the_crd_and_the_charts_copy_are_generated_from_the_run_crd(script: str) -> None:
    result = subprocess.run([sys.executable, str(ROOT / "hack" / script), "--check"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
