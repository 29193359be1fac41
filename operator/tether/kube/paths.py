"""The API paths Tether reads and writes: one place, so no module spells a URL by hand."""

from __future__ import annotations

from tether.api.kueue import KUEUE_API_VERSION, WORKLOAD_PLURAL
from tether.api.models import API_VERSION, BUDGET_PLURAL, PLURAL

APPROVAL_PLURAL = "workerrunapprovals"


def _named(base: str, name: str) -> str:
    return base + (f"/{name}" if name else "")


def run_path(ns: str, name: str = "") -> str:
    return _named(f"/apis/{API_VERSION}/namespaces/{ns}/{PLURAL}", name)


def budget_path(ns: str, name: str = "") -> str:
    return _named(f"/apis/{API_VERSION}/namespaces/{ns}/{BUDGET_PLURAL}", name)


def approval_path(ns: str, name: str = "") -> str:
    return _named(f"/apis/{API_VERSION}/namespaces/{ns}/{APPROVAL_PLURAL}", name)


def lease_path(ns: str, name: str = "") -> str:
    return _named(f"/apis/coordination.k8s.io/v1/namespaces/{ns}/leases", name)


def pod_path(ns: str, name: str = "") -> str:
    return _named(f"/api/v1/namespaces/{ns}/pods", name)


def secret_path(ns: str, name: str = "") -> str:
    return _named(f"/api/v1/namespaces/{ns}/secrets", name)


def event_path(ns: str) -> str:
    return f"/api/v1/namespaces/{ns}/events"


def namespace_path(ns: str) -> str:
    return f"/api/v1/namespaces/{ns}"


def workload_path(ns: str, name: str = "") -> str:
    return _named(f"/apis/{KUEUE_API_VERSION}/namespaces/{ns}/{WORKLOAD_PLURAL}", name)
