"""The fault trials' invariant 15, judged from the API server's audit log and the final objects:
child runs (docs/children.md) are fenced by their parent and counted once in its tree's ledger.

- A stale attempt's child never starts: a child that was ever granted an attempt was admitted into
  its parent's ledger (the accepted parent status write that first lists it in
  `status.children.live`) while the parent's holder and fence were the ones its `spec.parentRef`
  names (that write's own response says them).
- One child per key: no child name is created twice (names derive from the parent and the key).
- Admitted once, settled once: across the parent's accepted status writes (in commit order) a child
  joins `live` at most once and never comes back after it left; `admitted` never goes down.
- The ledger adds up: the parent's final `reservedCents`/`reservedTokens` are the sum of its live
  children's reservations, and its `spentCents`/`spentTokens` are at least what its settled
  children (those still there to read) spent.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Iterable

from testkit.audit import AuditRecord

INVARIANT = 15


def _ledger(body: dict[str, Any]) -> dict[str, Any]:
    return ((body.get("status") or {}).get("children") or {}) if isinstance(body, dict) else {}


def _spent(run: dict[str, Any]) -> tuple[int, int]:
    """What a run and its subtree spent, as its final status says."""
    s = run.get("status") or {}
    own = [a.get("usage") or {} for a in s.get("attempts") or []] + [s.get("trimmedUsage") or {}]
    tree = s.get("children") or {}
    return (sum(int(u.get("cents") or 0) for u in own) + int(tree.get("spentCents") or 0),
            sum(int(u.get("tokens") or 0) for u in own) + int(tree.get("spentTokens") or 0))


def judge_children(records: Iterable[AuditRecord], namespace: str, runs: list[dict[str, Any]],
                   violations: list[tuple[int, str, str]], stats: Counter[str]) -> None:
    records = [r for r in records if r.object_ref is not None and r.object_ref.namespace == namespace]
    creates = Counter(str((r.request_object.get("metadata") or {}).get("name")) for r in records
                      if r.verb == "create" and r.accepted and not r.dry_run and r.about("workerruns", namespace)
                      and r.request_object is not None and "parentRef" in (r.request_object.get("spec") or {}))
    for name, n in creates.items():
        if n > 1:
            violations.append((INVARIANT, name, f"child created {n} times"))
    by_name = {r["metadata"]["name"]: r for r in runs}
    children = {name: run for name, run in by_name.items() if "parentRef" in (run.get("spec") or {})}
    parents = {run["spec"]["parentRef"]["name"] for run in children.values()}
    admitted_at: dict[str, dict[str, Any]] = {}  # child uid -> the parent's status as it admitted it
    left_of: dict[str, set[str]] = {}  # parent -> the children that left its ledger (settled)
    for parent in sorted(parents):
        writes = sorted((r for r in records if r.accepted and r.verb in ("update", "patch") and r.response_object
                         and r.about("workerruns", namespace, parent, "status")),
                        key=lambda r: int(r.response_object["metadata"]["resourceVersion"]))  # type: ignore[index]
        live: set[str] = set()
        left: set[str] = set()
        admitted = 0
        for w in writes:
            status = w.response_object.get("status") or {}  # type: ignore[union-attr]
            ledger = status.get("children") or {}
            now = {e.get("uid") for e in ledger.get("live") or []}
            for uid in now - live:
                if uid in admitted_at or uid in left:
                    violations.append((INVARIANT, parent, f"child {uid} admitted again (resourceVersion "
                                                          f"{w.response_object['metadata']['resourceVersion']})"))  # type: ignore[index]
                admitted_at[uid] = status
            left |= live - now
            left_of[parent] = left
            if int(ledger.get("admitted") or 0) < admitted:
                violations.append((INVARIANT, parent, f"children.admitted went down from {admitted}"))
            admitted = max(admitted, int(ledger.get("admitted") or 0))
            live = now
    for name, child in children.items():
        ref, s = child["spec"]["parentRef"], child.get("status") or {}
        ran = bool(s.get("attempts")) or int(s.get("attempt") or 0) > 0
        if not ran:
            continue
        stats["child runs that ran"] += 1
        at = admitted_at.get(child["metadata"]["uid"])
        if at is None:
            violations.append((INVARIANT, name, "ran without being admitted into its parent's ledger"))
        elif (at.get("holder"), at.get("fence")) != (ref["holder"], ref["fence"]):
            violations.append((INVARIANT, name, f"admitted while the parent was held by {at.get('holder')} at fence "
                                                f"{at.get('fence')}, not by {ref['holder']} at fence {ref['fence']} "
                                                "(its spawner): a stale attempt's child ran"))
    for parent in parents:
        final = by_name.get(parent)
        if final is None:
            continue
        ledger = _ledger(final)
        live = ledger.get("live") or []
        for field, entry in (("reservedCents", "reservedCents"), ("reservedTokens", "reservedTokens")):
            if int(ledger.get(field) or 0) != sum(int(e.get(entry) or 0) for e in live):
                violations.append((INVARIANT, parent, f"children.{field} {ledger.get(field)} is not the sum of its "
                                                      f"live children's ({[e.get('name') for e in live]})"))
        live_uids = {e.get("uid") for e in live}
        settled = [c for c in children.values() if c["spec"]["parentRef"]["name"] == parent
                   and c["metadata"]["uid"] in admitted_at and c["metadata"]["uid"] not in live_uids]
        cents = sum(_spent(c)[0] for c in settled)
        tokens = sum(_spent(c)[1] for c in settled)
        spent = (int(ledger.get("spentCents") or 0), int(ledger.get("spentTokens") or 0))
        # Every child that left the ledger still there to read: what they spent is the tree's, exactly.
        readable = len(settled) == len(left_of.get(parent, set()))
        if spent[0] < cents or spent[1] < tokens or (readable and spent != (cents, tokens)):
            violations.append((INVARIANT, parent, f"children.spent ({spent[0]} cents, {spent[1]} tokens) is not "
                                                  f"what its settled children spent ({cents}, {tokens})"))
        stats["child runs settled"] += len(settled)
