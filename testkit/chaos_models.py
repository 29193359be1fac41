"""The fault trials' model API (testkit/chaos.py): runs drawn `metered` spend through the SDK's
meter on a fake model API of the trial's own, which cuts some answers before their usage arrives
(a whole answer mid-body, a streamed one in any event before its final usage, or after it), as a network or a provider does. The
model's log is the oracle's record of what was spent (invariant 12), kept apart from Tether's view.
"""

from __future__ import annotations

import random
import threading
from typing import Any

from tether.devcluster.fake_model import WORDS, FakeModel
from testkit.oracle import ModelAnswer

MODEL = "claude-x"
PATH = "/v1/messages"
# USD per million tokens: an answer of ~20 tokens costs about a cent, so spend meets caps and budgets.
PRICES = {MODEL: {"input": 400, "output": 1000}}
CUT_CHANCE = 0.15
# The streamed answer's event with its final usage (fake_model: message_start, content_block_start,
# a delta per word, content_block_stop, message_delta, message_stop).
FINAL_USAGE_EVENT = len(WORDS) + 3


class TrialModel:
    """The fake model, cutting answers at random from the trial's seed."""

    def __init__(self, seed: int) -> None:
        self._cuts = random.Random(f"{seed}/model-cuts")
        self._lock = threading.Lock()
        self.fake = FakeModel(knobs=self._knobs)

    def _knobs(self, request: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            if self._cuts.random() >= CUT_CHANCE:
                return {}
            if (request.get("body") or {}).get("stream"):
                # Half of any event: before FINAL_USAGE_EVENT the answer's final usage never arrives
                # (from event 1 on, message_start's opening count did: the meter must still fault).
                return {"cut_after": self._cuts.randint(0, FINAL_USAGE_EVENT + 1)}
            return {"cut_body": self._cuts.randint(8, 60)}  # a whole answer's JSON never parses

    def payload(self, stream: bool) -> dict[str, Any]:
        """The worker's `model` payload (tests/support/worker_app.py)."""
        return {"url": self.fake.url + PATH, "prices": PRICES, "model": MODEL, "stream": stream}

    def answers(self) -> list[ModelAnswer]:
        """Every answer, in arrival order, by the run and holder its request named (the worker writes
        "<run uid> <holder> <n>")."""
        out = []
        for r in list(self.fake.requests):
            content = str((((r.get("body") or {}).get("messages") or [{}])[0]).get("content") or "")
            uid, _, rest = content.partition(" ")
            holder = rest.partition(" ")[0]
            knobs = r.get("knobs") or {}
            cut = "cut_body" in knobs or knobs.get("cut_after", FINAL_USAGE_EVENT + 1) <= FINAL_USAGE_EVENT
            out.append(ModelAnswer(run_uid=uid, holder=holder, tokens=int(r.get("tokens") or 0), cut=cut))
        return out

    def close(self) -> None:
        self.fake.close()
