"""Saturating wall-clock arithmetic for the core.

The CRD admits deadlines and TTLs of years; a datetime computed past the calendar's end would
raise OverflowError and fail every decision for the run, so sums saturate instead.
"""

from __future__ import annotations

import datetime as dt

# The last instant a datetime can hold. Timestamps computed past it saturate here (meaning
# "never") instead of raising OverflowError.
END_OF_TIME = dt.datetime.max.replace(tzinfo=dt.timezone.utc)


def after(t: dt.datetime, seconds: float) -> dt.datetime:
    """t + seconds, saturating at END_OF_TIME."""
    if seconds >= (END_OF_TIME - t).total_seconds():
        return END_OF_TIME
    return t + dt.timedelta(seconds=seconds)
