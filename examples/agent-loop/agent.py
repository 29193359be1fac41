"""An agent loop under Tether: hours of model calls, checkpointed cycle by cycle, with its spend
metered against the run's cap and budget, and a person's approval before its one risky step.

Each cycle asks the model (any OpenAI-compatible /chat/completions endpoint) what to do next,
given the goal and its notes so far, and keeps the answer as its new notes. At cycle `riskyCycle`
it asks a person to approve the step the model proposes, then sends it as a fenced side effect.

Payload (spec.payload):
  goal           what the agent works on (the prompt)
  model          the model's name (else $OPENAI_MODEL)
  baseUrl        the API's base URL, ending in /v1 (else $OPENAI_BASE_URL, else OpenAI's)
  prices         USD per million tokens per model (tether.worker.metering), e.g.
                 {"gpt-4o-mini": {"input": 0.15, "output": 0.60}}
  cycles         how many cycles (default 240)
  cycleSeconds   the pause between two cycles (default 60: 240 cycles take four hours)
  riskyCycle     the cycle of the risky step (default: half way)
  effectUrl      where the risky step is sent (a POST; fenced and idempotent; else $EFFECT_URL)
  approvalTimeoutSeconds  how long a person has to decide (default 3600)
  riskyTool      {"className", "capCents", "template", "workSeconds"?}: do the approved risky step as a child run of
                 that class (tool.py in its pod: its own lease, retries and key, its cap a share of
                 this run's) instead of from this process (workerrun-tool.yaml; docs/children.md)
The API key comes from $OPENAI_API_KEY (a Secret; see workerrun.yaml).

The checkpoint cursor is the loop's whole state, as JSON: the next cycle, the notes, and what
became of the risky step (with riskyTool: the approved step, once it is dispatched). A new attempt
(after a pod was lost, killed or evicted) starts from it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from typing import Any

import httpx

from tether import logs
from tether.worker import AsyncWorkerRun, ChildFailed, StopRequested
from tether.worker.aio import AsyncFencedClient
from tether.worker.metering import Meter, RunStopped

log = logging.getLogger("agent-loop")

NOTES_CHARS = 600  # the cursor is at most 1024 characters: notes are kept short
PROPOSAL_CHARS = 200  # and so is the approved step kept in it for the child run


async def main() -> int:
    logs.setup()
    async with AsyncWorkerRun.from_env() as run, run.http_client(timeout=30) as effects:
        p = run.payload
        cycles = int(p.get("cycles", 240))
        risky_cycle = int(p.get("riskyCycle", cycles // 2))

        # 1. Resume: the cursor of the last attempt, or a fresh start.
        state = json.loads(run.checkpoint_cursor) if run.checkpoint_cursor else {"cycle": 0, "notes": "", "risky": None}
        log.info("agent started", extra={"event": "agent_started", "attempt": run.attempt, "resumeFrom": state["cycle"]})

        # 2. The model client: every answer's `usage` is priced and reported on the heartbeat, so
        #    the run's cap (spec.budget.capCents) and its WorkerBudget see this attempt's spend.
        meter = Meter(run, p["prices"])
        model = ModelClient(meter, base_url=p.get("baseUrl") or os.environ.get("OPENAI_BASE_URL") or
                            "https://api.openai.com/v1", model=p.get("model") or os.environ["OPENAI_MODEL"],
                            api_key=os.environ.get("OPENAI_API_KEY", ""), user=f"{run.namespace}/{run.name}")
        async with model:
            while state["cycle"] < cycles:
                try:
                    await one_cycle(run, model, effects, state, cycles, risky_cycle)
                except (StopRequested, RunStopped) as stop:
                    # StopRequested: a cap crossed, spec.stop, or Kueue evicting the run (told on a
                    # heartbeat). RunStopped: the meter refused a model call before sending it, as
                    # soon as the agent's own reports used up what was left of the cap.
                    # The cursor holds the last finished cycle; it rides on the last renewal as the
                    # run is closed, and a next attempt (after a yield) resumes from it.
                    log.info("agent stopping", extra={"event": "agent_stopped", "cycle": state["cycle"],
                                                      "reason": str(stop),
                                                      "yielding": getattr(stop, "yielding", False),
                                                      "cents": meter.cents})
                    return 0
                log.info("cycle done", extra={"event": "agent_cycle", "cycle": state["cycle"],
                                              "cents": meter.cents, "tokens": meter.tokens})
                if state["cycle"] < cycles:
                    await pause(run, float(p.get("cycleSeconds", 60)))

        await run.complete({"cycles": cycles, "risky": state["risky"], "notes": state["notes"][:200]})
    return 0


async def one_cycle(run: AsyncWorkerRun, model: "ModelClient", effects: AsyncFencedClient, state: dict[str, Any],
                    cycles: int, risky_cycle: int) -> None:
    """Asks the model for the next step, does the risky one if it is its turn, checkpoints the cycle."""
    await wait_while_paused(run)
    run.ensure_owner()  # no work without confirmed ownership, nor once told to stop
    cycle, p = state["cycle"], run.payload

    # 3. One cycle: ask the model what to do next, keep its answer as the notes.
    answer = await model.ask(goal=p.get("goal", "Keep the service healthy."), notes=state["notes"],
                             cycle=cycle, cycles=cycles, attempt=run.attempt)
    state["notes"] = answer[:NOTES_CHARS]

    # 4. The risky step: a person approves it first, then it goes out once, fenced.
    if cycle == risky_cycle and state["risky"] is None:
        state["risky"] = await risky_step(run, effects, p, state, proposal=answer)

    # 5. Checkpoint the cycle: flush=True sends it with a renewal now rather than at the next one.
    state["cycle"] = cycle + 1
    run.checkpoint(json.dumps(state), flush=True)


class ModelClient:
    """Chat completions on any OpenAI-compatible endpoint, through the metering transport."""

    def __init__(self, meter: Meter, *, base_url: str, model: str, api_key: str, user: str) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.AsyncClient(transport=meter.async_transport(), base_url=base_url.rstrip("/") + "/",
                                      headers=headers, timeout=120)
        self.model, self.user = model, user

    async def ask(self, *, goal: str, notes: str, cycle: int, cycles: int, attempt: int) -> str:
        body = {"model": self.model, "user": f"{self.user}/attempt-{attempt}", "max_tokens": 300,
                "messages": [{"role": "system", "content": f"You work on this goal: {goal}"},
                             {"role": "user", "content": f"Cycle {cycle + 1} of {cycles}. Your notes so far: "
                                                         f"{notes or '(none)'}\nWhat is the next step?"}]}
        for retry in range(4):  # rate limits and overloads are common over hours: back off, then give up
            answer = await self.http.post("chat/completions", json=body)
            if answer.status_code not in (429, 500, 502, 503, 529) or retry == 3:
                break
            await asyncio.sleep(2 ** retry)
        answer.raise_for_status()  # an error fails the attempt; the next one resumes from the checkpoint
        return str(answer.json()["choices"][0]["message"]["content"] or "")

    async def __aenter__(self) -> "ModelClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.http.aclose()


async def risky_step(run: AsyncWorkerRun, effects: AsyncFencedClient, p: dict[str, Any], state: dict[str, Any],
                     proposal: str) -> str:
    """Asks a person, and on approval sends the step, or dispatches it as a child run. Returns what
    became of it."""
    cycle, url = state["cycle"], p.get("effectUrl") or os.environ.get("EFFECT_URL")
    if p.get("riskyTool") and state.get("approved"):
        # Approved and dispatched by an earlier attempt: the same call again, found by its key.
        return await dispatch(run, p["riskyTool"], cycle, state["approved"], url)
    decision = await run.request_approval("risky-step", details=f"cycle {cycle + 1}: {proposal[:200]}",
                                          timeout=int(p.get("approvalTimeoutSeconds", 3600)))
    log.info("risky step decided", extra={"event": "agent_approval", "decision": decision.decision,
                                          "approver": decision.approver, "reason": decision.reason})
    if not decision.approved:
        return decision.decision  # Deny or TimedOut: the loop goes on without it
    if p.get("riskyTool"):
        # What was approved is kept before it is dispatched, so that a resumed attempt dispatches
        # that very call (the same key and payload: the same child) rather than a new answer's.
        state["approved"] = proposal[:PROPOSAL_CHARS]
        run.checkpoint(json.dumps(state), flush=True)
        return await dispatch(run, p["riskyTool"], cycle, state["approved"], url)
    if url:
        # Idempotency-Key "<idempotencyKey>:risky-step" is the same in every attempt, so a step
        # repeated after a crash is replayed by the receiver, never done twice; the fence lets it
        # refuse a superseded attempt. effect() refuses to start unless ownership is confirmed.
        sent = await effects.effect("POST", url, operation="risky-step",
                                    json={"step": cycle, "attempt": run.attempt, "proposal": proposal[:500]})
        sent.raise_for_status()
    return "done"


async def dispatch(run: AsyncWorkerRun, tool: dict[str, Any], cycle: int, proposal: str, url: str | None) -> str:
    """The approved step as a child run (tool.py): fenced by this attempt, its own lease and retries,
    a share of this run's cap, and its result back here only while this attempt holds the run."""
    child = await run.spawn(f"risky-step-{cycle}", class_name=tool["className"], cap_cents=tool.get("capCents"),
                            payload={"step": cycle, "proposal": proposal, "effectUrl": url,
                                     "workSeconds": tool.get("workSeconds", 0)},
                            spec={"template": tool["template"]})
    log.info("risky step dispatched", extra={"event": "agent_dispatched", "child": child.name})
    try:
        done = await child.result(poll=1.0)
    except ChildFailed as exc:
        return f"failed: {exc.phase} ({exc.reason})"  # the loop goes on without it
    return f"done by {child.name}" if done.get("sent") else f"not sent by {child.name}"


async def wait_while_paused(run: AsyncWorkerRun) -> None:
    """spec.suspend: hold on (the heartbeat goes on) until resumed or told to stop."""
    while run.signals.paused and not run.signals.stop:
        await asyncio.sleep(1)


async def pause(run: AsyncWorkerRun, seconds: float) -> None:
    """The pause between cycles, cut short by a stop signal (it arrives on a heartbeat)."""
    loop = asyncio.get_running_loop()
    until = loop.time() + seconds
    while not run.signals.stop and loop.time() < until:
        await asyncio.sleep(min(1.0, until - loop.time()))


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
