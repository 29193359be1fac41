"""Skews this process's wall clock by $TETHER_TEST_CLOCK_SKEW_SECONDS (tests only).

Put this folder on PYTHONPATH of a worker pod. time.time() and datetime.now()
move; the monotonic clock does not, as with a host whose wall clock is off.
(Debian's libfaketime 0.9.10 was tried first: with FAKETIME_DONT_FAKE_MONOTONIC
Python's time.sleep fails with EINVAL, without it sleeps hang.)
"""

from __future__ import annotations

import datetime as _dt
import os
import time as _time

_skew = float(os.environ.get("TETHER_TEST_CLOCK_SKEW_SECONDS", "0"))

if _skew:
    _real_time, _real_time_ns = _time.time, _time.time_ns
    _time.time = lambda: _real_time() + _skew
    _time.time_ns = lambda: _real_time_ns() + int(_skew * 1e9)

    class _SkewedDatetime(_dt.datetime):
        @classmethod
        def now(cls, tz=None):  # type: ignore[no-untyped-def, override]
            return super().now(tz) + _dt.timedelta(seconds=_skew)

        @classmethod
        def utcnow(cls):  # type: ignore[no-untyped-def, override]
            return super().utcnow() + _dt.timedelta(seconds=_skew)

    _dt.datetime = _SkewedDatetime  # type: ignore[misc]
