"""A schedule's slots, by tables on given instants: cron fields, macros, @every, time zones across
daylight-saving transitions (the hour that does not exist, the one that happens twice), month ends,
downtime, and a clock that goes back."""

from __future__ import annotations

import datetime as dt

import pytest

from tether.schedules.timing import Due, ScheduleError, Timing

U = dt.timezone.utc


def z(*a: int) -> dt.datetime:
    return dt.datetime(*a, tzinfo=U)


def slots(timing: Timing, start: dt.datetime, n: int) -> list[dt.datetime]:
    out = []
    for _ in range(n):
        start = timing.after(start)
        out.append(start)
    return out


@pytest.mark.parametrize("schedule, zone, start, expected", [
    # Plain fields; `after` is strictly after, so a slot at the start itself is not the next one.
    ("*/15 * * * *", None, z(2026, 1, 1, 0, 0), [z(2026, 1, 1, 0, 15), z(2026, 1, 1, 0, 30)]),
    ("@hourly", "UTC", z(2026, 1, 1, 0, 59, 59), [z(2026, 1, 1, 1), z(2026, 1, 1, 2)]),
    ("@daily", None, z(2026, 1, 1, 12), [z(2026, 1, 2), z(2026, 1, 3)]),
    ("@weekly", None, z(2026, 12, 7), [z(2026, 12, 13), z(2026, 12, 20)]),  # Sundays
    ("@monthly", None, z(2026, 1, 15), [z(2026, 2, 1), z(2026, 3, 1)]),
    ("@yearly", None, z(2026, 6, 1), [z(2027, 1, 1), z(2028, 1, 1)]),
    # Month ends: the 31st only in months that have one; the 29th of February only in leap years.
    ("0 0 31 * *", None, z(2026, 1, 31, 1), [z(2026, 3, 31), z(2026, 5, 31), z(2026, 7, 31)]),
    ("0 0 29 2 *", None, z(2026, 1, 1), [z(2028, 2, 29), z(2032, 2, 29)]),
    ("0 12 * * MON-FRI", None, z(2026, 12, 4, 13), [z(2026, 12, 7, 12), z(2026, 12, 8, 12)]),  # Fri -> Mon
    # Spring forward in Berlin (2026-03-29, 02:00 -> 03:00 local): 02:30 does not exist that day;
    # the slot runs at the jump (03:00 CEST = 01:00Z), and at 02:30 again the day after.
    ("30 2 * * *", "Europe/Berlin", z(2026, 3, 28, 12), [z(2026, 3, 29, 1), z(2026, 3, 30, 0, 30)]),
    # Fall back in Berlin (2026-10-25, 03:00 -> 02:00 local): 02:30 happens twice, the slot once.
    ("30 2 * * *", "Europe/Berlin", z(2026, 10, 24, 12), [z(2026, 10, 25, 0, 30), z(2026, 10, 26, 1, 30)]),
    # ... while an hourly schedule runs every real hour through it (both 02:00s).
    ("0 * * * *", "Europe/Berlin", z(2026, 10, 24, 23, 30),
     [z(2026, 10, 25, 0), z(2026, 10, 25, 1), z(2026, 10, 25, 2)]),
    # New York's spring forward (2026-03-08): 02:30 EST does not exist; 03:00 EDT is 07:00Z.
    ("30 2 * * *", "America/New_York", z(2026, 3, 7, 12), [z(2026, 3, 8, 7), z(2026, 3, 9, 6, 30)]),
    # @every: multiples of the period since the epoch, whatever the time zone.
    ("@every 10m", "Asia/Kolkata", z(2026, 1, 1, 0, 3), [z(2026, 1, 1, 0, 10), z(2026, 1, 1, 0, 20)]),
    ("@every 1h30m", None, z(2026, 1, 1, 0, 0), [z(2026, 1, 1, 1, 30), z(2026, 1, 1, 3, 0)]),
])
def test_the_next_slots(schedule: str, zone: str | None, start: dt.datetime, expected: list[dt.datetime]) -> None:
    assert slots(Timing.parse(schedule, zone), start, len(expected)) == expected


@pytest.mark.parametrize("schedule, after, now, expected", [
    # Nothing due yet; the slot at now itself is due.
    ("*/5 * * * *", z(2026, 1, 1, 0, 0), z(2026, 1, 1, 0, 4, 59), Due(None, 0, False)),
    ("*/5 * * * *", z(2026, 1, 1, 0, 0), z(2026, 1, 1, 0, 5), Due(z(2026, 1, 1, 0, 5), 1, False)),
    # An hour of downtime: twelve slots missed, the latest named.
    ("*/5 * * * *", z(2026, 1, 1, 0, 0), z(2026, 1, 1, 1, 2), Due(z(2026, 1, 1, 1, 0), 12, False)),
    ("@every 10m", z(2026, 1, 1, 0, 0), z(2026, 1, 1, 1, 0), Due(z(2026, 1, 1, 1, 0), 6, False)),
    # A day of downtime on a per-minute schedule: counted up to the limit, the latest still exact.
    ("* * * * *", z(2026, 1, 1), z(2026, 1, 2, 0, 0, 30), Due(z(2026, 1, 2), 100, True)),
    ("@every 5s", z(2026, 1, 1), z(2026, 1, 2), Due(z(2026, 1, 2), 17280, False)),  # exact, whatever the limit
    # The clock went back behind the last slot handled: nothing is due again.
    ("*/5 * * * *", z(2026, 1, 1, 1, 0), z(2026, 1, 1, 0, 30), Due(None, 0, False)),
    ("@every 10m", z(2026, 1, 1, 1, 0), z(2026, 1, 1, 0, 30), Due(None, 0, False)),
])
def test_what_is_due(schedule: str, after: dt.datetime, now: dt.datetime, expected: Due) -> None:
    assert Timing.parse(schedule).due(after, now) == expected


def test_the_latest_slot_at_or_before_an_instant() -> None:
    t = Timing.parse("0 0 29 2 *")
    assert t.at_or_before(z(2026, 1, 1)) == z(2024, 2, 29)
    assert t.at_or_before(z(2028, 2, 29)) == z(2028, 2, 29)  # at the instant itself
    assert Timing.parse("30 2 * * *", "Europe/Berlin").at_or_before(z(2026, 3, 29, 1, 30)) == z(2026, 3, 29, 1)


@pytest.mark.parametrize("schedule, zone, message", [
    ("* * * *", None, "five fields"),
    ("61 * * * *", None, "five fields"),
    ("@fortnightly", None, "unknown macro"),
    ("@every 2s", None, "from 5s to 366 days"),
    ("@every 999999999h", None, "from 5s to 366 days"),
    ("0 * * * *", "America", "IANA"),  # a folder of the zone database, not a zone
    ("@every soon", None, "a duration such as"),
    ("@every", None, "a duration such as"),
    ("0 * * * *", "Mars/Olympus", "IANA"),
    ("0 * * * *", "../etc/passwd", "IANA"),
])
def test_what_does_not_parse_says_what_to_fix(schedule: str, zone: str | None, message: str) -> None:
    with pytest.raises(ScheduleError, match=message):
        Timing.parse(schedule, zone)


def test_in_the_repeated_hour_the_next_slot_is_never_in_the_past() -> None:
    """Berlin falls back on 2024-10-27 (03:00 CEST -> 02:00 CET): from inside the second 02:xx, the
    next 02:30 is the next day's, never the 02:30 already passed (cronsim reads no fold)."""
    t = Timing.parse("30 2 * * *", "Europe/Berlin")
    for now in (z(2024, 10, 27, 1, 10), z(2024, 10, 27, 1, 29), z(2024, 10, 27, 1, 45)):
        assert t.after(now) == z(2024, 10, 28, 1, 30)
    twice = Timing.parse("15,45 2 * * *", "America/New_York")  # New York falls back on 2024-11-03
    now = z(2024, 11, 3, 6, 20)  # 01:20 EST, the repeated hour's second pass
    assert twice.after(now) > now


def test_a_slot_later_in_the_same_second_is_not_due_yet() -> None:
    t = Timing.parse("*/5 * * * *")
    assert t.at_or_before(z(2026, 1, 1, 0, 4, 59).replace(microsecond=500000)) == z(2026, 1, 1, 0, 0)
    assert t.at_or_before(z(2026, 1, 1, 0, 5, 0).replace(microsecond=500000)) == z(2026, 1, 1, 0, 5)
