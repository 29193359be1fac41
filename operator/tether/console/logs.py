"""An attempt's worker logs, read through the API server's pod log endpoint with the console's
credential (the user's: pods/log is theirs to be granted or not). Answered as plain text, which
the page shows as text: nothing in a log is ever markup."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx

from tether.console.details import attempt_pod
from tether.kube.paths import pod_path

TAIL_LINES, TAIL_MAX = 200, 5000
LIMIT_BYTES = 512 * 1024  # a page shows the tail of a log, not a download of it


@dataclass(frozen=True)
class Target:
    pod: str
    container: str


@dataclass(frozen=True)
class Answer:
    status: int
    text: str


def tail_lines(raw: str | None) -> int:
    try:
        return max(1, min(int(raw or TAIL_LINES), TAIL_MAX))
    except ValueError:
        return TAIL_LINES


def target(run: dict[str, Any], pods: list[dict[str, Any]], attempt: int) -> Target | Answer:
    """The attempt's pod and its worker container (the template's first, as the operator runs it),
    or why there are no logs to read."""
    spec = run.get("spec") or {}
    name = run["metadata"]["name"]
    if spec.get("executor") == "External":
        return Answer(404, f"{name} has an External worker: its logs are wherever it runs, not in a pod")
    record = next((r for r in (run.get("status") or {}).get("attempts") or [] if r.get("attempt") == attempt),
                  {"attempt": attempt})
    pod = attempt_pod(pods, record)
    pod_name = record.get("pod") or (pod or {}).get("metadata", {}).get("name")
    if not pod_name:
        return Answer(404, f"attempt {attempt} of {name} has no pod (yet)")
    containers = [c.get("name") for c in ((pod or {}).get("spec") or {}).get("containers") or []] or [
        c.get("name") for c in ((spec.get("template") or {}).get("spec") or {}).get("containers") or []]
    return Target(pod_name, str(containers[0] if containers else ""))


def _message(resp: httpx.Response) -> str:
    try:
        return str(resp.json().get("message") or resp.text)
    except ValueError:
        return resp.text[:500]


async def read(http: httpx.AsyncClient, namespace: str, where: Target, tail: int) -> Answer:
    params = {"tailLines": str(tail), "limitBytes": str(LIMIT_BYTES)}
    if where.container:
        params["container"] = where.container
    try:
        resp = await http.get(f"{pod_path(namespace, where.pod)}/log", params=params)
    except httpx.HTTPError as exc:
        return Answer(502, f"the API server did not answer: {exc or type(exc).__name__}")
    if resp.status_code == 200:
        return Answer(200, resp.text)
    if resp.status_code == 404:
        return Answer(404, f"no logs: pod {where.pod} no longer exists ({_message(resp)})")
    # As the API server said it: a node that serves no logs (the local process kubelet has no
    # port 10250), a container not started yet, a user without pods/log.
    return Answer(resp.status_code if resp.status_code in (400, 401, 403) else 502,
                  f"the API server could not give the logs ({resp.status_code}): {_message(resp)}")
