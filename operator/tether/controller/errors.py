"""What a reconcile can end with besides a result: each tells the loop how to go on."""

from __future__ import annotations

from tether.kube.client import ApiError


class Again(Exception):
    """The snapshot is out of date (a conflict, a moved lease): decide again from fresh data."""


class Inconclusive(Exception):
    """A lapse could not be confirmed (slow or failed read, an outage): look again later."""

    def __init__(self, why: str, retry_in: float) -> None:
        super().__init__(why)
        self.retry_in = retry_in


class SpecError(Exception):
    """The API server refused an object built from the spec (422, 403 by policy): not transient."""

    def __init__(self, reason: str, api_error: ApiError) -> None:
        super().__init__(api_error.message)
        self.reason = reason
        self.api_error = api_error


class NotLeader(Exception):
    """This replica is no longer the leader: nothing more may be written, not even the rest of
    a pass already under way."""
