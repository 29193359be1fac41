"""Child runs: a WorkerRun spawned by the attempt that holds another (its parent), as one fenced
stage of the parent's work. Shared by the operator, the gateway and the worker SDKs (whose
TypeScript and Go twins pass sdk/vectors/children.json).

A child's name derives from its parent's UID and the caller's stable key, so a parent attempt that
resumes from its checkpoint finds the children it spawned before by key instead of creating them
again, and a parent re-created under the same name adopts none of its namesake's. The spawn's
digest (what the key was asked to run) is kept on the child: the same key asked to run something
else is an error, never a second child.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from tether.api.constants import PREFIX

# On each child: its parent's name (a label, to list a parent's children), the caller's key and the
# digest of what it asked for.
LABEL_PARENT = f"{PREFIX}/parent"
ANN_CHILD_KEY = f"{PREFIX}/child-key"
ANN_SPAWN_DIGEST = f"{PREFIX}/spawn-digest"
# On a child the operator suspended because its parent is (and resumes when the parent is).
ANN_SUSPENDED_BY_PARENT = f"{PREFIX}/suspended-by-parent"
# A child's name: the parent's name cut to this, a dash, and DIGEST_LENGTH hex digits (run names
# have at most 58 characters).
NAME_PREFIX_LENGTH = 47
DIGEST_LENGTH = 10
# The caller's key: what an idempotency key may be, a stable name of one tool call.
KEY_PATTERN = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._:/-]{0,126}[A-Za-z0-9])?$")


def is_child_of(body: dict[str, Any], parent_name: str, parent_uid: str) -> bool:
    """Whether a run is that parent's child: its label names the parent and an owner reference its UID."""
    meta = body.get("metadata") or {}
    return (meta.get("labels") or {}).get(LABEL_PARENT) == parent_name and any(
        r.get("uid") == parent_uid for r in meta.get("ownerReferences") or [])


def valid_key(key: str) -> bool:
    return KEY_PATTERN.fullmatch(key) is not None  # match() would let a trailing newline through ($)


def child_name(parent_name: str, parent_uid: str, key: str, generation: int = 0) -> str:
    """The child's name for `key` under this parent (by UID: a namesake parent gets other names);
    `generation` counts the children of that key rejected as a stale attempt's (worker/spawning.py)."""
    if not valid_key(key):
        raise ValueError(f"child key {key!r} must be 1 to 128 letters, digits and . _ : / - "
                         "(starting and ending with a letter or digit)")
    named = key if generation == 0 else f"{key}#{generation}"
    digest = hashlib.sha256(f"{parent_uid}/{named}".encode()).hexdigest()[:DIGEST_LENGTH]
    return f"{parent_name[:NAME_PREFIX_LENGTH].rstrip('-.')}-{digest}"


def spawn_digest(spec: dict[str, Any]) -> str:
    """What a spawn asked for (the child's spec as the caller gave it, before any default), as a
    digest: two spawns of one key are one child only when they asked for the same."""
    canonical = json.dumps(spec, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()
