"""A per-run cap stops a worker whose model spending crosses it: the worker calls a model API (the
fake in tether.devcluster.fake_model) through tether.worker.metering and reports nothing itself."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.test_budgets import budget, get_budget
from testkit import runs
from tether.devcluster.fake_model import FakeModel
from testkit.kube import Kube, eventually
from testkit.scenario import app_run, lines

PRICES = {"gpt-x": {"input": 2.5, "output": 10}, "claude-x": {"input": 3, "output": 15}}
# What one answer of 10,000 input and 1,000 output tokens costs, in 1e-12 USD (a cent is 1e10).
UNITS = {"/v1/chat/completions": 10_000 * 2_500_000 + 1_000 * 10_000_000,   # 3.5 cents
         "/v1/responses": 10_000 * 2_500_000 + 1_000 * 10_000_000,
         "/v1/messages": 10_000 * 3_000_000 + 1_000 * 15_000_000}           # 4.5 cents


@pytest.mark.local_cluster
def test_a_cap_stops_a_worker_whose_model_spending_crosses_it(kube: Kube, namespace: str, operator,  # type: ignore[no-untyped-def]
                                                              tmp_path: Path) -> None:
    out = tmp_path / "metered.jsonl"
    budget(kube, namespace, limitCents=10_000)
    with FakeModel(input_tokens=10_000, output_tokens=1_000) as fake:
        body = app_run("metered", {
            "modelUrl": fake.url, "prices": PRICES, "outFile": str(out), "pauseSeconds": 0.2,
            "calls": [{"path": "/v1/chat/completions", "model": "gpt-x"},
                      {"path": "/v1/chat/completions", "model": "gpt-x", "stream": True},
                      {"path": "/v1/messages", "model": "claude-x", "stream": True},
                      {"path": "/v1/responses", "model": "gpt-x"},
                      {"path": "/v1/messages", "model": "claude-x-20250101"}]})
        body["spec"]["template"]["spec"]["containers"][0]["command"] = ["python", "tests/support/metered_worker.py"]
        body["spec"]["budget"] = {"capCents": 50, "budgetRef": {"name": "team"}}
        body["spec"]["stopGraceSeconds"] = 15
        runs.create(kube, namespace, body)
        run = runs.wait_phase(kube, namespace, "metered", "BudgetExceeded", timeout=90)
        # The worker stopped by itself: its process exited, so it can make no more requests.
        eventually(lambda: (pod := kube.get(f"/api/v1/namespaces/{namespace}/pods/metered-a1")).status_code == 404
                   or pod.json()["status"].get("phase") in ("Succeeded", "Failed"), timeout=30, what="worker exited")
        stopped = [entry for entry in lines(out) if entry["event"] == "stopped"]
        assert len(stopped) == 1 and stopped[0]["attempt"] == 1, lines(out)
        answered = [r["path"] for r in fake.requests]
    assert len(answered) == stopped[0]["calls"] >= 12  # at most 4.5 cents each: 12 to cross 50
    # Streamed chat completions were asked for their usage; the model saw no request after the stop.
    assert all(r["body"]["stream_options"] == {"include_usage": True}
               for r in fake.requests if r["path"] == "/v1/chat/completions" and r["body"]["stream"])
    # What the model's answers said it cost is what the run was charged: every call, rounded up once.
    spent = sum(UNITS[p] for p in answered)
    cents = -(-spent // 10**10)
    s = run["status"]
    assert s["attempts"][0]["outcome"] == "BudgetExceeded"
    usage = eventually(lambda: (u := runs.get(kube, namespace, "metered")["status"]["usage"])["cents"] == cents and u,
                       timeout=30, what=f"run usage {cents} cents")
    assert usage["tokens"] == 11_000 * len(answered)
    final = runs.get(kube, namespace, "metered")["status"]
    assert final["overspend"]["cents"] == cents - 50 >= 0
    # Told on a heartbeat after the operator folded the crossing report (renew 1 s, fold 1 s here),
    # the worker stopped within a few seconds of the call that crossed the cap, and spent only
    # what it spent meanwhile.
    crossed = next(e for e in lines(out) if e["event"] == "call" and e["cents"] >= 50)
    assert stopped[0]["at"] - crossed["at"] < 4, (crossed, json.dumps(stopped))
    eventually(lambda: get_budget(kube, namespace)["status"]["spent"]["cents"] == cents, timeout=30,
               what="the budget charged the metered spend")
