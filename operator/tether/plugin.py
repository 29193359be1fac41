"""kubectl-tether: a kubectl plugin (`kubectl tether ...`) for WorkerRuns.

  kubectl tether status NAME     attempt timeline with fences, and the live lease age
  kubectl tether stop NAME       the kill switch (spec.stop)
  kubectl tether suspend NAME    no new attempts; the worker is told to pause
  kubectl tether resume NAME
  kubectl tether approve NAME --reason R [--gate G] [--attempt N]   record your decision on a
  kubectl tether deny NAME --reason R [--gate G] [--attempt N]      pending gate (a WorkerRunApproval)
  kubectl tether ui [-n NS | -A] [--port P] [--no-open]   the web console on 127.0.0.1, as you
  kubectl tether release-finalizers [NAME] [-n NS | -A] [--operator-namespace NS] [--force]
      after the operator was uninstalled before its runs: removes Tether's finalizers so that
      the runs can be deleted (refused while an operator is alive, unless --force)
  kubectl tether trigger SCHEDULE   start a WorkerRunSchedule's run now, under its concurrency
      policy (Forbid refuses it while a run is active), named <schedule>-m<id> (never a slot's name)
  kubectl tether version         this plugin's version (also --version)

kubectl's connection flags work as they do for kubectl, before or after the command:
  --kubeconfig, --context, --cluster, --user, -n/--namespace, --as, --as-group, --as-uid,
  --request-timeout (the kubeconfig may use exec credential plugins, several KUBECONFIG files...)
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import secrets
import string
import sys
import time
from typing import Any

import httpx

from tether import __version__, release_finalizers
from tether.api.conditions import headline
from tether.children.api import LABEL_PARENT
from tether.console.actions import CONTROLS, ActionError, control, record_decision
from tether.kube import config as kubeconfig
from tether.kube.client import ApiError, KubeClient, server_says
from tether.kube.paths import lease_path, run_path
from tether.protocol import holder_renewed
from tether.schedules.api import ANN_TRIGGER, TRIGGER_ID_LENGTH
from tether.schedules.paths import schedule_path


# What each control command reports once the API server accepted it.
DONE = {"stop": "stopped", "suspend": "suspended", "resume": "resumed"}


def _age(ts: str | None, now: dt.datetime) -> str:
    if not ts:
        return "-"
    seconds = (now - dt.datetime.fromisoformat(ts.replace("Z", "+00:00"))).total_seconds()
    return f"{seconds:.1f}s" if seconds < 120 else f"{seconds / 60:.0f}m"


def status_lines(run: dict[str, Any], lease: dict[str, Any] | None, now: dt.datetime) -> list[str]:
    s = run.get("status") or {}
    meta = run["metadata"]
    why = headline(s)
    lines = [f"{meta['namespace']}/{meta['name']}: {s.get('phase', 'Pending')}{f' ({why[0]})' if why else ''}  "
             f"attempt {s.get('attempt', 0)}  fence {s.get('fence', 0)}  holder {s.get('holder') or '-'}"]
    if why:
        lines.append(f"  {why[0]}: {why[1]}")  # what to fix comes before what the run holds
    if lease is not None:
        spec = lease.get("spec") or {}
        # Only a holder's own renewal says anything about a worker's liveness: an ended run's Lease
        # is released, and a grant's renewTime is the operator's (a refused pod's worker never ran).
        granted = f" (granted {_age(spec['acquireTime'], now)} ago)" if spec.get("acquireTime") else ""
        renewed = "not held" if not spec.get("holderIdentity") else \
            f"never renewed{granted}" if not holder_renewed(lease) else \
            f"renewed {_age(spec.get('renewTime'), now)} ago (worker clock)"
        lines.append(f"  lease: holder {spec.get('holderIdentity') or '-'}  fence {spec.get('leaseTransitions')}  "
                     f"{renewed}  duration {spec.get('leaseDurationSeconds')}s")
    # What waits for a person (kubectl tether approve/deny decides it), and the result.
    for r in (s.get("review") or {}).get("requests") or []:
        if r.get("decision") is None:
            deadline = f"  decide by {r['deadline']}" if r.get("deadline") else ""
            details = f": {str(r['details'])[:200]}" if r.get("details") else ""
            lines.append(f"  pending: gate {r.get('gate')} (attempt {r.get('attempt')}){deadline}{details}")
    if s.get("result") is not None:
        lines.append(f"  result: {json.dumps(s['result'], sort_keys=True)[:500]}")
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


def tree_lines(run: dict[str, Any], children: list[dict[str, Any]]) -> list[str]:
    """A run's place in its tree (docs/children.md): its parent, what its ledger holds, and each
    child with its phase, why, what it spent and its result."""
    spec, s = run.get("spec") or {}, run.get("status") or {}
    lines: list[str] = []
    ref = spec.get("parentRef")
    if ref:
        lines.append(f"  parent: {ref['name']} (spawned by {ref['holder']} at fence {ref['fence']}, depth {ref['depth']})")
    tree = s.get("children") or {}
    if not tree and not children:
        return lines
    lines.append(f"  children: {tree.get('admitted', 0)} admitted, holding {tree.get('reservedCents', 0)} cents / "
                 f"{tree.get('reservedTokens', 0)} tokens, spent {tree.get('spentCents', 0)} cents / "
                 f"{tree.get('spentTokens', 0)} tokens")
    for c in sorted(children, key=lambda c: str(c["metadata"].get("creationTimestamp", ""))):
        cs = c.get("status") or {}
        why = headline(cs)
        usage = cs.get("usage") or {}
        key = (c["metadata"].get("annotations") or {}).get("tether.dev/child-key", "")
        result = f"  result {json.dumps(cs['result'], sort_keys=True)[:80]}" if cs.get("result") is not None else ""
        lines.append(f"    {c['metadata']['name']} ({key}): {cs.get('phase', 'Pending')}"
                     f"{f' ({why[0]})' if why else ''}  spent {usage.get('cents', 0)} cents{result}")
    return lines


async def _decide(cfg: kubeconfig.KubeConfig, ns: str, name: str, gate: str, decision: str, reason: str,
                  attempt: int | None) -> int:
    """Records the decision as the current user (tether.console.actions, shared with the console)."""
    async with cfg.async_client() as http:
        done = await record_decision(http, ns, name, gate, decision, reason, attempt)
    # What was decided on: the run's UID (recorded) and what it will run (immutable while it waits).
    run = done.run
    images = ", ".join(c.get("image", "?") for c in ((run["spec"].get("template") or {}).get("spec") or {})
                       .get("containers") or []) or run["spec"].get("executor", "Pod")
    print(f"workerrunapproval.tether.dev/{done.name} created: {decision} {done.gate} (attempt {done.attempt}) of "
          f"{name} (uid {run['metadata']['uid']}, {images}) by {done.approver}")
    # And what the decision is about: the result under review, or what the worker asked to do.
    if done.gate == "Result":
        print(f"  result: {json.dumps((run.get('status') or {}).get('result'), sort_keys=True)[:500]}")
    elif done.request.get("details"):
        print(f"  details: {str(done.request['details'])[:500]}")
    return 0


async def _control(cfg: kubeconfig.KubeConfig, ns: str, name: str, command: str) -> int:
    async with cfg.async_client() as http:
        await control(http, ns, name, command)
    print(f"workerrun.tether.dev/{name} {DONE[command]}")
    return 0


async def _refusal(kube: KubeClient, operator_ns: str | None) -> str | None:
    """Why release-finalizers must not act: an operator alive, or no way to tell."""
    try:
        alive = await release_finalizers.live_operators(kube, operator_ns, dt.datetime.now(dt.timezone.utc))
    except ApiError as exc:
        return (f"cannot tell whether an operator is alive ({exc}); --operator-namespace NS looks only there, "
                "--force skips the check")
    if alive:
        return ("an operator is alive, and it releases its runs itself:\n  " + "\n  ".join(alive) +
                "\n(delete the runs and wait, or stop it; --force releases them anyway)")
    return None


async def _release(cfg: kubeconfig.KubeConfig, ns: str | None, name: str | None, operator_ns: str | None,
                   force: bool) -> int:
    kube = KubeClient(cfg)
    try:
        refusal = None if force else await _refusal(kube, operator_ns)
        if refusal:
            print(f"error: {refusal}", file=sys.stderr)
            return 1
        done = await release_finalizers.release_finalizers(kube, ns, name)
    finally:
        await kube.close()
    print("\n".join(release_finalizers.report(done)))
    return 1 if done.failed else 0


def _trigger(cfg: kubeconfig.KubeConfig, ns: str, name: str, timeout: float = 30.0) -> int:
    """Asks the operator for a start now (the schedule's tether.dev/trigger annotation: the
    operator decides it under the concurrency policy, as it does a slot) and says what it decided."""
    trigger = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(TRIGGER_ID_LENGTH))
    path = schedule_path(ns, name)
    with cfg.sync_client() as http:
        for _ in range(10):  # the operator's status writes move the resourceVersion too: read again
            got = http.get(path)
            if got.status_code >= 400:
                raise ApiError(got.status_code, got.text, f"get workerrunschedule {ns}/{name}")
            meta = got.json()["metadata"]
            pending = (meta.get("annotations") or {}).get(ANN_TRIGGER)
            if pending and pending != ((got.json().get("status") or {}).get("lastTrigger") or {}).get("id"):
                print(f"error: workerrunschedule.tether.dev/{name}: manual start {pending} is not answered yet; "
                      "try again once it is (is the operator running?)", file=sys.stderr)
                return 1
            # Conditional on what was read: two triggers at once never overwrite each other's request.
            resp = http.patch(path, json={"metadata": {"resourceVersion": meta["resourceVersion"],
                                                       "annotations": {ANN_TRIGGER: trigger}}},
                              headers={"Content-Type": "application/merge-patch+json"})
            if resp.status_code != 409:
                break
        if resp.status_code >= 400:
            raise ApiError(resp.status_code, resp.text, f"trigger workerrunschedule {ns}/{name}")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = http.get(path)
            if got.status_code >= 400:
                raise ApiError(got.status_code, got.text, f"get workerrunschedule {ns}/{name}")
            answer = (got.json().get("status") or {}).get("lastTrigger") or {}
            if answer.get("id") == trigger:
                return _said(name, answer)
            time.sleep(0.5)
    print(f"error: the operator did not answer trigger {trigger} of workerrunschedule.tether.dev/{name} within "
          f"{timeout:.0f}s (is it running?); it will start the run when it does", file=sys.stderr)
    return 1


def _said(name: str, answer: dict[str, Any]) -> int:
    outcome, run = answer.get("outcome"), answer.get("run")
    if outcome == "Started":
        print(f"workerrunschedule.tether.dev/{name} triggered: workerrun.tether.dev/{run} created")
        return 0
    if outcome == "Waiting":
        print(f"workerrunschedule.tether.dev/{name} triggered: workerrun.tether.dev/{run} starts when the active "
              "run has ended")
        return 0
    print(f"error: workerrunschedule.tether.dev/{name}: trigger refused: {answer.get('message')}", file=sys.stderr)
    return 1


def _status(cfg: kubeconfig.KubeConfig, ns: str, name: str) -> int:
    with cfg.sync_client() as http:
        resp = http.get(run_path(ns, name))
        if resp.status_code >= 400:
            raise ApiError(resp.status_code, resp.text, f"get workerrun {ns}/{name}")
        lease_resp = http.get(lease_path(ns, name))
        lease = lease_resp.json() if lease_resp.status_code == 200 else None
        run = resp.json()
        listed = http.get(run_path(ns), params={"labelSelector": f"{LABEL_PARENT}={name}"})
        # Its children (a namesake's are owned by another UID); none listed when the user may not list runs.
        children = [c for c in (listed.json().get("items") or [] if listed.status_code == 200 else [])
                    if any(o.get("uid") == run["metadata"]["uid"] for o in c["metadata"].get("ownerReferences") or [])]
    print("\n".join(status_lines(run, lease, dt.datetime.now(dt.timezone.utc)) + tree_lines(run, children)))
    return 0


def _connection_flags(parser: argparse.ArgumentParser) -> None:
    """kubectl's flags, with kubectl's meaning (tether.kube.config.Flags)."""
    parser.add_argument("--kubeconfig", default=None, help="kubeconfig file(s) (default: $KUBECONFIG, ~/.kube/config)")
    parser.add_argument("--context", default=None, help="the kubeconfig context to use")
    parser.add_argument("--cluster", default=None, help="the kubeconfig cluster to use")
    parser.add_argument("--user", default=None, help="the kubeconfig user to use")
    parser.add_argument("-n", "--namespace", default=None)
    parser.add_argument("--as", dest="impersonate", default=None, help="user to impersonate")
    parser.add_argument("--as-group", dest="impersonate_groups", action="append", default=[],
                        help="group to impersonate (repeatable)")
    parser.add_argument("--as-uid", dest="impersonate_uid", default=None, help="UID to impersonate")
    parser.add_argument("--request-timeout", default=None,
                        help="how long to wait for one request (30, 30s, 1m; 0: as long as it takes)")


def flags_of(args: argparse.Namespace) -> kubeconfig.Flags:
    return kubeconfig.Flags(
        kubeconfig=args.kubeconfig, context=args.context, cluster=args.cluster, user=args.user,
        namespace=args.namespace, impersonate=args.impersonate, impersonate_groups=tuple(args.impersonate_groups),
        impersonate_uid=args.impersonate_uid,
        request_timeout=kubeconfig.parse_timeout(args.request_timeout) if args.request_timeout else None)


def _run(args: argparse.Namespace) -> int:
    cfg = kubeconfig.load(flags=flags_of(args))
    ns = args.namespace or cfg.namespace
    if args.command == "release-finalizers":
        return asyncio.run(_release(cfg, None if args.all_namespaces else ns, args.name, args.operator_namespace,
                                    args.force))
    if args.command == "ui":
        from tether.console.local import serve  # starlette and uvicorn only for the console

        return serve(cfg, None if args.all_namespaces else ns, args.port, open_browser=not args.no_open)
    if args.command in ("approve", "deny"):
        return asyncio.run(_decide(cfg, ns, args.name, args.gate, "Approve" if args.command == "approve" else "Deny",
                                   args.reason, args.attempt))
    if args.command == "status":
        return _status(cfg, ns, args.name)
    if args.command == "trigger":
        return _trigger(cfg, ns, args.name)
    return asyncio.run(_control(cfg, ns, args.name, args.command))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kubectl tether", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"kubectl-tether {__version__}")
    parser.add_argument("command", choices=["status", *CONTROLS, "approve", "deny", "trigger", "ui",
                                            "release-finalizers", "version"])
    parser.add_argument("name", nargs="?", help="the WorkerRun (every command but ui and trigger; release-finalizers: "
                                                "optional), or trigger's WorkerRunSchedule")
    _connection_flags(parser)
    parser.add_argument("-A", "--all-namespaces", action="store_true",
                        help="ui, release-finalizers: every namespace you may list")
    parser.add_argument("--operator-namespace", default=None,
                        help="release-finalizers: where the operator ran (default: look in every namespace)")
    parser.add_argument("--force", action="store_true",
                        help="release-finalizers: even though an operator looks alive")
    parser.add_argument("--gate", default="Start", help="approve/deny: Start, Result or a request's name")
    parser.add_argument("--reason", default=None,
                        help="approve/deny (required): why (a denied run's next attempt gets it)")
    parser.add_argument("--attempt", type=int, default=None,
                        help="approve/deny: the attempt whose gate you decide (default: the newest pending one)")
    parser.add_argument("--port", type=int, default=0, help="ui: the local port (default: any free one)")
    parser.add_argument("--no-open", action="store_true", help="ui: print the URL, do not open a browser")
    args = parser.parse_args(argv)
    if args.command == "version":
        print(f"kubectl-tether {__version__}")
        return 0
    if args.command == "ui" and args.name is not None:
        parser.error("ui takes no NAME")
    if args.command not in ("ui", "release-finalizers") and args.name is None:
        parser.error(f"{args.command} needs a NAME")
    if args.command in ("approve", "deny") and not (args.reason or "").strip():
        parser.error(f"{args.command} needs --reason: why you decide so (it is recorded with your decision)")
    if args.all_namespaces and args.name is not None:
        parser.error("-A takes no NAME")
    # What goes wrong reads as kubectl's would, on stderr with exit 1; never a traceback.
    try:
        return _run(args)
    except kubeconfig.ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
    except ActionError as exc:
        print(exc.server or f"error: {exc}", file=sys.stderr)
    except ApiError as exc:
        print(server_says(exc.status, exc.body) if exc.status else f"Unable to connect to the server: {exc.message}",
              file=sys.stderr)
    except httpx.TransportError as exc:
        print(f"Unable to connect to the server: {exc or type(exc).__name__}", file=sys.stderr)
    except KeyboardInterrupt:
        return 130
    return 1


if __name__ == "__main__":
    sys.exit(main())
