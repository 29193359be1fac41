"""A worker that proves which payload it received: it completes with the payload's size and digest.

Run by the process kubelet as `python tests/support/payload_worker.py` (tests/e2e/test_payload.py).
"""

from __future__ import annotations

import hashlib
import json
import sys

from tether import logs
from tether.worker import WorkerRun


def digest(payload: dict[str, object]) -> dict[str, object]:
    """Size and SHA-256 of the payload's canonical JSON: the test compares it with what it sent."""
    text = json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()
    return {"bytes": len(text), "sha256": hashlib.sha256(text).hexdigest()}


def main() -> int:
    logs.setup()
    with WorkerRun.from_env() as run:
        run.complete(digest(run.payload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
