"""Where WorkerRunSchedules are served (kube.paths.object_path for the capability's own kind)."""

from __future__ import annotations

from tether.api.models import API_VERSION
from tether.kube.paths import object_path
from tether.schedules.api import SCHEDULE_PLURAL


def schedule_path(ns: str, name: str = "") -> str:
    return object_path(API_VERSION, SCHEDULE_PLURAL, ns, name)
