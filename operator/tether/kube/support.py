"""The Kubernetes versions Tether supports, stated once, and the start-up check of the API server.

The oldest is set by what the design needs, all of it GA there (nothing rests on a feature gate a
distribution may turn off): ValidatingAdmissionPolicy (1.30), the pod name in pod-bound tokens
(`authentication.kubernetes.io/pod-name`, GA 1.32) that the fencing policies read, CRD field
selectors (GA 1.32) that list a run's WorkerRunApprovals — and a CEL cost estimator that admits
the WorkerRun CRD's rules: 1.32.13 refuses the CRD itself (its immutability rules compare maps of
any JSON, estimated at more than 100 times the budget), which testing that end found. Both ends are
tested (hack/versions.env: KUBERNETES_OLDEST_VERSION and KUBERNETES_VERSION).
"""

from __future__ import annotations

import re
from typing import Any

OLDEST = (1, 34)
NEWEST = (1, 36)
SUPPORTED = f"{OLDEST[0]}.{OLDEST[1]} to {NEWEST[0]}.{NEWEST[1]}"
# What each feature the operator uses needs, for messages that say so.
FIELD_SELECTORS = "CRD field selectors (WorkerRunApproval spec.runRef.name) need Kubernetes 1.31 or newer"


def server_version(info: dict[str, Any]) -> tuple[int, int] | None:
    """(major, minor) from /version (minor may read "32+" on some distributions)."""
    try:
        major = int(re.sub(r"\D", "", str(info.get("major", ""))))
        minor = int(re.sub(r"\D", "", str(info.get("minor", ""))))
    except ValueError:
        return None
    return major, minor


def version_problem(info: dict[str, Any]) -> str | None:
    """What to say at start about this API server's version, or None when it is supported."""
    version = server_version(info)
    shown = info.get("gitVersion") or "an unknown version"
    if version is None:
        return f"the API server reports {shown}; Tether supports Kubernetes {SUPPORTED}"
    if version < OLDEST:
        return (f"the API server is Kubernetes {shown}, older than Tether supports ({SUPPORTED}): "
                f"what it lacks is said where it matters (e.g. {FIELD_SELECTORS})")
    if version > NEWEST:
        return f"the API server is Kubernetes {shown}, newer than Tether is tested on ({SUPPORTED})"
    return None


def unsupported_field_selector(status: int, message: str) -> bool:
    """The API server's answer to a field selector it does not serve (CRD field selectors off)."""
    return status == 400 and "field label not supported" in message
