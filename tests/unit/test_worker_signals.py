"""What the operator's control signals say (docs/protocol.md §7), from sdk/vectors/signals.json,
which the TypeScript and Go SDKs' tests run too: null is a value only where §7 allows it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tether import protocol

VECTORS = json.loads((Path(__file__).resolve().parents[2] / "sdk/vectors/signals.json").read_text())["cases"]


@pytest.mark.parametrize("case", VECTORS, ids=[c["name"] for c in VECTORS])
def test_signal_vectors(case: dict[str, Any]) -> None:
    annotations = {"tether.dev/signals": case["raw"]} if case["raw"] else {}
    got = protocol.lease_signals({"metadata": {"annotations": annotations}})
    read = None if got is None else {"stop": got.stop, "paused": got.paused, "baseCents": got.base_cents,
                                     "capCents": got.cap_cents}
    assert read == case["signals"]
