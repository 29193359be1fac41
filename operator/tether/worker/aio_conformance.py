"""The conformance worker for the asyncio SDK (conformance/WORKER.md), worker "python-async" of the
kit: the same script as tether.worker.conformance (Script's ops), performed with AsyncWorkerRun and
awaits only, so the kit judges the asyncio flavour on its own.

    python -m tether.worker.aio_conformance
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

from tether.worker import AsyncWorkerRun, LeaseLost, OwnershipUnknown
from tether.worker.conformance import CHILD_POLL, Script, claim_args, gateway_token, guarded
from tether.worker.steps import drive_async


async def _start() -> AsyncWorkerRun:
    token = gateway_token()
    if token is None:
        return await AsyncWorkerRun.from_env().start()
    args, kw = claim_args(token)
    return await (await AsyncWorkerRun.claim(*args, **kw)).start()


async def _main() -> int:
    try:
        run = await _start()
    except Exception as exc:  # noqa: BLE001 - any refused claim ends the program with its own code
        print(f"start failed: {exc}", file=sys.stderr)
        return 4
    s = Script(run, "python-async")
    try:
        async with run.http_client(timeout=10) as http:
            async def perform(op: tuple[Any, ...]) -> Any:
                kind, *args = op
                if kind == "sleep":
                    return await asyncio.sleep(args[0])
                if kind == "effect":
                    return await http.effect("POST", s.effect_url or "", operation=f"step-{args[0]}",
                                             **s.effect(args[0]))
                if kind == "spawn":
                    return await run.spawn(args[0], **args[1])
                if kind == "child_result":
                    return await args[0].result(poll=CHILD_POLL)
                return await getattr(run, kind)(*args)  # renew, request_approval, complete, fail
            return await drive_async(s.program_ops(), perform)
    except LeaseLost:
        return 1
    except OwnershipUnknown:
        return 2
    finally:
        await run.stop()  # the last renewal reports what was spent when nothing was published


def main() -> int:
    return guarded(lambda: asyncio.run(_main()))


if __name__ == "__main__":
    sys.exit(main())
