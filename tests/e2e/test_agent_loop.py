"""The agent loop example (examples/agent-loop/agent.py) on the test cluster, against the fake model
(tether.devcluster.fake_model) and a fenced receiver: killed mid-run it resumes from its last
checkpointed cycle, asks for its approval, and its risky step lands once; a cap its metered spend
crosses stops it with the run charged what the model's answers cost. Judged by what the model and
the receiver saw and by the run's status, never by the worker's own log. And its README's quick
variant, command by command as written there: the fake model and the receiver as pods behind
Services, an approval asked for, given, and the step received once."""

from __future__ import annotations

import base64
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.cluster.test_approvals import _grant_approver
from tests.e2e.test_budgets import BUDGETS, get_budget
from tests.e2e.test_review_gates import _decide, _pending
from testkit import runs
from tether.devcluster.fake_model import FakeModel
from testkit.kube import Kube, eventually
from testkit.receiver import Receiver

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "agent-loop"
QUICK = re.compile(r"<!-- quick:begin -->\s*```sh\n(.*?)```\s*<!-- quick:end -->", re.S)
PRICES = {"gpt-x": {"input": 2.5, "output": 10}}
CYCLE = re.compile(r"Cycle (\d+) of")


def _setup(kube: Kube, ns: str) -> None:
    """The example's Secret (the API key) and its WorkerBudget, as its README says to make them."""
    kube.ok(kube.post(f"/api/v1/namespaces/{ns}/secrets", {
        "metadata": {"name": "model-api"}, "data": {"api-key": base64.b64encode(b"sk-test").decode()}}))
    kube.ok(kube.post(BUDGETS.format(ns=ns), yaml.safe_load((EXAMPLE / "budget.yaml").read_text())))


def _agent(**payload: Any) -> dict[str, Any]:
    body = runs.example("agent-loop/workerrun.yaml", payload={"model": "gpt-x", "prices": PRICES, **payload},
                        lease={"durationSeconds": 8, "renewIntervalSeconds": 1, "startupGraceSeconds": 30},
                        retry={"maxAttempts": 3, "backoff": {"initialSeconds": 0}})
    body["spec"]["stopGraceSeconds"] = 15
    return body


def _asked(fake: FakeModel, attempt: int) -> list[int]:
    """The cycles (from 0) the model was asked about by `attempt`, in order."""
    return [int(CYCLE.search(r["body"]["messages"][-1]["content"]).group(1)) - 1  # type: ignore[union-attr]
            for r in list(fake.requests) if r["body"].get("user", "").endswith(f"/attempt-{attempt}")]


def _cursor(run: dict[str, Any]) -> dict[str, Any] | None:
    cp = (run.get("status") or {}).get("checkpoint")
    return json.loads(cp["cursor"]) if cp and cp.get("cursor") else None


@pytest.mark.local_cluster
def test_a_killed_agent_resumes_from_its_last_cycle_and_its_approved_step_lands_once(  # type: ignore[no-untyped-def]
        kube: Kube, namespace: str, operator) -> None:
    _setup(kube, namespace)
    _grant_approver(kube, namespace, "alice")
    receiver = Receiver()
    try:
        with FakeModel(input_tokens=1_000, output_tokens=100) as fake:
            runs.create(kube, namespace, _agent(baseUrl=fake.url + "/v1", effectUrl=receiver.url,
                                                cycles=6, cycleSeconds=2, riskyCycle=4))
            # Two cycles checkpointed, then SIGKILL: no last renewal, no goodbye.
            eventually(lambda: ((c := _cursor(runs.get(kube, namespace, "agent-loop"))) or {}).get("cycle", 0) >= 2,
                       timeout=60, interval=0.05, what="cycle 2 checkpointed")
            pod = kube.ok(kube.get(f"/api/v1/namespaces/{namespace}/pods/agent-loop-a1"))
            pid = int(pod["status"]["containerStatuses"][0]["containerID"].removeprefix("process://"))
            os.kill(pid, signal.SIGKILL)
            # The checkpoint attempt 2 was handed: the run's, once attempt 2 holds it.
            granted = eventually(lambda: len((r := runs.get(kube, namespace, "agent-loop"))["status"].get("attempts", []))
                                 >= 2 and r, timeout=60, what="attempt 2")
            resumed = _cursor(granted)
            assert resumed is not None and 2 <= resumed["cycle"] < 4 and resumed["risky"] is None, resumed
            start = resumed["cycle"]

            # Attempt 2 asks before the risky step; a person approves it for that attempt.
            eventually(lambda: ("risky-step", 2) in _pending(runs.get(kube, namespace, "agent-loop")), timeout=60,
                       what="attempt 2's approval request")
            assert not receiver.seen()  # nothing went out before the approval
            _decide(kube, namespace, "agent-loop", "risky-step", "Approve", "looked at the plan", attempt=2)
            run = runs.wait_phase(kube, namespace, "agent-loop", ("Succeeded", "Failed"), timeout=60)
            s = run["status"]
            assert s["phase"] == "Succeeded", s
            # The model saw attempt 1 up to where it was killed, then attempt 2 from its checkpoint on,
            # each cycle after the checkpoint exactly once.
            first, second = _asked(fake, 1), _asked(fake, 2)
        assert first == list(range(len(first))) and start <= len(first) <= start + 1, first
        assert second == list(range(start, 6)), (start, second)
        assert len(s["attempts"]) == 2 and s["attempts"][1]["outcome"] == "Succeeded"
        final = _cursor(run)
        assert final is not None and (final["cycle"], final["risky"]) == (6, "done"), final
        assert s["result"]["risky"] == "done" and s["result"]["cycles"] == 6
        # Asked once, by attempt 2, and approved; the step landed once, with attempt 2's fence.
        asked = [(r["gate"], r["attempt"], r.get("decision")) for r in s["review"]["requests"]]
        assert asked == [("risky-step", 2, "Approve")], asked
        [effect] = receiver.accepted()
        assert (effect.step, effect.attempt, effect.fence) == (4, 2, s["attempts"][1]["fence"])
        assert effect.key.endswith(":risky-step")
        assert len(receiver.seen()) == 1
    finally:
        receiver.close()


@pytest.mark.local_cluster
def test_a_cap_stops_the_agent_when_its_metered_spend_crosses_it(  # type: ignore[no-untyped-def]
        kube: Kube, namespace: str, operator) -> None:
    _setup(kube, namespace)
    with FakeModel(input_tokens=10_000, output_tokens=1_000) as fake:  # 3.5 cents an answer
        body = _agent(baseUrl=fake.url + "/v1", cycles=500, cycleSeconds=0.2, effectUrl=None)
        body["spec"]["budget"]["capCents"] = 20
        runs.create(kube, namespace, body)
        run = runs.wait_phase(kube, namespace, "agent-loop", "BudgetExceeded", timeout=60)
        # The agent stopped by itself: its process is gone, so it asks the model nothing more.
        eventually(lambda: (pod := kube.get(f"/api/v1/namespaces/{namespace}/pods/agent-loop-a1")).status_code == 404
                   or pod.json()["status"].get("phase") in ("Succeeded", "Failed"), timeout=30, what="agent exited")
        answered = len(fake.requests)
    assert run["status"]["attempts"][0]["outcome"] == "BudgetExceeded"
    assert 6 <= answered < 500  # 6 answers cross 20 cents; it stopped long before its 500 cycles
    # Charged what the answers cost: 10,000 input tokens at $2.50/M and 1,000 output at $10/M each,
    # summed exactly, rounded up to a cent once.
    units = answered * (10_000 * 2_500_000 + 1_000 * 10_000_000)  # 1e-12 USD
    cents = -(-units // 10**10)
    usage = eventually(lambda: (u := runs.get(kube, namespace, "agent-loop")["status"]["usage"])["cents"] == cents
                       and u, timeout=30, what=f"run usage {cents} cents")
    assert usage["tokens"] == 11_000 * answered
    assert runs.get(kube, namespace, "agent-loop")["status"]["overspend"]["cents"] == cents - 20
    eventually(lambda: get_budget(kube, namespace, "agents")["status"]["spent"]["cents"] == cents, timeout=30,
               what="the WorkerBudget charged the metered spend")


def quick_commands() -> list[str]:
    """The commands of the README's "Try it on the local cluster", one a line."""
    blocks = QUICK.findall((EXAMPLE / "README.md").read_text())
    assert len(blocks) == 1, "examples/agent-loop/README.md needs one ```sh block between the quick markers"
    return [line for line in blocks[0].splitlines() if line.strip() and not line.lstrip().startswith("#")]


def _captures(text: str) -> list[dict[str, Any]]:
    return [doc for line in text.splitlines() if line.startswith("{")
            and (doc := json.loads(line)).get("event") == "capture"]


@pytest.mark.local_cluster
def test_the_quick_variant_as_documented_asks_then_lands_its_step_once(  # type: ignore[no-untyped-def]
        kube: Kube, namespace: str, operator, bin_dir: Path, tmp_path: Path) -> None:
    """Each command of the README's block runs as written, in a shell whose kubeconfig's namespace
    is the test's; between them the run's status and the receiver's log say how far the story is."""
    config = yaml.safe_load(Path(kube.kubeconfig_path).read_text())
    for context in config["contexts"]:
        context["context"]["namespace"] = namespace
    (tmp_path / "kubeconfig").write_text(yaml.safe_dump(config))
    env = {**os.environ, "KUBECONFIG": str(tmp_path / "kubeconfig"),
           "PATH": os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent), os.environ["PATH"]])}
    said: dict[str, str] = {}
    for command in quick_commands():
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", command], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, (command, done.stdout, done.stderr)
        said[command] = done.stdout
        run = runs.get(kube, namespace, "agent-loop-quick") if "agent-loop-quick" in command else None
        if run is not None and "review.requests" in command:
            # Asked, by its first attempt, after three checkpointed cycles; nothing sent yet.
            assert _pending(run) == [("risky-step", 1)] and (_cursor(run) or {}).get("cycle") == 3, run["status"]
            assert not _captures(pod_logs(kube, namespace, "app=receiver"))
        if run is not None and "tether approve" in command:
            assert "Approve risky-step (attempt 1) of agent-loop-quick" in done.stdout, done.stdout

    run = runs.get(kube, namespace, "agent-loop-quick")
    s = run["status"]
    assert s["phase"] == "Succeeded" and s["result"]["risky"] == "done" and s["result"]["cycles"] == 6, s
    assert [(r["gate"], r["attempt"], r.get("decision")) for r in s["review"]["requests"]] == [
        ("risky-step", 1, "Approve")]
    # The step was received once, with the fence of the attempt that was approved, as the README's
    # `kubectl logs` shows it.
    [(command, logged)] = [(c, out) for c, out in said.items() if "kubectl logs deployment/receiver" in c]
    [capture] = _captures(logged)
    assert capture["fence"] == s["attempts"][0]["fence"] and capture["idempotencyKey"].endswith(":risky-step")
    assert len(_captures(pod_logs(kube, namespace, "app=receiver"))) == 1
    # Spend metered from the fake model's answers: six of 1,000 input and 200 output tokens.
    assert s["usage"]["tokens"] == 6 * 1_200, s["usage"]


def pod_logs(kube: Kube, namespace: str, selector: str) -> str:
    """The logs of the pods of `selector`, through the API server."""
    pods = kube.ok(kube.get(f"/api/v1/namespaces/{namespace}/pods", params={"labelSelector": selector}))["items"]
    return "".join(kube.get(f"/api/v1/namespaces/{namespace}/pods/{p['metadata']['name']}/log").text for p in pods)


CLASSES = "/apis/tether.dev/v1alpha1/workerclasses"


@pytest.fixture
def loop_classes(kube: Kube) -> Any:
    """The example's two classes (classes.yaml), as its README applies them."""
    made: list[str] = []
    try:
        for doc in yaml.safe_load_all((EXAMPLE / "classes.yaml").read_text()):
            made.append(kube.ok(kube.post(CLASSES, doc))["metadata"]["name"])
        yield made
    finally:
        for name in made:
            kube.delete(f"{CLASSES}/{name}")


@pytest.mark.local_cluster
def test_the_approved_step_runs_as_a_child_which_a_killed_agent_finds_again_and_which_lands_once(  # type: ignore[no-untyped-def]
        kube: Kube, namespace: str, operator, loop_classes: list[str]) -> None:
    """workerrun-tool.yaml: the approved step is dispatched as a child run (tool.py); the agent is
    killed while the child works, and its next attempt, resumed from the cursor that kept the
    approved step, finds the same child by key (no second approval, no second child) and takes its
    result. The receiver saw the step once, with the child's fence."""
    _setup(kube, namespace)
    _grant_approver(kube, namespace, "alice")
    example = yaml.safe_load((EXAMPLE / "workerrun-tool.yaml").read_text())
    tool = {**example["spec"]["payload"]["riskyTool"], "workSeconds": 6}
    receiver = Receiver()
    try:
        with FakeModel(input_tokens=1_000, output_tokens=100) as fake:
            body = runs.example("agent-loop/workerrun-tool.yaml", payload={
                "model": "gpt-x", "prices": PRICES, "baseUrl": fake.url + "/v1", "effectUrl": receiver.url,
                "cycles": 4, "cycleSeconds": 1, "riskyCycle": 1, "riskyTool": tool},
                lease={"durationSeconds": 8, "renewIntervalSeconds": 1, "startupGraceSeconds": 30},
                retry={"maxAttempts": 3, "backoff": {"initialSeconds": 0}})
            runs.create(kube, namespace, body)
            name = body["metadata"]["name"]
            eventually(lambda: ("risky-step", 1) in _pending(runs.get(kube, namespace, name)), timeout=90,
                       what="attempt 1's approval request")
            _decide(kube, namespace, name, "risky-step", "Approve", "looked at the plan", attempt=1)

            def running_child() -> dict[str, Any] | None:
                made = kube.ok(kube.get(Kube.wr_path(namespace),
                                        params={"labelSelector": f"tether.dev/parent={name}"}))["items"]
                return made[0] if made and (made[0].get("status") or {}).get("phase") == "Running" else None
            child = eventually(running_child, timeout=90, interval=0.1, what="the child run working")
            assert not receiver.seen()  # the tool works for 6 s before its step goes out
            pod = kube.ok(kube.get(f"/api/v1/namespaces/{namespace}/pods/{name}-a1"))
            os.kill(int(pod["status"]["containerStatuses"][0]["containerID"].removeprefix("process://")), signal.SIGKILL)
            run = runs.wait_phase(kube, namespace, name, ("Succeeded", "Failed"), timeout=120)
        s = run["status"]
        assert s["phase"] == "Succeeded" and len(s["attempts"]) == 2, s
        # Approved once, by attempt 1: attempt 2 kept to what its cursor says was approved and dispatched.
        assert [(r["gate"], r["attempt"], r.get("decision")) for r in s["review"]["requests"]] == [
            ("risky-step", 1, "Approve")]
        made = kube.ok(kube.get(Kube.wr_path(namespace), params={"labelSelector": f"tether.dev/parent={name}"}))["items"]
        assert [c["metadata"]["name"] for c in made] == [child["metadata"]["name"]]  # one child, found again
        done = made[0]["status"]
        assert done["phase"] == "Succeeded" and len(done["attempts"]) == 1 and done["result"]["sent"] is True, done
        assert made[0]["spec"]["parentRef"]["holder"] == f"{name}-a1"
        assert s["result"]["risky"] == f"done by {child['metadata']['name']}"
        # The step went out once, from the child, under the child's own key and fence.
        [effect] = receiver.accepted()
        assert len(receiver.seen()) == 1
        assert effect.key == f"{child['metadata']['uid']}:risky-step" and effect.fence == done["attempts"][0]["fence"]
        ledger = eventually(lambda: (c := runs.get(kube, namespace, name)["status"].get("children") or {})
                            .get("admitted") == 1 and not c.get("live") and c, timeout=30, what="the child settled")
        assert ledger["spentCents"] == (done.get("usage") or {}).get("cents", 0)
    finally:
        receiver.close()
