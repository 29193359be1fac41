"""Inline SVG charts for a run (pure): the attempt timeline and its usage over time, on one time axis.

Each attempt is a bar from startedAt to endedAt (or now) on its own row, coloured by outcome;
marks show each ended attempt's revocation (the fence moves past the attempt's), lapses (a lost
lease) and what the API server refused or Tether rejected (stale results, refusals, foreign
Lease writes), from the run's Events.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from html import escape
from typing import Any

from tether.api import constants as c
from tether.protocol import parse_time
from tether.console.state import Point

OUTCOME_COLOURS = {
    "Succeeded": "#2e7d32", "WorkerFailed": "#c62828", "PodFailed": "#ad1457", "PodVanished": "#6a1b9a",
    "LeaseLost": "#ef6c00", "Stalled": "#8d6e63", "Cancelled": "#757575", "BudgetExceeded": "#f9a825",
    "DeadlineExceeded": "#4e342e", "ResultRejected": "#d81b60", "Preempted": "#00838f", "PodRefused": "#9e9d24",
}
RUNNING_COLOUR = "#1565c0"
# Event reasons marked on the timeline: a write refused as stale, a refusal by the API server, a Lease
# moved by someone else.
EVENT_MARKS = {c.EV_RESULT_REJECTED: "stale result", c.EV_STALLED: "refused", c.EV_POD_REFUSED: "refused",
               c.REASON_LEASE_TAMPERED: "tampered"}

WIDTH, LEFT, RIGHT, ROW, TOP, AXIS = 760.0, 90.0, 20.0, 22.0, 8.0, 26.0


@dataclass(frozen=True)
class Scale:
    """Seconds since the epoch onto x pixels, the same for every chart of a run."""

    t0: float
    t1: float

    def x(self, t: float) -> float:
        return LEFT + (t - self.t0) / (self.t1 - self.t0) * (WIDTH - LEFT - RIGHT)


@dataclass(frozen=True)
class Bar:
    attempt: int
    fence: int
    outcome: str  # "Running" while open
    x: float
    width: float
    y: float
    title: str


@dataclass(frozen=True)
class Mark:
    kind: str  # revoked | lapse | stale result | refused | tampered
    x: float
    y: float
    title: str


@dataclass(frozen=True)
class Timeline:
    scale: Scale
    bars: list[Bar]
    marks: list[Mark]
    height: float


def event_time(event: dict[str, Any]) -> dt.datetime | None:
    return parse_time(event.get("lastTimestamp") or event.get("eventTime") or event.get("firstTimestamp")
                      or event["metadata"].get("creationTimestamp"))


def scale_for(run: dict[str, Any], series: list[Point], now: dt.datetime) -> Scale:
    """From the run's creation (or its first attempt, or first observation) to now or its end."""
    status = run.get("status") or {}
    starts = [t.timestamp() for t in (parse_time(run["metadata"].get("creationTimestamp")),
                                      *(parse_time(a.get("startedAt")) for a in status.get("attempts") or []))
              if t is not None]
    starts += [p.time for p in series[:1]]
    finished = parse_time(status.get("finishedAt"))
    t1 = (finished or now).timestamp()
    ends = [t.timestamp() for a in status.get("attempts") or [] if (t := parse_time(a.get("endedAt")))]
    t1 = max([t1, *ends])
    t0 = min(starts) if starts else t1 - 60
    return Scale(t0, max(t1, t0 + 1.0))


def timeline(run: dict[str, Any], events: list[dict[str, Any]], scale: Scale, now: dt.datetime) -> Timeline:
    attempts = (run.get("status") or {}).get("attempts") or []
    bars: list[Bar] = []
    marks: list[Mark] = []
    for row, a in enumerate(attempts):
        start, end = parse_time(a.get("startedAt")), parse_time(a.get("endedAt"))
        if start is None:
            continue
        x0, x1 = scale.x(start.timestamp()), scale.x((end or now).timestamp())
        y = TOP + row * ROW
        outcome = a.get("outcome") or ("Ended" if end else "Running")
        title = (f"attempt {a['attempt']} (fence {a['fence']}, {a.get('holder') or '-'}): {outcome}"
                 + (f", exit code {a['exitCode']}" if a.get("exitCode") is not None else "")
                 + (f" - {a['message']}" if a.get("message") else ""))
        bars.append(Bar(a["attempt"], a["fence"], outcome, x0, max(x1 - x0, 2.0), y, title))
        if end is not None:
            # Every ended attempt was revoked: the fence moved past the attempt's before anything else.
            marks.append(Mark("revoked", x1, y, f"attempt {a['attempt']} revoked: fence {a['fence']} -> "
                                                f"{a['fence'] + 1}"))
            if a.get("outcome") == "LeaseLost":
                marks.append(Mark("lapse", x1, y, f"attempt {a['attempt']}: the lease lapsed"
                                                  + (f" ({a['message']})" if a.get("message") else "")))
            elif a.get("outcome") == "Preempted":
                queue = (a.get("admission") or {}).get("clusterQueue")
                marks.append(Mark("evicted", x1, y, f"attempt {a['attempt']} evicted by Kueue"
                                                    + (f" from ClusterQueue {queue}" if queue else "")
                                                    + (f": {a['message']}" if a.get("message") else "")))
    events_row = TOP + max(len(attempts), 1) * ROW
    for event in events:
        kind, at = EVENT_MARKS.get(event.get("reason", "")), event_time(event)
        if kind is None or at is None:
            continue
        count = event.get("count") or 1
        marks.append(Mark(kind, scale.x(min(max(at.timestamp(), scale.t0), scale.t1)), events_row,
                          f"{event['reason']}{f' x{count}' if count > 1 else ''}: {event.get('message', '')}"))
    return Timeline(scale, bars, marks, events_row + ROW + AXIS)


def _ticks(scale: Scale, y: float) -> str:
    out = []
    for i in range(5):
        t = scale.t0 + (scale.t1 - scale.t0) * i / 4
        label = dt.datetime.fromtimestamp(t, dt.timezone.utc).strftime("%H:%M:%S")
        x = scale.x(t)
        out.append(f'<line class="tick" x1="{x:.1f}" x2="{x:.1f}" y1="0" y2="{y:.1f}"/>'
                   f'<text class="axis" x="{x:.1f}" y="{y + 14:.1f}" text-anchor="{"end" if i == 4 else "middle"}">'
                   f'{label}</text>')
    return "".join(out)


MARK_SHAPES = {
    "revoked": lambda x, y: f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{y - 2:.1f}" y2="{y + ROW - 2:.1f}"/>',
    "lapse": lambda x, y: f'<path d="M{x:.1f} {y - 3:.1f} l6 8 l-6 8 l-6 -8 z"/>',  # a diamond on the bar's end
    "evicted": lambda x, y: f'<path d="M{x - 6:.1f} {y - 2:.1f} l12 0 l-6 10 z"/>',  # a triangle pointing down
}


def _mark(m: Mark) -> str:
    shape = MARK_SHAPES.get(m.kind, lambda x, y: f'<circle cx="{x:.1f}" cy="{y + ROW / 2 - 2:.1f}" r="5"/>')
    return f'<g class="mark" data-kind="{escape(m.kind)}"><title>{escape(m.title)}</title>{shape(m.x, m.y)}</g>'


def timeline_svg(t: Timeline) -> str:
    axis_y = t.height - AXIS
    parts = [f'<svg class="timeline" viewBox="0 0 {WIDTH:.0f} {t.height:.0f}" role="img" '
             f'aria-label="attempt timeline">', _ticks(t.scale, axis_y)]
    for b in t.bars:
        colour = OUTCOME_COLOURS.get(b.outcome, RUNNING_COLOUR)
        parts.append(f'<g class="bar"><title>{escape(b.title)}</title>'
                     f'<text class="label" x="{LEFT - 6:.0f}" y="{b.y + 13:.1f}" text-anchor="end">'
                     f'#{b.attempt} f{b.fence}</text>'
                     f'<rect data-attempt="{b.attempt}" data-outcome="{escape(b.outcome)}" x="{b.x:.1f}" '
                     f'y="{b.y:.1f}" width="{b.width:.1f}" height="{ROW - 6:.0f}" rx="3" fill="{colour}"/></g>')
    parts.append(f'<text class="label" x="{LEFT - 6:.0f}" y="{axis_y - ROW + 13:.1f}" text-anchor="end">events</text>')
    parts += [_mark(m) for m in t.marks]
    parts.append("</svg>")
    return "".join(parts)


def legend() -> str:
    items = [*OUTCOME_COLOURS.items(), ("Running", RUNNING_COLOUR)]
    # A swatch is drawn, not styled: the pages allow no inline style (Content-Security-Policy).
    return "".join(f'<span class="key"><svg class="swatch" viewBox="0 0 10 10"><rect width="10" height="10" rx="2" '
                   f'fill="{colour}"/></svg>{name}</span>' for name, colour in items) + (
        '<span class="key">&#9474; revoked (fence bump) &#9670; lapse &#9660; evicted by Kueue &#9679; event</span>')


def usage_points(run: dict[str, Any], series: list[Point]) -> list[Point]:
    """The watch's observations plus what the attempt records hold, in time order: each attempt
    starts at the total before it and ends at the total with its own usage (attempts add up to the
    run's usage, with what attempts no longer listed spent: status.trimmedUsage). An ended attempt
    the watch saw nothing of (the run ended before the console opened) is drawn as a straight line
    from its start to its end: the spend in between was never observed."""
    points = list(series)
    status = run.get("status") or {}
    trimmed = status.get("trimmedUsage") or {}
    cents, tokens = int(trimmed.get("cents") or 0), int(trimmed.get("tokens") or 0)
    for a in status.get("attempts") or []:
        start, end = parse_time(a.get("startedAt")), parse_time(a.get("endedAt"))
        if start is not None:
            points.append(Point(start.timestamp(), cents, tokens, None))
        usage = a.get("usage") or {}
        cents, tokens = cents + int(usage.get("cents") or 0), tokens + int(usage.get("tokens") or 0)
        if end is not None:
            unseen = start is not None and not any(start.timestamp() < p.time < end.timestamp() for p in series)
            points.append(Point(end.timestamp(), cents, tokens, None, ramp=unseen))
    return sorted(points, key=lambda p: p.time)


def usage_svg(points: list[Point], scale: Scale, now: dt.datetime) -> str:
    """Cents and tokens so far as two step lines (each on its own vertical scale), checkpoints as ticks."""
    height, plot = 120.0, 80.0
    parts = [f'<svg class="usage" viewBox="0 0 {WIDTH:.0f} {height:.0f}" role="img" aria-label="usage over time">',
             _ticks(scale, plot + 8)]
    if not points:
        parts.append(f'<text class="axis" x="{LEFT:.0f}" y="40">no usage observed yet</text></svg>')
        return "".join(parts)
    for metric, css in (("cents", "cents"), ("tokens", "tokens")):
        top = max(getattr(p, metric) for p in points) or 1
        coords: list[str] = []
        for p in points:
            x, y = scale.x(min(max(p.time, scale.t0), scale.t1)), 8 + plot - getattr(p, metric) / top * plot
            if coords and not p.ramp:
                coords.append(f"{x:.1f},{coords[-1].split(',')[1]}")  # a step: the value held until now
            coords.append(f"{x:.1f},{y:.1f}")
        coords.append(f"{scale.x(min(now.timestamp(), scale.t1)):.1f},{coords[-1].split(',')[1]}")
        parts.append(f'<polyline class="{css}" points="{" ".join(coords)}"><title>{metric}: up to {top}</title>'
                     f'</polyline>')
    last_cursor: str | None = None
    for p in points:
        if p.cursor is not None and p.cursor != last_cursor:
            x = scale.x(min(max(p.time, scale.t0), scale.t1))
            parts.append(f'<g class="checkpoint"><title>checkpoint {escape(p.cursor)}</title>'
                         f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{plot + 2:.1f}" y2="{plot + 8:.1f}"/></g>')
            last_cursor = p.cursor
    final = points[-1]
    parts.append(f'<text class="axis" x="4" y="20">{final.cents} cents</text>'
                 f'<text class="axis tokens-label" x="4" y="36">{final.tokens} tokens</text></svg>')
    return "".join(parts)
