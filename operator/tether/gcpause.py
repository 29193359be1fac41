"""This process's own garbage-collection pauses.

A full collection walks every object the operator holds: at thousands of runs that stops the
event loop for a second or more. An API answer timed across such a pause says nothing about the
API server (the outage guard would take it for one, and judge no lapse for a lease duration), so
the timers of the health probe and of the confirming read subtract the pauses they spanned.
"""

from __future__ import annotations

import gc
import logging
import time
from typing import Any

from tether import metrics

log = logging.getLogger("tether.gc")

_state = {"paused": 0.0, "started": None}
LONG_PAUSE_SECONDS = 0.5


def paused() -> float:
    """Seconds this process has spent in garbage collection since install() (monotonic)."""
    return float(_state["paused"])  # type: ignore[arg-type]


def _callback(phase: str, info: dict[str, Any]) -> None:
    if phase == "start":
        _state["started"] = time.monotonic()
        return
    started = _state["started"]
    if started is None:
        return
    took = time.monotonic() - started  # type: ignore[operator]
    _state["paused"], _state["started"] = paused() + took, None
    if info.get("generation") == 2:
        metrics.GC_PAUSE.observe(took)
        if took > LONG_PAUSE_SECONDS:
            log.info("long garbage collection pause", extra={"event": "gc_pause", "seconds": round(took, 3),
                                                             "collected": info.get("collected")})


def install() -> None:
    if _callback not in gc.callbacks:
        gc.callbacks.append(_callback)
