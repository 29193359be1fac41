"""How a worker reaches Tether: the Kubernetes API (pods) or the gateway (anywhere).

Both give the same operations, so WorkerRun's logic (self-fencing, signals, failure classes) is
one piece of code:
  renew(checkpoint, usage, requests) -> Renewal   one conditional lease renewal
  publish(field, value)    -> bool        one fenced status write (False: rejected)
  recorded(field, value)   -> bool        whether an earlier publication whose answer was lost landed
Both raise httpx.HTTPError when there is no answer (ownership unknown, not lost).
The operations themselves are steps without I/O (tether.worker.steps, tether.worker.gateway_steps);
a transport here only drives them with a blocking client, or an asyncio one for AsyncWorkerRun
and the benchmarks' fleet.
"""

from __future__ import annotations

from typing import Any, Protocol, TypeVar

import httpx
from httpx import USE_CLIENT_DEFAULT

from tether.api.models import Usage
from tether.children.bodies import Parent
from tether.kube import config as kubeconfig
from tether.worker.ops import request_timeout
from tether.worker.gateway_steps import GatewaySteps, gateway_signals
from tether.worker.steps import (Call, KubeSteps, Renewal, Requests, Steps, drive, drive_async, error_body,
                                 fenced_by_policy)

__all__ = ["AsyncGatewayTransport", "AsyncKubeTransport", "AsyncTransport", "Call", "GatewayTransport",
           "KubeSteps", "KubeTransport", "Renewal", "Requests", "Steps", "Transport", "drive", "drive_async",
           "error_body", "fenced_by_policy", "gateway_signals", "send", "send_async"]


class Transport(Protocol):
    def renew(self, checkpoint: str | None, usage: Usage | None,
              requests: Requests | None = None) -> Renewal: ...

    def publish(self, field: str, value: dict[str, Any]) -> bool: ...

    def recorded(self, field: str, value: dict[str, Any]) -> bool: ...

    def close(self) -> None: ...


class AsyncTransport(Protocol):
    async def renew(self, checkpoint: str | None, usage: Usage | None,
                    requests: Requests | None = None) -> Renewal: ...

    async def publish(self, field: str, value: dict[str, Any]) -> bool: ...

    async def recorded(self, field: str, value: dict[str, Any]) -> bool: ...

    async def aclose(self) -> None: ...


def send(http: httpx.Client, call: Call) -> httpx.Response:
    """Makes one step's request with a blocking client."""
    return http.request(call.method, call.path, json=call.json, headers=call.headers, timeout=_timeout(call))


async def send_async(http: httpx.AsyncClient, call: Call) -> httpx.Response:
    """Makes one step's request with an asyncio client."""
    return await http.request(call.method, call.path, json=call.json, headers=call.headers, timeout=_timeout(call))


def _timeout(call: Call) -> Any:
    return call.timeout if call.timeout is not None else USE_CLIENT_DEFAULT


class _Blocking:
    """Drives a steps class's operations with a blocking client."""

    _http: httpx.Client
    renew_steps: Any
    publish_steps: Any
    recorded_steps: Any
    parent_steps: Any
    spawn_steps: Any
    read_run_steps: Any

    def _send(self, call: Call) -> httpx.Response:
        return send(self._http, call)

    def renew(self, checkpoint: str | None, usage: Usage | None, requests: Requests | None = None) -> Renewal:
        return drive(self.renew_steps(checkpoint, usage, requests), self._send)

    def publish(self, field: str, value: dict[str, Any]) -> bool:
        return drive(self.publish_steps(field, value), self._send)

    def recorded(self, field: str, value: dict[str, Any]) -> bool:
        return drive(self.recorded_steps(field, value), self._send)

    def parent(self) -> Parent:
        return drive(self.parent_steps(), self._send)

    def spawn(self, key: str, generation: int, spec: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
        return drive(self.spawn_steps(key, generation, spec, body), self._send)

    def read_run(self, name: str) -> dict[str, Any] | None:
        return drive(self.read_run_steps(name), self._send)

    def close(self) -> None:
        self._http.close()


class _Async:
    """Drives a steps class's operations with an asyncio client (shared, or its own to close)."""

    _http: httpx.AsyncClient
    _owns_http = False
    renew_steps: Any
    publish_steps: Any
    recorded_steps: Any
    parent_steps: Any
    spawn_steps: Any
    read_run_steps: Any

    async def _send(self, call: Call) -> httpx.Response:
        return await send_async(self._http, call)

    async def renew(self, checkpoint: str | None, usage: Usage | None, requests: Requests | None = None) -> Renewal:
        return await drive_async(self.renew_steps(checkpoint, usage, requests), self._send)

    async def publish(self, field: str, value: dict[str, Any]) -> bool:
        return await drive_async(self.publish_steps(field, value), self._send)

    async def recorded(self, field: str, value: dict[str, Any]) -> bool:
        return await drive_async(self.recorded_steps(field, value), self._send)

    async def parent(self) -> Parent:
        return await drive_async(self.parent_steps(), self._send)

    async def spawn(self, key: str, generation: int, spec: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
        return await drive_async(self.spawn_steps(key, generation, spec, body), self._send)

    async def read_run(self, name: str) -> dict[str, Any] | None:
        return await drive_async(self.read_run_steps(name), self._send)

    async def aclose(self) -> None:
        if self._owns_http:  # a shared client (the benchmarks' fleet) is its owner's to close
            await self._http.aclose()


class KubeTransport(_Blocking, KubeSteps):
    """The pod worker's transport, with its own blocking client."""

    def __init__(self, namespace: str, name: str, holder: str, fence: int, cfg: kubeconfig.KubeConfig,
                 timeout: float, run_uid: str | None = None) -> None:
        super().__init__(namespace, name, holder, fence, run_uid)
        self._http = cfg.sync_client(timeout=timeout)


class AsyncKubeTransport(_Async, KubeSteps):
    """The same transport on an asyncio client: one process can play thousands of workers on a shared
    one (own_client=False), and an AsyncWorkerRun holds one of its own."""

    def __init__(self, namespace: str, name: str, holder: str, fence: int, http: httpx.AsyncClient,
                 run_uid: str | None = None, own_client: bool = False) -> None:
        super().__init__(namespace, name, holder, fence, run_uid)
        self._http, self._owns_http = http, own_client


def gateway_client(cls: Any, base_url: str, token: str, timeout: float, verify: Any) -> Any:
    """An httpx.Client or AsyncClient for the gateway: every call carries the bearer token."""
    return cls(base_url=base_url, headers={"Authorization": f"Bearer {token}"}, timeout=timeout, verify=verify)


class GatewayTransport(_Blocking, GatewaySteps):
    """The external worker's path: the same operations as JSON calls to the Tether gateway."""

    def __init__(self, base_url: str, namespace: str, name: str, token: str, holder: str, fence: int,
                 timeout: float, verify: Any = True, worker_id: str | None = None,
                 run_uid: str | None = None) -> None:
        super().__init__(namespace, name, holder, fence, worker_id, run_uid)
        self._http = gateway_client(httpx.Client, base_url, token, timeout, verify)


class AsyncGatewayTransport(_Async, GatewaySteps):
    """The external worker's path on an asyncio client of its own."""

    _owns_http = True

    def __init__(self, base_url: str, namespace: str, name: str, token: str, holder: str, fence: int,
                 timeout: float, verify: Any = True, worker_id: str | None = None,
                 run_uid: str | None = None) -> None:
        super().__init__(namespace, name, holder, fence, worker_id, run_uid)
        self._http = gateway_client(httpx.AsyncClient, base_url, token, timeout, verify)


G = TypeVar("G", GatewayTransport, AsyncGatewayTransport)


def claimed_transport(kind: type[G], gateway: str, namespace: str, name: str, token: str, doc: dict[str, Any],
                      verify: Any, worker_id: str | None) -> G:
    """The transport of the attempt the gateway's claim reply `doc` hands out."""
    transport = kind(gateway, namespace, name, token, doc["holder"], doc["fence"],
                     timeout=request_timeout(doc["renewIntervalSeconds"]), verify=verify, worker_id=worker_id,
                     run_uid=doc["runUid"])
    transport.tool_claim = doc.get("toolClaim")
    return transport
