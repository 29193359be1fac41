"""Services on the process kubelet: environment variables and a userspace proxy.

The local cluster has no cluster DNS and no kube-proxy, and its pods share the host's network.
Like a real kubelet (`enableServiceLinks`, on by default), the process kubelet gives each pod the
environment variables of the Services of its namespace, `<NAME>_SERVICE_HOST` and
`<NAME>_SERVICE_PORT` (and `<NAME>_SERVICE_PORT_<PORT NAME>` for named ports), and those point
at a proxy it runs on 127.0.0.1, one port per Service port, as kube-proxy's old userspace mode
did. The proxy forwards each connection to a running pod of the Service's selector on this node,
at the host port its target port was published on. So a manifest
that reaches a Service as `http://$(NAME_SERVICE_HOST):$(NAME_SERVICE_PORT)` works here unchanged.
DNS names (`http://name:port`) do not.
"""

from __future__ import annotations

import asyncio
import logging
import random
from typing import Any, Callable

import httpx

from tether.devcluster.forward import pipe

log = logging.getLogger("process-kubelet")

Backends = Callable[[str, dict[str, str], "int | str"], list[int]]
# A connection that comes before any backend listens (its Deployment is still starting) waits this
# long for one, as kube-proxy's userspace mode retried its endpoints, instead of being reset at once.
CONNECT_SECONDS = 15.0


def env_name(name: str) -> str:
    """A Service or port name as the kubelet spells it in a variable name."""
    return name.upper().replace("-", "_")


def _routable(service: dict[str, Any]) -> bool:
    spec = service.get("spec") or {}
    return bool(spec.get("selector")) and spec.get("clusterIP") not in (None, "", "None") \
        and spec.get("type", "ClusterIP") != "ExternalName"


class ServiceProxies:
    """One local listening port per Service port, made when a pod of its namespace starts."""

    def __init__(self, client: httpx.AsyncClient, backends: Backends) -> None:
        """`backends(namespace, selector, target port)`: the host ports where the running pods of
        that selector listen on that target port (a number or a container port's name)."""
        self.client = client
        self.backends = backends
        self._ports: dict[tuple[str, str, int], int] = {}
        self._servers: list[asyncio.Server] = []
        self._lock = asyncio.Lock()  # two pods starting at once make one proxy per port

    async def env_for(self, namespace: str) -> dict[str, str]:
        """The Service variables of a pod in `namespace`."""
        resp = await self.client.get(f"/api/v1/namespaces/{namespace}/services")
        resp.raise_for_status()
        env: dict[str, str] = {}
        for service in resp.json()["items"]:
            if not _routable(service):
                continue
            name = env_name(service["metadata"]["name"])
            for i, port in enumerate(p for p in service["spec"].get("ports") or [] if p.get("protocol", "TCP") == "TCP"):
                local = await self._proxy(namespace, service["metadata"]["name"], int(port["port"]))
                if i == 0:
                    env[f"{name}_SERVICE_HOST"], env[f"{name}_SERVICE_PORT"] = "127.0.0.1", str(local)
                if port.get("name"):
                    env[f"{name}_SERVICE_PORT_{env_name(port['name'])}"] = str(local)
        return env

    async def _proxy(self, namespace: str, service: str, port: int) -> int:
        key = (namespace, service, port)
        async with self._lock:
            if key not in self._ports:
                async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
                    await self._forward(key, reader, writer)

                server = await asyncio.start_server(handle, "127.0.0.1", 0)
                self._servers.append(server)
                self._ports[key] = server.sockets[0].getsockname()[1]
                log.info("service %s/%s port %s proxied on 127.0.0.1:%s", namespace, service, port, self._ports[key])
        return self._ports[key]

    async def _forward(self, key: tuple[str, str, int], reader: asyncio.StreamReader,
                       writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + CONNECT_SECONDS
        while True:
            try:
                backend = await self._backend(*key)
                if backend is not None:
                    upstream_r, upstream_w = await asyncio.open_connection("127.0.0.1", backend)
                    break
            except (OSError, httpx.HTTPError) as exc:
                log.debug("service %s/%s: no backend yet: %s", key[0], key[1], exc)
            if loop.time() >= deadline:
                log.warning("service %s/%s port %s: no backend answered within %ss", *key, CONNECT_SECONDS)
                writer.close()
                return
            await asyncio.sleep(0.5)
        await asyncio.gather(pipe(reader, upstream_w), pipe(upstream_r, writer))

    async def _backend(self, namespace: str, service: str, port: int) -> int | None:
        """The host port of the Service's target port on one of its pods running here."""
        resp = await self.client.get(f"/api/v1/namespaces/{namespace}/services/{service}")
        resp.raise_for_status()
        spec = resp.json()["spec"]
        target = next((p.get("targetPort", p["port"]) for p in spec.get("ports") or [] if p["port"] == port), None)
        if not spec.get("selector") or target is None:
            return None
        choices = self.backends(namespace, spec["selector"], target)
        return random.choice(choices) if choices else None

    def close(self) -> None:
        for server in self._servers:
            server.close()
