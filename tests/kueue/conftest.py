"""A failed test against Kueue reports what Kueue's manager logged last: the manager is shared by
the whole group and its state dir is gone once the session ends."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator

import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[Any]:
    outcome = yield
    report = outcome.get_result()
    described = os.environ.get("TETHER_TEST_KUEUE")
    if report.failed and described:
        log = Path(json.loads(described)["log"])
        tail = log.read_text(errors="replace").splitlines()[-80:] if log.exists() else ["(no log)"]
        report.sections.append((f"kueue log, last lines ({log})", "\n".join(tail)))
