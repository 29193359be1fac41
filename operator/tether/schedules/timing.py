"""When a WorkerRunSchedule's slots fall: pure arithmetic on instants, no clock of its own.

A cron expression is read by cronsim, which keeps Debian cron's rules in a time zone: a slot in the
hour a spring-forward skips runs at the jump, and a slot in the hour a fall-back repeats runs once.
Macros (`@hourly` ...) are the usual five fields; `@every <duration>` slots are the multiples of the
duration since the Unix epoch, so that each slot is one instant whoever computes it.
"""

from __future__ import annotations

import datetime as dt
import math
import re
from dataclasses import dataclass
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from cronsim import CronSim, CronSimError

UTC = dt.timezone.utc
MACROS = {
    "@yearly": "0 0 1 1 *", "@annually": "0 0 1 1 *", "@monthly": "0 0 1 * *", "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *", "@midnight": "0 0 * * *", "@hourly": "0 * * * *",
}
_UNITS = {"h": 3600, "m": 60, "s": 1}
_DURATION = re.compile(r"^(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?$")
# Fewer would make a slot per pass of a busy operator; more than a leap year is what @yearly is for.
MIN_EVERY_SECONDS = 5
MAX_EVERY_SECONDS = 366 * 86400
# How far `after` looks for a slot later than an instant it was handed in a repeated hour (cronsim
# reads a local time without its fold, so the first answer there may lie before the instant).
_PAST_FOLD = 1000


class ScheduleError(ValueError):
    """A schedule or time zone that does not parse: the message says what to fix."""


@dataclass(frozen=True)
class Due:
    """The slots in (after, now]: the latest of them, and how many there are (counted up to `limit`)."""

    latest: dt.datetime | None
    count: int
    more: bool  # more than counted


@dataclass(frozen=True)
class Timing:
    cron: str | None  # five fields (a macro expanded), or None for @every
    every: int | None  # seconds
    zone: dt.tzinfo

    @classmethod
    def parse(cls, schedule: str, time_zone: str | None = None) -> Timing:
        text = " ".join(schedule.split())
        zone = _zone(time_zone)
        if text.startswith("@every"):
            return cls(None, _every(text[len("@every"):].strip()), zone)
        cron = MACROS.get(text.lower(), text)
        if cron.startswith("@"):
            raise ScheduleError(f"schedule {schedule!r}: unknown macro (use one of {', '.join(MACROS)} or @every 10m)")
        try:
            CronSim(cron, dt.datetime(2000, 1, 1, tzinfo=zone))
        except CronSimError as exc:
            raise ScheduleError(f"schedule {schedule!r}: {exc} (five fields: minute hour day-of-month month "
                                "day-of-week)") from exc
        return cls(cron, None, zone)

    def after(self, t: dt.datetime) -> dt.datetime:
        """The first slot strictly after `t`."""
        if self.every is not None:
            return _epoch((math.floor(t.timestamp() / self.every) + 1) * self.every)
        assert self.cron is not None
        slots = CronSim(self.cron, t.astimezone(self.zone))
        for _ in range(_PAST_FOLD):
            slot = next(slots).astimezone(UTC)
            if slot > t:
                return slot
        raise ScheduleError(f"no slot of {self.cron!r} after {t.isoformat()}")

    def at_or_before(self, t: dt.datetime) -> dt.datetime | None:
        """The latest slot not after `t` (None: there is none, as for a date that never comes again)."""
        if self.every is not None:
            return _epoch(math.floor(t.timestamp() / self.every) * self.every)
        assert self.cron is not None
        # cronsim's reverse iteration is strictly before its start: from the second after t's whole
        # second, a slot at t itself counts and one later in t's second does not.
        start = (t.replace(microsecond=0) + dt.timedelta(seconds=1)).astimezone(self.zone)
        try:
            return next(CronSim(self.cron, start, reverse=True)).astimezone(UTC)
        except StopIteration:
            return None

    def due(self, after: dt.datetime, now: dt.datetime, limit: int = 100) -> Due:
        """The slots in (after, now]. A clock that went back (now before after) has none due."""
        if now <= after:
            return Due(None, 0, False)
        latest = self.at_or_before(now)
        if latest is None or latest <= after:
            return Due(None, 0, False)
        if self.every is not None:  # counted exactly, whatever the limit
            count = math.floor(now.timestamp() / self.every) - math.floor(after.timestamp() / self.every)
            return Due(latest, count, False)
        count, t = 0, after
        while count < limit:
            t = self.after(t)
            if t > now:
                return Due(latest, count, False)
            count += 1
        return Due(latest, count, self.after(t) <= now)


def _zone(name: str | None) -> dt.tzinfo:
    if not name or name == "UTC":
        return UTC
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError, OSError) as exc:  # OSError: a folder of zones (America)
        raise ScheduleError(f"timeZone {name!r} is not a time zone of the IANA database (for example "
                            "Europe/Berlin or America/New_York)") from exc


def _every(text: str) -> int:
    match = _DURATION.match(text)
    if not text or match is None:
        raise ScheduleError(f"@every {text!r}: a duration such as 30s, 10m or 1h30m")
    seconds = sum(int(v) * _UNITS[u] for v, u in zip(match.groups(), "hms") if v)
    if not MIN_EVERY_SECONDS <= seconds <= MAX_EVERY_SECONDS:
        raise ScheduleError(f"@every {text}: from {MIN_EVERY_SECONDS}s to {MAX_EVERY_SECONDS // 86400} days between slots")
    return seconds


def _epoch(seconds: float) -> dt.datetime:
    return dt.datetime.fromtimestamp(seconds, UTC)
