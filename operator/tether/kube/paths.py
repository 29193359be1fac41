"""The API paths Tether reads and writes: one place, so no module spells a URL by hand."""

from __future__ import annotations

from tether.api.models import API_VERSION, BUDGET_PLURAL, PLURAL
from tether.api.workerclass import CLASS_PLURAL

APPROVAL_PLURAL = "workerrunapprovals"


def _named(base: str, name: str) -> str:
    return base + (f"/{name}" if name else "")


def run_path(ns: str, name: str = "") -> str:
    return _named(f"/apis/{API_VERSION}/namespaces/{ns}/{PLURAL}", name)


def all_runs_path() -> str:
    """WorkerRuns of every namespace."""
    return f"/apis/{API_VERSION}/{PLURAL}"


def class_path(name: str = "") -> str:
    """WorkerClasses (cluster-scoped)."""
    return _named(f"/apis/{API_VERSION}/{CLASS_PLURAL}", name)


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


def service_account_path(ns: str, name: str = "") -> str:
    return _named(f"/api/v1/namespaces/{ns}/serviceaccounts", name)


def token_request_path(ns: str, service_account: str) -> str:
    return f"{service_account_path(ns, service_account)}/token"


def role_path(ns: str, name: str = "") -> str:
    return _named(f"/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/roles", name)


def role_binding_path(ns: str, name: str = "") -> str:
    return _named(f"/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/rolebindings", name)


TOKEN_REVIEWS = "/apis/authentication.k8s.io/v1/tokenreviews"
SUBJECT_ACCESS_REVIEWS = "/apis/authorization.k8s.io/v1/subjectaccessreviews"


def event_path(ns: str) -> str:
    return f"/api/v1/namespaces/{ns}/events"


def namespace_path(ns: str) -> str:
    return f"/api/v1/namespaces/{ns}"


def object_path(api_version: str, plural: str, ns: str | None = None, name: str = "") -> str:
    """Any kind's objects (a capability's, the console's watches), namespaced when `ns` is given;
    the core group ("v1") is served under /api."""
    root = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    where = f"/namespaces/{ns}" if ns is not None else ""
    return _named(f"{root}{where}/{plural}", name)


def self_subject_review_path() -> str:
    return "/apis/authentication.k8s.io/v1/selfsubjectreviews"
