"""The WorkerClass CRD is what hack/workerclass_crd.py writes from the WorkerRun CRD: a class's
defaults are checked by exactly the schemas (and rules) of a run's own fields."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]


def test_the_crd_and_the_charts_copy_are_generated_from_the_run_crd() -> None:
    result = subprocess.run([sys.executable, str(ROOT / "hack" / "workerclass_crd.py"), "--check"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
