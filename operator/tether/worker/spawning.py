"""Child runs from the worker's side (docs/children.md): spawn one tool call as a fenced WorkerRun
of its own, find it again by key after a crash, and wait for its result. The logic is written once
as ops (tether.worker.ops) that WorkerRun and AsyncWorkerRun drive.

The child's name derives from the parent's UID and the caller's key (tether.children.api), so a
parent attempt that resumed from its checkpoint re-attaches instead of creating it again. A child
the operator rejected as a stale attempt's (StaleParent: the attempt that created it lost the
parent before it was admitted) never ran, so the key moves on to its next generation
(`<key>#1`, ...), deterministically, and the current attempt spawns it there.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

from tether.children.api import ANN_SPAWN_DIGEST, is_child_of, spawn_digest, valid_key
from tether.children.bodies import MAX_GENERATIONS, Parent, child_body
from tether.worker.errors import ChildFailed, SpawnConflict
from tether.worker.ops import Ops, Sleep, Transported

STALE_PARENT = "StaleParent"
# How long a resumed attempt waits for the operator's word on a child an earlier attempt spawned.
JUDGED_WITHIN_SECONDS = 60.0
TERMINAL = ("Succeeded", "Failed", "Lost", "Cancelled", "BudgetExceeded", "DeadlineExceeded", "Rejected")


@dataclass
class Child:
    """A spawned child run: its name, and its body as last read. `result()` waits for it to end
    (with AsyncWorkerRun, `await child.result()`): its result, or ChildFailed."""

    key: str
    name: str
    body: dict[str, Any] = field(default_factory=dict)
    _wait: Callable[["Child", float | None, float], Any] | None = field(default=None, repr=False, compare=False)

    def result(self, timeout: float | None = None, poll: float = 2.0) -> Any:
        assert self._wait is not None, "a Child comes from a run's spawn()"
        return self._wait(self, timeout, poll)

    @property
    def phase(self) -> str | None:
        return (self.body.get("status") or {}).get("phase")

    @property
    def ended(self) -> bool:
        return self.phase in TERMINAL

    def _ready(self) -> dict[str, Any]:
        conditions = (self.body.get("status") or {}).get("conditions") or []
        return next((c for c in conditions if c.get("type") == "Ready"), {})

    @property
    def reason(self) -> str:
        """Why it is where it is (Ready's reason: StaleParent, TreeBudgetExhausted, ...)."""
        return str(self._ready().get("reason") or self.phase or "")

    def outcome(self) -> dict[str, Any]:
        """Its result once it Succeeded; ChildFailed for any other end."""
        status = self.body.get("status") or {}
        if self.phase == "Succeeded":
            return dict(status.get("result") or {})
        raise ChildFailed(self.name, str(self.phase), self.reason, str(self._ready().get("message") or ""),
                          status.get("error"))


def spawn_ops(namespace: str, holder: str, fence: int, parent: Parent, key: str, spec: dict[str, Any]) -> Ops[Child]:
    """Creates the child for `key`, or finds the one made before (by this attempt or an earlier one)."""
    if not valid_key(key):
        raise ValueError(f"child key {key!r} must be 1 to 128 letters, digits and . _ : / - "
                         "(starting and ending with a letter or digit)")
    digest = spawn_digest(spec)
    generation = tries = 0
    while generation < MAX_GENERATIONS and tries < 3 * MAX_GENERATIONS:
        tries += 1
        body = child_body(parent, namespace, holder, fence, key, generation, spec)
        got: dict[str, Any] = yield Transported("spawn", (key, generation, spec, body))
        meta = got.get("metadata") or {}
        if not is_child_of(got, parent.name, parent.uid):
            raise SpawnConflict(f"{meta.get('name')} exists and is not a child of {parent.name}")
        if (meta.get("annotations") or {}).get(ANN_SPAWN_DIGEST) != digest:
            raise SpawnConflict(f"key {key!r} was spawned before as {meta.get('name')} with another spec "
                                "(class, payload, caps): one key is one tool call")
        child = Child(key=key, name=str(meta["name"]), body=got)
        ref = (got.get("spec") or {}).get("parentRef") or {}
        earlier = (ref.get("holder"), ref.get("fence")) != (holder, fence)
        waited = 0.0
        while earlier and child.phase is None and waited < JUDGED_WITHIN_SECONDS:
            # An earlier attempt's child the operator has not judged yet: admitted (it is this call's)
            # or rejected as a stale attempt's (the key moves on). Wait for the word.
            yield Sleep(0.5)
            waited += 0.5
            read = yield Transported("read_run", (child.name,))
            if read is None:
                break
            child.body = read
        else:
            if earlier and child.phase is None:
                raise SpawnConflict(f"{child.name}, spawned for key {key!r} by an earlier attempt, was not judged "
                                    f"within {JUDGED_WITHIN_SECONDS:.0f} s; spawn it again")
            never_ran = not int((child.body.get("status") or {}).get("attempt") or 0)
            if child.phase == "Rejected" and child.reason == STALE_PARENT and never_ran:
                generation += 1  # a lost attempt's child, never admitted and never run: the key moves on
                continue
            return child
        # Deleted while it was waited for: made again, under the same generation.
    raise SpawnConflict(f"key {key!r}: {MAX_GENERATIONS} children rejected as stale attempts' (or deleted) in a row")


def wait_ops(child: Child, timeout: float | None, poll: float, clock: Any = time.monotonic) -> Ops[Child]:
    """Reads the child until it ended (TimeoutError after `timeout` seconds)."""
    deadline = None if timeout is None else clock() + timeout
    while True:
        got = yield Transported("read_run", (child.name,))
        if got is None:
            raise ChildFailed(child.name, "Deleted", "Deleted", "the child run was deleted", None)
        child.body = got
        if child.ended:
            return child
        if deadline is not None and clock() >= deadline:
            raise TimeoutError(f"child run {child.name} has not ended within {timeout} s (phase {child.phase})")
        yield Sleep(poll)

