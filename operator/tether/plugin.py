"""kubectl-tether: a kubectl plugin (`kubectl tether ...`) for WorkerRuns.

  kubectl tether status NAME     attempt timeline with fences, and the live lease age
  kubectl tether stop NAME       the kill switch (spec.stop)
  kubectl tether suspend NAME    no new attempts; the worker is told to pause
  kubectl tether resume NAME
  kubectl tether approve NAME --reason R [--gate Start]   record your decision (a WorkerRunApproval)
  kubectl tether deny NAME --reason R [--gate Start]
"""

from __future__ import annotations

import argparse
import datetime as dt
import re
import sys
from typing import Any


from tether.kube import config as kubeconfig
from tether.kube.client import lease_path, run_path


def _age(ts: str | None, now: dt.datetime) -> str:
    if not ts:
        return "-"
    seconds = (now - dt.datetime.fromisoformat(ts.replace("Z", "+00:00"))).total_seconds()
    return f"{seconds:.1f}s" if seconds < 120 else f"{seconds / 60:.0f}m"


def status_lines(run: dict[str, Any], lease: dict[str, Any] | None, now: dt.datetime) -> list[str]:
    s = run.get("status") or {}
    meta = run["metadata"]
    lines = [f"{meta['namespace']}/{meta['name']}: {s.get('phase', 'Pending')}  attempt {s.get('attempt', 0)}  "
             f"fence {s.get('fence', 0)}  holder {s.get('holder') or '-'}"]
    if lease is not None:
        spec = lease.get("spec") or {}
        lines.append(f"  lease: holder {spec.get('holderIdentity') or '-'}  fence {spec.get('leaseTransitions')}  "
                     f"renewed {_age(spec.get('renewTime'), now)} ago (worker clock)  "
                     f"duration {spec.get('leaseDurationSeconds')}s")
    usage = s.get("usage") or {}
    if usage:
        lines.append(f"  spent: {usage.get('cents', 0)} cents, {usage.get('tokens', 0)} tokens")
    if s.get("checkpoint"):
        lines.append(f"  checkpoint: {s['checkpoint'].get('cursor')}")
    lines.append("  ATTEMPT  FENCE  HOLDER                     STARTED     ENDED       OUTCOME")
    for a in s.get("attempts", []):
        lines.append(f"  {a['attempt']:<7}  {a['fence']:<5}  {a.get('holder', '-'):<25}  "
                     f"{_age(a.get('startedAt'), now) + ' ago':<10}  "
                     f"{(_age(a.get('endedAt'), now) + ' ago') if a.get('endedAt') else 'running':<10}  "
                     f"{a.get('outcome') or '-'}")
    for c in s.get("conditions", []):
        lines.append(f"  condition {c['type']}={c['status']} ({c['reason']})")
    return lines


def _error(resp: Any) -> str:
    try:
        return str(resp.json().get("message", resp.text))
    except ValueError:
        return resp.text


def _decide(http: Any, ns: str, name: str, gate: str, decision: str, reason: str) -> int:
    """Creates a WorkerRunApproval for the run (by name and UID) as the current user, whom the API
    server names (SelfSubjectReview): the admission policy accepts no other approver."""
    gate = {"start": "Start", "result": "Result"}.get(gate.lower(), gate)  # not a request named "start"
    run = http.get(run_path(ns, name))
    if run.status_code >= 400:
        print(f"error: workerrun {ns}/{name}: {_error(run)}", file=sys.stderr)
        return 1
    body_run = run.json()
    phase = (body_run.get("status") or {}).get("phase")
    if gate == "Start" and phase != "AwaitingApproval":
        print(f"error: workerrun {ns}/{name} is {phase or 'new'}, not AwaitingApproval: nothing to decide",
              file=sys.stderr)
        return 1
    me = http.post("/apis/authentication.k8s.io/v1/selfsubjectreviews",
                   json={"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"})
    if me.status_code >= 400:
        print(f"error: who am I: {_error(me)}", file=sys.stderr)
        return 1
    user = me.json()["status"]["userInfo"]["username"]
    stem = re.sub(r"[^a-z0-9-]+", "-", f"{name[:40]}-{gate.lower()[:10]}").strip("-")
    body = {"apiVersion": "tether.dev/v1alpha1", "kind": "WorkerRunApproval",
            "metadata": {"generateName": f"{stem}-"},
            "spec": {"runRef": {"name": name, "uid": body_run["metadata"]["uid"]}, "gate": gate,
                     "decision": decision, "reason": reason, "approver": user}}
    resp = http.post(f"/apis/tether.dev/v1alpha1/namespaces/{ns}/workerrunapprovals", json=body)
    if resp.status_code >= 400:
        print(f"error: {_error(resp)}", file=sys.stderr)
        return 1
    # What was decided on: the run's UID (recorded) and what it will run (immutable while it waits).
    images = ", ".join(c.get("image", "?") for c in ((body_run["spec"].get("template") or {}).get("spec") or {})
                       .get("containers") or []) or body_run["spec"].get("executor", "Pod")
    print(f"workerrunapproval.tether.dev/{resp.json()['metadata']['name']} created: {decision} {gate} of "
          f"{name} (uid {body_run['metadata']['uid']}, {images}) by {user}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kubectl tether", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["status", "stop", "suspend", "resume", "approve", "deny"])
    parser.add_argument("name")
    parser.add_argument("-n", "--namespace", default=None)
    parser.add_argument("--kubeconfig", default=None)
    parser.add_argument("--gate", default="Start", help="approve/deny: Start, Result or a request's name")
    parser.add_argument("--reason", default="", help="approve/deny: why (a denied run's next attempt gets it)")
    args = parser.parse_args(argv)
    cfg = kubeconfig.load(args.kubeconfig)
    ns = args.namespace or cfg.namespace
    with cfg.sync_client() as http:
        if args.command in ("approve", "deny"):
            return _decide(http, ns, args.name, args.gate, "Approve" if args.command == "approve" else "Deny",
                           args.reason)
        if args.command == "status":
            resp = http.get(run_path(ns, args.name))
            if resp.status_code == 404:
                print(f"workerrun {ns}/{args.name} not found", file=sys.stderr)
                return 1
            resp.raise_for_status()
            lease_resp = http.get(lease_path(ns, args.name))
            lease = lease_resp.json() if lease_resp.status_code == 200 else None
            print("\n".join(status_lines(resp.json(), lease, dt.datetime.now(dt.timezone.utc))))
            return 0
        patch = {"stop": {"stop": True}, "suspend": {"suspend": True}, "resume": {"suspend": False}}[args.command]
        resp = http.patch(run_path(ns, args.name), json={"spec": patch},
                          headers={"Content-Type": "application/merge-patch+json"})
        if resp.status_code >= 400:
            print(f"error: {resp.json().get('message', resp.text)}", file=sys.stderr)
            return 1
        print(f"workerrun.tether.dev/{args.name} {args.command}{'ped' if args.command == 'stop' else 'ed'}")
        return 0


if __name__ == "__main__":
    sys.exit(main())


