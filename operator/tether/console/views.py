"""The console's HTML (pure): page shells, the runs table's rows, a run's page, budgets and the
review queue. Everything from the API is escaped; the browser's script only swaps fragments in."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Callable
from dataclasses import dataclass
from html import escape
from typing import Any
from urllib.parse import quote, urlencode

from tether.api.workerclass import effective_body
from tether.console import charts
from tether.console.actions import pending_requests
from tether.api.conditions import headline
from tether.console.details import (TERMINAL, attempts_table, lease_age, result_view, since, stuck_badge, what_starts,
                                    yaml_block)
from tether.console.state import Point
from tether.protocol import holder_renewed
from tether.schedules.api import ANN_SCHEDULED_AT, LABEL_SCHEDULE

LeaseOf = Callable[[dict[str, Any]], "dict[str, Any] | None"]  # a run's Lease, as the scope sees it

PHASES = ("Pending", "Queued", "AwaitingApproval", "AwaitingReview", "Starting", "Running", "Backoff", "Suspended",
          "Succeeded", "Failed", "Lost", "Cancelled", "BudgetExceeded", "DeadlineExceeded", "Rejected")
RESULT_CHARS = 2000  # of a result awaiting review, shown in its decision form


@dataclass(frozen=True)
class Filters:
    """The runs table's filters; empty means any."""

    namespace: str = ""
    phase: str = ""
    budget: str = ""

    @classmethod
    def of(cls, params: Any) -> "Filters":
        return cls(params.get("namespace", "").strip(), params.get("phase", "").strip(),
                   params.get("budget", "").strip())

    def matches(self, run: dict[str, Any]) -> bool:
        return ((not self.namespace or run["metadata"].get("namespace") == self.namespace)
                and (not self.phase or phase_of(run) == self.phase)
                and (not self.budget or budget_of(run) == self.budget))

    def query(self) -> str:
        return urlencode({k: v for k, v in (("namespace", self.namespace), ("phase", self.phase),
                                            ("budget", self.budget)) if v})


def phase_of(run: dict[str, Any]) -> str:
    return (run.get("status") or {}).get("phase") or "Pending"


def budget_of(run: dict[str, Any]) -> str:
    """Its WorkerBudget, its own or its class's."""
    spec = effective_body(run).get("spec") or {}
    return ((spec.get("budget") or {}).get("budgetRef") or {}).get("name") or ""


def run_href(base: str, run: dict[str, Any]) -> str:
    meta = run["metadata"]
    return f"{base}/runs/{quote(meta['namespace'])}/{quote(meta['name'])}"


def queue_of(run: dict[str, Any]) -> str:
    """Where a queued run waits or ran: its LocalQueue and the ClusterQueue behind it."""
    queue = (run.get("status") or {}).get("queue") or {}
    if not queue.get("name"):
        return ""
    return queue["name"] + (f" → {queue['clusterQueue']}" if queue.get("clusterQueue") else "")


def _no_lease(_: dict[str, Any]) -> dict[str, Any] | None:
    return None


def run_row(base: str, run: dict[str, Any], lease: dict[str, Any] | None = None) -> str:
    meta, status = run["metadata"], run.get("status") or {}
    usage = status.get("usage") or {}
    phase = phase_of(run)
    pending = len(pending_requests(run))
    key = f"{meta['namespace']}/{meta['name']}"
    return (f'<tr data-key="{escape(key)}" data-phase="{escape(phase)}">'
            f'<td>{escape(meta["namespace"])}</td>'
            f'<td><a href="{escape(run_href(base, run))}">{escape(meta["name"])}</a></td>'
            f'<td><span class="phase p-{escape(phase)}">{escape(phase)}</span>'
            f'{f" <span class=badge>{pending} awaiting</span>" if pending else ""}{stuck_badge(run)}</td>'
            f'<td class="num">{int(status.get("attempt") or 0)}</td><td class="num">{int(status.get("fence") or 0)}</td>'
            f'<td>{escape(status.get("holder") or "-")}</td>'
            f'<td class="lease">{lease_age(lease)}</td>'
            f'<td class="num">{int(usage.get("cents") or 0)}</td><td class="num">{int(usage.get("tokens") or 0)}</td>'
            f'<td>{escape(budget_of(run) or "-")}</td><td>{escape(queue_of(run) or "-")}</td></tr>')


def sorted_runs(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(runs, key=lambda r: (r["metadata"]["namespace"], r["metadata"]["name"]))


def _options(values: list[str], chosen: str, any_label: str) -> str:
    return f'<option value="">{any_label}</option>' + "".join(
        f'<option{" selected" if v == chosen else ""}>{escape(v)}</option>' for v in values)


def runs_page(base: str, runs: list[dict[str, Any]], f: Filters, scope: str | None,
              budgets: list[str], lease_of: LeaseOf = _no_lease) -> str:
    namespaces = sorted({r["metadata"]["namespace"] for r in runs} | ({f.namespace} if f.namespace else set()))
    # A namespaced console shows one namespace: its filter would choose among one.
    ns_filter = (f'<label>namespace <select name="namespace">{_options(namespaces, f.namespace, "all")}</select>'
                 f'</label>') if scope is None else ""
    rows = "".join(run_row(base, r, lease_of(r)) for r in sorted_runs(runs) if f.matches(r))
    return (f'<form id="filters" class="filters">{ns_filter}'
            f'<label>phase <select name="phase">{_options(list(PHASES), f.phase, "all")}</select></label>'
            f'<label>budget <select name="budget">{_options(sorted(set(budgets) | {f.budget} - {""}), f.budget, "all")}'
            f'</select></label></form>'
            '<table class="runs"><thead><tr><th>namespace</th><th>name</th><th>phase</th><th>attempt</th>'
            '<th>fence</th><th>holder</th><th>lease age</th><th>cents</th><th>tokens</th><th>budget</th>'
            '<th>queue</th></tr>'
            f'</thead><tbody id="rows">{rows}</tbody></table>'
            '<p id="empty" class="muted">no runs match</p>')


def decision_form(base: str, run: dict[str, Any], request: dict[str, Any]) -> str:
    """The one way to decide any gate (Start, Result or a worker's request), on every page."""
    meta = run["metadata"]
    gate, attempt = str(request.get("gate")), int(request.get("attempt") or 0)
    action = f"{base}/api/runs/{quote(meta['namespace'])}/{quote(meta['name'])}/decide"
    details = f'<p class="details">{escape(request["details"])}</p>' if request.get("details") else ""
    result = (run.get("status") or {}).get("result")
    if gate == "Result" and result is not None:  # what the reviewer accepts or denies
        shown = json.dumps(result, indent=1, sort_keys=True)
        details += f'<pre class="details">{escape(shown[:RESULT_CHARS])}{" …" if len(shown) > RESULT_CHARS else ""}</pre>'
    if gate == "Start":  # what the approver lets run
        details += what_starts(run)
    deadline = f' · deadline {since(request.get("deadline"))}' if request.get("deadline") else ""
    # The first submit button is what Enter in the reason "clicks": a disabled one makes Enter do
    # nothing, rather than Approve a run the reviewer was typing a denial for.
    return (f'<form class="decide" data-action="{escape(action)}" data-uid="{escape(meta["uid"])}" '
            f'data-gate="{escape(gate)}" data-attempt="{attempt}"><b>{escape(gate)}</b> · attempt {attempt} · '
            f'requested {since(request.get("requestedAt"))}{deadline}{details}'
            '<button type="submit" disabled hidden aria-hidden="true" tabindex="-1"></button>'
            '<input name="reason" placeholder="reason" required maxlength="4096">'
            '<button name="decision" value="Approve" class="approve">Approve</button>'
            '<button name="decision" value="Deny" class="deny">Deny</button></form>')


def _table(headers: list[str], rows: list[list[str]]) -> str:
    return ("<table><thead><tr>" + "".join(f"<th>{h}</th>" for h in headers) + "</tr></thead><tbody>"
            + "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows) + "</tbody></table>")


def children_of(run: dict[str, Any], runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The child runs of `run` (owned by its UID: a namesake's are not)."""
    meta = run["metadata"]
    return [c for c in runs if c["metadata"]["namespace"] == meta["namespace"] and "parentRef" in (c.get("spec") or {})
            and any(o.get("uid") == meta["uid"] for o in c["metadata"].get("ownerReferences") or [])]


def tree_fragment(base: str, run: dict[str, Any], children: list[dict[str, Any]]) -> str:
    """A run's place in its tree (docs/children.md): its parent, its ledger, and each child."""
    spec, status = run.get("spec") or {}, run.get("status") or {}
    ref, tree = spec.get("parentRef"), status.get("children") or {}
    out = []
    if ref:
        parent = {"metadata": {"namespace": run["metadata"]["namespace"], "name": ref["name"]}}
        out.append(f'<p id="parent">child of <a href="{escape(run_href(base, parent))}">{escape(ref["name"])}</a>, '
                   f'spawned by {escape(ref["holder"])} at fence {int(ref["fence"])}</p>')
    if tree or children:
        out.append(f'<p>{int(tree.get("admitted") or 0)} children admitted; they hold '
                   f'{int(tree.get("reservedCents") or 0)} cents and spent {int(tree.get("spentCents") or 0)} cents '
                   'of the tree</p>')
        rows = [[f'<a href="{escape(run_href(base, c))}">{escape(c["metadata"]["name"])}</a>',
                 escape((c["metadata"].get("annotations") or {}).get("tether.dev/child-key", "")),
                 escape(phase_of(c)), str(int(((c.get("status") or {}).get("usage") or {}).get("cents") or 0)),
                 escape(json.dumps((c.get("status") or {}).get("result"))[:120]
                        if (c.get("status") or {}).get("result") is not None else "")]
                for c in sorted(children, key=lambda c: str(c["metadata"].get("creationTimestamp", "")))]
        out.append(_table(["child", "key", "phase", "spent (cents)", "result"], rows) if rows else "")
    return "".join(out) or '<p class="muted">no parent, no children</p>'


def run_fragments(base: str, run: dict[str, Any] | None, series: list[Point], events: list[dict[str, Any]],
                  now: dt.datetime, lease: dict[str, Any] | None = None,
                  pods: list[dict[str, Any]] | None = None, children: list[dict[str, Any]] | None = None
                  ) -> dict[str, str]:
    """A run's page as fragments by element id, re-rendered whenever the run, its events, its
    Lease or its pods change."""
    if run is None:
        return {"summary": '<p class="error">this run does not exist (any more)</p>', "charts": "", "review": "",
                "conditions": "", "events": "", "controls": "", "attempts": "", "result": "", "spec": "",
                "tree": ""}
    meta, spec, status = run["metadata"], run.get("spec") or {}, run.get("status") or {}
    usage = status.get("usage") or {}
    phase = phase_of(run)
    why = headline(status)
    # Why it is where it is comes first (a refused pod, a missing budget), then what it holds.
    summary = ((f'<span class="why"><b>{escape(why[0])}</b>: {escape(why[1])}</span><br>' if why else "")
               + f'<span class="phase p-{escape(phase)}" id="phase">{escape(phase)}</span> attempt '
               f'{int(status.get("attempt") or 0)} · fence {int(status.get("fence") or 0)} · holder '
               f'{escape(status.get("holder") or "-")} · '
               + (f'lease renewed {lease_age(lease)} · ' if holder_renewed(lease) else
                  'lease never renewed · ' if lease_age(lease) != "-" else "")
               + f'{int(usage.get("cents") or 0)} cents, {int(usage.get("tokens") or 0)} tokens'
               + (f' · budget {escape(budget_of(run))}' if budget_of(run) else "")
               + (f' · queue {escape(queue_of(run))}' if queue_of(run) else "")
               + (f' · {int(status["preemptions"])} evicted by Kueue' if status.get("preemptions") else "")
               + (f' · checkpoint <code>{escape(str(status["checkpoint"].get("cursor")))}</code>'
                  if status.get("checkpoint") else "")
               + (' · <b>stop requested</b>' if spec.get("stop") else "")
               + (' · <b>suspended</b>' if spec.get("suspend") else ""))
    scale = charts.scale_for(run, series, now)
    chart = (charts.timeline_svg(charts.timeline(run, events, scale, now)) + f'<p class="legend">{charts.legend()}</p>'
             + "<h3>usage and checkpoints</h3>" + charts.usage_svg(charts.usage_points(run, series), scale, now))
    requests = pending_requests(run)
    feedback = (status.get("review") or {}).get("feedback")
    review = ("".join(decision_form(base, run, r) for r in requests) or '<p class="muted">nothing awaits a decision</p>')
    if feedback:
        review += f'<p>last result denied: {escape(feedback)}</p>'
    decided = [r for r in (status.get("review") or {}).get("requests") or [] if r.get("decision")]
    if decided:
        review += _table(["gate", "attempt", "decision", "by", "reason", "decided"],
                         [[escape(str(r.get("gate"))), str(int(r.get("attempt") or 0)), escape(r["decision"]),
                           escape(r.get("approver") or "-"), escape(r.get("reason") or ""),
                           escape(r.get("decidedAt") or "")] for r in decided])
    conditions = _table(["type", "status", "reason", "message", "since"],
                        [[escape(cd["type"]), escape(cd["status"]), escape(cd.get("reason", "")),
                          escape(cd.get("message") or ""), escape(cd.get("lastTransitionTime") or "")]
                         for cd in status.get("conditions") or []])
    ordered = sorted(events, key=lambda e: (charts.event_time(e) or now).timestamp(), reverse=True)
    event_rows = _table(["last seen", "type", "reason", "count", "message"],
                        [[escape(str(e.get("lastTimestamp") or e.get("eventTime") or "")), escape(e.get("type", "")),
                          escape(e.get("reason", "")), str(e.get("count") or 1), escape(e.get("message", ""))]
                         for e in ordered])
    path = f"{base}/api/runs/{quote(meta['namespace'])}/{quote(meta['name'])}"
    uid = f'data-uid="{escape(meta["uid"])}"'  # the run shown, not whichever has its name when clicked
    controls = "" if phase in TERMINAL else (
        f'<button data-post="{escape(path)}/stop" {uid} data-confirm="Stop {escape(meta["name"])}? It ends '
        f'Cancelled." class="deny">Stop</button>'
        + (f'<button data-post="{escape(path)}/resume" {uid}>Resume</button>' if spec.get("suspend")
           else f'<button data-post="{escape(path)}/suspend" {uid}>Suspend</button>'))
    return {"summary": summary, "charts": chart, "review": review, "conditions": conditions, "events": event_rows,
            "controls": controls, "attempts": attempts_table(base, run, pods or []), "result": result_view(run),
            "spec": yaml_block(spec), "tree": tree_fragment(base, run, children or [])}


def run_page(base: str, ns: str, name: str, fragments: dict[str, str]) -> str:
    return (f'<h2>{escape(ns)}/<b>{escape(name)}</b></h2><p id="summary">{fragments["summary"]}</p>'
            f'<div id="controls" class="controls">{fragments["controls"]}</div>'
            f'<h3>attempts</h3><div id="charts">{fragments["charts"]}</div>'
            f'<div id="attempts">{fragments["attempts"]}</div>'
            '<h3>logs</h3><p id="log-title" class="muted">a log button above shows that attempt\'s worker logs</p>'
            '<pre id="log-output" class="logs" hidden></pre>'
            f'<h3>result</h3><div id="result">{fragments["result"]}</div>'
            f'<h3>tree</h3><div id="tree">{fragments["tree"]}</div>'
            f'<h3>awaiting a decision</h3><div id="review">{fragments["review"]}</div>'
            f'<h3>conditions</h3><div id="conditions">{fragments["conditions"]}</div>'
            f'<h3>events</h3><div id="events">{fragments["events"]}</div>'
            f'<h3>spec and payload</h3><div id="spec">{fragments["spec"]}</div>')


def review_queue(runs: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Every pending request of every run, oldest first."""
    items = [(run, r) for run in runs for r in pending_requests(run)]
    return sorted(items, key=lambda item: (item[1].get("requestedAt") or "", item[0]["metadata"]["namespace"],
                                           item[0]["metadata"]["name"]))


def review_fragment(base: str, runs: list[dict[str, Any]]) -> str:
    items = review_queue(runs)
    if not items:
        return '<p class="muted">nothing awaits a decision</p>'
    return "".join(
        f'<div class="queue-item"><a href="{escape(run_href(base, run))}">{escape(run["metadata"]["namespace"])}/'
        f'{escape(run["metadata"]["name"])}</a> <span class="phase p-{escape(phase_of(run))}">'
        f'{escape(phase_of(run))}</span>{decision_form(base, run, r)}</div>' for run, r in items)


def _gauge(label: str, spent: int, limit: int | None) -> str:
    if limit is None:
        return f'<div class="gauge"><span>{label}: {spent} spent, no limit</span></div>'
    share = spent / limit if limit else 1.0
    level = "over" if share >= 1 else "high" if share >= 0.8 else "ok"
    return (f'<div class="gauge" data-share="{share:.3f}"><span>{label}: {spent} of {limit}</span>'
            f'<svg viewBox="0 0 300 14" class="meter"><rect width="300" height="14" rx="3" class="track"/>'
            f'<rect width="{min(share, 1) * 300:.1f}" height="14" rx="3" class="fill {level}"/></svg></div>')


def budgets_fragment(base: str, budgets: list[dict[str, Any]], runs: list[dict[str, Any]]) -> str:
    if not budgets:
        return '<p class="muted">no WorkerBudgets in this scope</p>'
    out = []
    for b in sorted(budgets, key=lambda b: (b["metadata"]["namespace"], b["metadata"]["name"])):
        meta, spec, status = b["metadata"], b.get("spec") or {}, b.get("status") or {}
        spent = status.get("spent") or {}
        exhausted = next((cd for cd in status.get("conditions") or [] if cd["type"] == "Exhausted"), None)
        charging = [r for r in sorted_runs(runs) if r["metadata"]["namespace"] == meta["namespace"]
                    and budget_of(r) == meta["name"]]
        rows = [[f'<a href="{escape(run_href(base, r))}">{escape(r["metadata"]["name"])}</a>', escape(phase_of(r)),
                 str(int(((r.get("status") or {}).get("usage") or {}).get("cents") or 0)),
                 str(int(((r.get("status") or {}).get("usage") or {}).get("tokens") or 0))] for r in charging]
        out.append(
            f'<section class="budget" data-budget="{escape(meta["namespace"])}/{escape(meta["name"])}">'
            f'<h3>{escape(meta["namespace"])}/<b>{escape(meta["name"])}</b> <span class="muted">period '
            f'{escape(spec.get("period", "None"))}, since {escape(status.get("periodStart") or "-")}</span>'
            + (' <span class="phase p-Failed">exhausted</span>' if exhausted and exhausted["status"] == "True" else "")
            + "</h3>"
            + _gauge("cents", int(spent.get("cents") or 0), spec.get("limitCents"))
            + _gauge("tokens", int(spent.get("tokens") or 0), spec.get("limitTokens"))
            + (_table(["run", "phase", "cents", "tokens"], rows) if rows else '<p class="muted">no runs charge it now</p>')
            + "</section>")
    return "".join(out)


def schedules_fragment(base: str, schedules: list[dict[str, Any]], runs: list[dict[str, Any]]) -> str:
    """Each WorkerRunSchedule: when it runs, its policy, its last and next slots, why it last skipped
    one, and its runs (newest first)."""
    if not schedules:
        return '<p class="muted">no WorkerRunSchedules in this scope</p>'
    out = []
    for sch in sorted(schedules, key=lambda x: (x["metadata"]["namespace"], x["metadata"]["name"])):
        meta, spec, status = sch["metadata"], sch.get("spec") or {}, sch.get("status") or {}
        mine = sorted((r for r in runs if r["metadata"]["namespace"] == meta["namespace"]
                       and (r["metadata"].get("labels") or {}).get(LABEL_SCHEDULE) == meta["name"]),
                      key=lambda r: r["metadata"]["name"], reverse=True)
        rows = [[f'<a href="{escape(run_href(base, r))}">{escape(r["metadata"]["name"])}</a>', escape(phase_of(r)),
                 escape((r["metadata"].get("annotations") or {}).get(ANN_SCHEDULED_AT, "manual start"))]
                for r in mine]
        skipped = status.get("lastSkipped") or {}
        when = " ".join(filter(None, [spec.get("schedule", ""), spec.get("timeZone", "")]))
        out.append(
            f'<section class="schedule" data-schedule="{escape(meta["namespace"])}/{escape(meta["name"])}">'
            f'<h3>{escape(meta["namespace"])}/<b>{escape(meta["name"])}</b> <span class="muted">{escape(when)}, '
            f'{escape(spec.get("concurrencyPolicy", "Allow"))}</span>'
            + (' <span class="phase p-Suspended">suspended</span>' if spec.get("suspend") else "") + "</h3>"
            f'<p>last <span class="last">{escape(status.get("lastScheduleTime") or "-")}</span> · next '
            f'<span class="next">{escape(status.get("nextScheduleTime") or "-")}</span>'
            + (f' · skipped {int(status.get("skippedCount") or 0)}, last: {escape(skipped.get("reason", ""))} '
               f'<span class="muted">{escape(skipped.get("message", ""))}</span>' if skipped else "") + "</p>"
            + (_table(["run", "phase", "slot"], rows) if rows else '<p class="muted">no runs yet</p>')
            + "</section>")
    return "".join(out)


def errors_fragment(errors: list[str]) -> str:
    return "".join(f'<p class="error">{escape(e)}</p>' for e in errors)


def shell(base: str, title: str, page: str, events_url: str, body: str, who: str, errors: list[str],
          logout: bool) -> str:
    nav = "".join(f'<a href="{base}{href}"{" class=here" if name == page else ""}>{label}</a>'
                  for name, href, label in (("runs", "/", "Runs"), ("schedules", "/schedules", "Schedules"),
                                            ("budgets", "/budgets", "Budgets"), ("review", "/review", "Review queue")))
    out = (f'<form method="post" action="{base}/logout" class="logout"><button>log out</button></form>'
           if logout else "")
    return ('<!doctype html><html lang="en"><head><meta charset="utf-8">'
            f'<title>{escape(title)} · Tether</title><meta name="viewport" content="width=device-width">'
            f'<link rel="stylesheet" href="{base}/static/console.css"></head>'
            f'<body data-page="{page}" data-events="{escape(events_url)}">'
            f'<header><h1>Tether</h1><nav>{nav}</nav><span class="who">{escape(who)}</span>{out}'
            '<span id="live" class="live" title="live updates">&#9679;</span></header>'
            f'<div id="errors">{errors_fragment(errors)}</div><p id="flash" role="status"></p>'
            f'<main>{body}</main><script src="{base}/static/console.js"></script></body></html>')


def login_page(base: str, error: str = "") -> str:
    return ('<!doctype html><html lang="en"><head><meta charset="utf-8"><title>Log in · Tether</title>'
            f'<link rel="stylesheet" href="{base}/static/console.css"></head><body class="login">'
            '<h1>Tether console</h1>'
            f'<form method="post" action="{base}/login"><p>Paste a Kubernetes bearer token: the console acts '
            'with it and nothing else (e.g. <code>kubectl create token NAME</code>).</p>'
            '<label>token <textarea name="token" rows="4" required autocomplete="off"></textarea></label>'
            '<label>namespace <input name="namespace" placeholder="empty: every namespace you may list"></label>'
            '<button>Log in</button>'
            + (f'<p class="error" id="login-error">{escape(error)}</p>' if error else "") + "</form></body></html>")
