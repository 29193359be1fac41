"""What the console shows of a run beyond its timeline (pure HTML, everything escaped): liveness
from its Lease, why it is stuck, its attempts with exit codes and log buttons, its result and spec
as YAML, and what a start gate asks to approve."""

from __future__ import annotations

from html import escape
from typing import Any
from urllib.parse import quote, urlencode

import yaml

from tether.api.workerclass import effective_body
from tether.api.constants import COND_ADMITTED, COND_READY, COND_STALLED, EV_POD_REFUSED, LABEL_ATTEMPT
from tether.protocol import holder_renewed

TERMINAL = frozenset({"Succeeded", "Failed", "Lost", "Cancelled", "BudgetExceeded", "DeadlineExceeded", "Rejected"})
YAML_CHARS = 20_000  # of a spec or result shown whole: a page stays a page


def since(ts: str | None) -> str:
    """A cell the browser's clock ticks (data-since): a lease's age changes every second without
    the run changing."""
    return f'<span data-since="{escape(ts)}">{escape(ts)}</span>' if ts else "-"


def lease_age(lease: dict[str, Any] | None) -> str:
    """How long ago the holder renewed, ticking; "never renewed" for a holder that has not (yet)."""
    renewed = holder_renewed(lease)
    if renewed is None:
        return "never renewed" if ((lease or {}).get("spec") or {}).get("holderIdentity") else "-"
    return f'<span class="lease-age" data-since="{escape(renewed)}">{escape(renewed)}</span>'


def _phase(run: dict[str, Any]) -> str:
    return (run.get("status") or {}).get("phase") or "Pending"


def stuck(run: dict[str, Any]) -> tuple[str, str] | None:
    """(badge, why) for a run that will not move on by itself: Stalled=True, its attempts' pods
    refused (it retries, but the same template is refused again), or waiting on a WorkerBudget
    that does not exist."""
    if _phase(run) in TERMINAL:
        return None
    for cd in (run.get("status") or {}).get("conditions") or []:
        why = f'{cd.get("reason", "")}: {cd.get("message") or ""}'
        if cd.get("type") == COND_STALLED and cd.get("status") == "True":
            return "stalled", why
        if cd.get("type") == COND_READY and cd.get("reason") == EV_POD_REFUSED:
            return "pod refused", why
        if cd.get("type") == COND_ADMITTED and cd.get("status") == "False" and cd.get("reason") == "BudgetNotFound":
            return "no budget", why
    return None


def stuck_badge(run: dict[str, Any]) -> str:
    found = stuck(run)
    return f' <span class="badge stuck" title="{escape(found[1])}">{escape(found[0])}</span>' if found else ""


def yaml_block(value: Any) -> str:
    text = yaml.safe_dump(value, sort_keys=False, default_flow_style=False, allow_unicode=True)
    cut = f"\n… ({len(text) - YAML_CHARS} more characters)" if len(text) > YAML_CHARS else ""
    return f'<pre class="yaml">{escape(text[:YAML_CHARS] + cut)}</pre>'


def _exit_codes(pod: dict[str, Any] | None) -> str:
    """While the pod exists: how each of its containers ended (name: code when it has several)."""
    ended = [(cs.get("name", ""), cs["state"]["terminated"].get("exitCode"))
             for cs in ((pod or {}).get("status") or {}).get("containerStatuses") or []
             if ((cs.get("state") or {}).get("terminated") or {}).get("exitCode") is not None]
    if len(ended) == 1:
        return str(ended[0][1])
    return ", ".join(f"{name}: {code}" for name, code in ended)


def attempt_pod(pods: list[dict[str, Any]], record: dict[str, Any]) -> dict[str, Any] | None:
    """The attempt's pod while it exists: named in its record, or else labelled with its attempt."""
    name, attempt = record.get("pod"), str(record.get("attempt"))
    return next((p for p in pods if p["metadata"]["name"] == name), None) if name else next(
        (p for p in pods if (p["metadata"].get("labels") or {}).get(LABEL_ATTEMPT) == attempt), None)


def logs_url(base: str, run: dict[str, Any], attempt: int) -> str:
    meta = run["metadata"]
    return f"{base}/api/runs/{quote(meta['namespace'])}/{quote(meta['name'])}/logs?{urlencode({'attempt': attempt})}"


def attempts_table(base: str, run: dict[str, Any], pods: list[dict[str, Any]]) -> str:
    records = (run.get("status") or {}).get("attempts") or []
    if not records:
        return '<p class="muted">no attempt yet</p>'
    external = (run.get("spec") or {}).get("executor") == "External"
    rows = []
    for r in reversed(records):
        pod = attempt_pod(pods, r)
        code = r.get("exitCode")
        shown = str(code) if code is not None else _exit_codes(pod) or "-"
        logs = "" if external or not (r.get("pod") or pod) else \
            f'<button data-logs="{escape(logs_url(base, run, int(r.get("attempt") or 0)))}">logs</button>'
        rows.append(f'<tr data-attempt="{int(r.get("attempt") or 0)}"><td class="num">{int(r.get("attempt") or 0)}</td>'
                    f'<td class="num">{int(r.get("fence") or 0)}</td><td>{escape(r.get("holder") or "-")}</td>'
                    f'<td>{escape(r.get("pod") or "-")}</td><td>{since(r.get("startedAt"))}</td>'
                    f'<td>{since(r.get("endedAt")) if r.get("endedAt") else "running"}</td>'
                    f'<td>{escape(r.get("outcome") or "-")}</td><td class="num exit-code">{escape(shown)}</td>'
                    f'<td>{escape(r.get("message") or "")}</td><td>{logs}</td></tr>')
    return ('<table class="attempts"><thead><tr><th>attempt</th><th>fence</th><th>holder</th><th>pod</th>'
            '<th>started</th><th>ended</th><th>outcome</th><th>exit code</th><th>message</th><th></th></tr></thead>'
            f'<tbody>{"".join(rows)}</tbody></table>')


def result_view(run: dict[str, Any]) -> str:
    status = run.get("status") or {}
    out = ""
    if status.get("result") is not None:
        out += yaml_block(status["result"])
    if status.get("error"):
        out += f'<p class="error">error: {yaml_block(status["error"])}</p>'
    return out or '<p class="muted">no result yet</p>'


def duration(seconds: int) -> str:
    """Seconds the way people say them (the console's script says ages the same way): 90s, 59m, 3h, 2d."""
    return f"{seconds}s" if seconds < 120 else f"{round(seconds / 60)}m" if seconds < 7200 else \
        f"{round(seconds / 3600)}h" if seconds < 172800 else f"{round(seconds / 86400)}d"


def images(run: dict[str, Any]) -> list[str]:
    template = (run.get("spec") or {}).get("template") or {}
    return [str(c.get("image", "?")) for c in (template.get("spec") or {}).get("containers") or []]


def what_starts(run: dict[str, Any]) -> str:
    """A start gate's details: what the approver lets run (its image, payload, caps and budget, its
    class's included: the gate is asked for once they are recorded)."""
    spec = effective_body(run).get("spec") or {}
    budget = spec.get("budget") or {}
    limits = ["" if budget else "no cap or budget",
              f"cap {budget['capCents']} cents" if budget.get("capCents") is not None else "",
              f"at most {budget['maxTokens']} tokens" if budget.get("maxTokens") is not None else "",
              f"budget {(budget.get('budgetRef') or {}).get('name')}" if budget.get("budgetRef") else "",
              f"deadline {duration(int(spec['deadlineSeconds']))}" if spec.get("deadlineSeconds") is not None else "",
              f"up to {(spec.get('retry') or {}).get('maxAttempts', 3)} attempts"]
    runs = ", ".join(images(run)) or f"an {spec.get('executor', 'Pod')} worker"
    return (f'<div class="starts"><p>runs <code class="image">{escape(runs)}</code> · '
            f'<span class="limits">{escape(" · ".join(x for x in limits if x))}</span></p>'
            f'<p class="muted">payload</p>{yaml_block(spec.get("payload"))}</div>')
