"""Pure rules for judging worker liveness without trusting the operator's own view too far.

Kubernetes' node lifecycle controller faces the same question for kubelets: when a large
share of heartbeats stop together, the likelier cause is the control plane or the observer's
connection to it, not that every worker died at the same moment.
"""

from __future__ import annotations

# At least this many overdue leases, and at least this share of the held ones, is a mass lapse
# (the node lifecycle controller's --unhealthy-zone-threshold is 55 %, from 3 nodes).
MASS_LAPSE_MIN = 3
MASS_LAPSE_SHARE = 0.55


def mass_lapse(overdue: int, active: int) -> bool:
    return active > 0 and overdue >= MASS_LAPSE_MIN and overdue >= MASS_LAPSE_SHARE * active


def judge_from(api_available_since: float | None, duration: float) -> float | None:
    """The earliest monotonic time a lapse may be judged: a full lease duration after the API
    server became reachable (again). None while it is unreachable: judge nothing."""
    if api_available_since is None:
        return None
    return api_available_since + duration
