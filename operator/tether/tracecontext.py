"""An attempt's W3C trace context, derived rather than stored (docs/operations.md, "Tracing").

Every attempt of a run is one trace. Its trace id and the span id of its root (the `attempt`
span, which the operator exports once the attempt ends) are a hash of the run's UID, the attempt
number and the attempt's fence: every replica, before and after any restart, and the gateway
compute the same context without a write, a read or an open span held in memory for days.

The context is a correlation id and nothing more. It is not secret (anyone who can read the
run can compute it) and nothing in Tether trusts it: fencing rests on the fence, the Lease and
the API server's admission policy, never on a trace header.

Pure: no OpenTelemetry import, so the API models, the gateway and the worker SDK can use it.
"""

from __future__ import annotations

import hashlib
import re
from typing import NamedTuple

# The environment variable (and gateway claim field) that hands a worker its attempt's context.
ENV_TRACEPARENT = "TRACEPARENT"
# The HTTP header of the W3C Trace Context recommendation (lower case, as the spec writes it).
HEADER = "traceparent"

_TRACEPARENT = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?$")


class TraceContext(NamedTuple):
    trace_id: int
    span_id: int
    sampled: bool = True

    @property
    def trace_id_hex(self) -> str:
        return f"{self.trace_id:032x}"

    @property
    def span_id_hex(self) -> str:
        return f"{self.span_id:016x}"

    def traceparent(self) -> str:
        return f"00-{self.trace_id_hex}-{self.span_id_hex}-{'01' if self.sampled else '00'}"


def attempt_context(run_uid: str, attempt: int, fence: int) -> TraceContext:
    """The trace of one attempt: the same for the same (run UID, attempt, fence), different for
    any other attempt of any run. The domain prefix keeps it apart from any other use of the hash;
    an all-zero id (invalid in W3C) is practically impossible and replaced all the same."""
    digest = hashlib.sha256(f"tether.dev/attempt-trace\0{run_uid}\0{attempt}\0{fence}".encode()).digest()
    trace_id = int.from_bytes(digest[:16], "big") or 1
    span_id = int.from_bytes(digest[16:24], "big") or 1
    # Sampled: an attempt is a handful of spans over its whole life, so it is always kept; each
    # worker's own sampler (parent-based by default) follows this flag.
    return TraceContext(trace_id, span_id, True)


def attempt_traceparent(run_uid: str, attempt: int, fence: int) -> str:
    return attempt_context(run_uid, attempt, fence).traceparent()


def parse_traceparent(value: str | None) -> TraceContext | None:
    """A `traceparent` value as W3C Trace Context level 1 reads it, or None when it is invalid
    (a worker then starts its spans as roots instead of failing: tracing never stops work)."""
    if not value:
        return None
    m = _TRACEPARENT.match(value.strip())
    if m is None:
        return None
    version, trace_hex, span_hex, flags_hex, rest = m.groups()
    if version == "ff" or (version == "00" and rest):
        return None  # "ff" is forbidden; version 00 has exactly four fields
    trace_id, span_id = int(trace_hex, 16), int(span_hex, 16)
    if trace_id == 0 or span_id == 0:
        return None
    return TraceContext(trace_id, span_id, bool(int(flags_hex, 16) & 1))
