"""The process kubelet: a test-only node agent that runs pods as local processes.

There is no container runtime here. For each pod bound to its node it runs
the first container's command as a local process with the pod's environment
and a real service-account token, and reports phase, container state and exit
code back like a kubelet would. A pod's process sees a kubeconfig through
$KUBECONFIG whose user reads that token from a file, so any Kubernetes client
finds the API server with the pod's own identity and RBAC.

The token is minted as the real kubelet mints a projected service-account
token: a TokenRequest on the pod's ServiceAccount with a `boundObjectRef` to
the pod, for the API server's own audiences. The API server therefore puts the
pod's name and UID into the caller's userInfo.extra
(`authentication.kubernetes.io/pod-name`, `.../pod-uid`), which Tether's
admission policies compare with the run's holder, and stops accepting the
token once the pod is gone. Like the kubelet, it rotates the token file at 80%
of the token's lifetime; clients re-read the file when it changes.

Dev feature: the pod annotation `dev.tether.dev/api-server` points that
kubeconfig at another address (tests put a TCP proxy there to cut a worker
off from the API server).

Every pod shares the host's network, so two replicas of one Deployment would
fight over the same ports. As a container runtime publishes a container port
on a host port, the process kubelet gives each TCP port the first container
declares (`ports[].containerPort`) a free host port of its own: it rewrites
that number wherever the command, args or env values pass it as a value (the
whole value, or after `=` or `:`, as in `--metrics-port=8080` or
`http://0.0.0.0:8081/healthz`), and records the mapping in the pod's
annotation `dev.tether.dev/host-ports` (JSON, container port to host port).

Services: each pod gets the environment variables of its namespace's Services
(`<NAME>_SERVICE_HOST`, `<NAME>_SERVICE_PORT`), pointing at a proxy of the kubelet's
(tether.devcluster.services), and `$(VAR)` references in env values, command and args are
expanded as the real kubelet expands them.

Given a serving certificate, it also serves the one kubelet API call a user
needs, `containerLogs` (with `tailLines` and `follow`), on the port it reports
in the node's status, so `kubectl logs` works through the API server. Only
clients with a certificate of the cluster's CA (the API server's) are served.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import datetime as dt
import json
import logging
import os
import re
import signal
import ssl
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx
import yaml

from tether.devcluster.processes import _die_with_parent, free_port
from tether.devcluster.services import ServiceProxies
from tether.kube import config as kubeconfig

log = logging.getLogger("process-kubelet")

# Prepended to the PYTHONPATH of every pod's process (not the kubelet's own).
POD_PYTHONPATH = "TETHER_POD_PYTHONPATH"

API_SERVER_ANNOTATION = "dev.tether.dev/api-server"
HOST_PORTS_ANNOTATION = "dev.tether.dev/host-ports"
# On the node: the chart's NOTES look it up to say what differs on this node.
PROCESS_KUBELET_LABEL = "dev.tether.dev/process-kubelet"
NODE_HEARTBEAT_SECONDS = 10
TOKEN_SECONDS = 3600
# The real kubelet refreshes a projected token once 80% of its lifetime has passed.
TOKEN_REFRESH_FRACTION = 0.8
TOKEN_RETRY_SECONDS = 10


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class PodProcess:
    uid: str
    namespace: str
    name: str
    proc: asyncio.subprocess.Process | None = None
    waiter: asyncio.Task[None] | None = None
    killing: bool = False
    restarts: int = 0
    started_at: str = ""
    log_path: Path | None = None
    token_refresher: asyncio.Task[None] | None = None
    labels: dict[str, str] = field(default_factory=dict)
    ports: dict[int, int] = field(default_factory=dict)  # container port -> host port
    port_names: dict[str, int] = field(default_factory=dict)  # a named container port -> its number

    def stop_token_refresh(self) -> None:
        if self.token_refresher is not None:
            self.token_refresher.cancel()
            self.token_refresher = None


class ProcessKubelet:
    def __init__(self, cfg: kubeconfig.KubeConfig, node: str, work_dir: Path, ca_pem: bytes,
                 root: Path | None = None) -> None:
        self.cfg = cfg
        self.root = root or Path.cwd()
        self.node = node
        self.work_dir = work_dir
        self.ca_pem = ca_pem
        self.pods: dict[str, PodProcess] = {}
        self.client = cfg.async_client(timeout=30)
        self.kubelet_port = 0
        self.services = ServiceProxies(self.client, self._backends)

    # --- node ------------------------------------------------------------

    def _node_status(self) -> dict[str, Any]:
        now = _now()
        ready = {"type": "Ready", "status": "True", "reason": "KubeletReady",
                 "message": "process kubelet is posting ready status",
                 "lastHeartbeatTime": now, "lastTransitionTime": now}
        capacity = {"cpu": "1000", "memory": "1Ti", "pods": "10000", "ephemeral-storage": "1Ti"}
        return {
            "capacity": capacity, "allocatable": capacity, "conditions": [ready],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": self.kubelet_port}},
            "addresses": [{"type": "InternalIP", "address": "127.0.0.1"},
                          {"type": "Hostname", "address": self.node}],
            "nodeInfo": {"kubeletVersion": "v0.0.0-process-kubelet", "architecture": "amd64",
                         "operatingSystem": "linux", "containerRuntimeVersion": "process://",
                         "kernelVersion": "", "osImage": "", "kubeProxyVersion": "",
                         "machineID": "", "systemUUID": "", "bootID": ""},
        }

    async def register(self) -> None:
        body = {"apiVersion": "v1", "kind": "Node",
                "metadata": {"name": self.node, "labels": {"kubernetes.io/hostname": self.node,
                                                           "kubernetes.io/os": "linux",
                                                           "type": "process-kubelet",
                                                           PROCESS_KUBELET_LABEL: "true"}}}
        resp = await self.client.post("/api/v1/nodes", json=body)
        if resp.status_code not in (201, 409):
            resp.raise_for_status()
        await self.post_node_status()

    async def post_node_status(self) -> None:
        resp = await self.client.patch(
            f"/api/v1/nodes/{self.node}/status", json={"status": self._node_status()},
            headers={"Content-Type": "application/merge-patch+json"})
        resp.raise_for_status()
        lease_path = f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{self.node}"
        spec = {"holderIdentity": self.node, "leaseDurationSeconds": 40,
                "renewTime": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")}
        resp = await self.client.patch(lease_path, json={"spec": spec},
                                       headers={"Content-Type": "application/merge-patch+json"})
        if resp.status_code == 404:
            await self.client.post("/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases",
                                   json={"metadata": {"name": self.node}, "spec": spec})

    async def node_heartbeat(self) -> None:
        while True:
            await asyncio.sleep(NODE_HEARTBEAT_SECONDS)
            try:
                await self.post_node_status()
            except httpx.HTTPError as exc:
                log.warning("node heartbeat failed: %s", exc)

    # --- pods ------------------------------------------------------------

    async def watch_pods(self) -> None:
        selector = {"fieldSelector": f"spec.nodeName={self.node}"}
        while True:
            try:
                resp = await self.client.get("/api/v1/pods", params=selector)
                resp.raise_for_status()
                listing = resp.json()
                seen = set()
                for pod in listing["items"]:
                    seen.add(pod["metadata"]["uid"])
                    await self.reconcile(pod)
                for uid in list(self.pods):
                    if uid not in seen:
                        await self.forget(uid)
                rv = listing["metadata"]["resourceVersion"]
                params = {**selector, "watch": "1", "resourceVersion": rv,
                          "allowWatchBookmarks": "true", "timeoutSeconds": "300"}
                async with self.client.stream("GET", "/api/v1/pods", params=params,
                                              timeout=httpx.Timeout(30, read=330)) as stream:
                    async for line in stream.aiter_lines():
                        if not line:
                            continue
                        event = json.loads(line)
                        if event["type"] == "ERROR":
                            break
                        if event["type"] == "BOOKMARK":
                            continue
                        pod = event["object"]
                        if event["type"] == "DELETED":
                            await self.forget(pod["metadata"]["uid"])
                        else:
                            await self.reconcile(pod)
            except (httpx.HTTPError, json.JSONDecodeError) as exc:
                log.warning("pod watch interrupted: %s", exc)
                await asyncio.sleep(1)

    async def reconcile(self, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        uid = meta["uid"]
        known = self.pods.get(uid)
        if meta.get("deletionTimestamp"):
            if known is None or not known.killing:
                grace = meta.get("deletionGracePeriodSeconds", 30)
                asyncio.create_task(self.kill_and_remove(pod, grace))
            return
        if known is None and pod.get("status", {}).get("phase") not in ("Succeeded", "Failed"):
            entry = PodProcess(uid=uid, namespace=meta["namespace"], name=meta["name"])
            self.pods[uid] = entry
            asyncio.create_task(self.start(pod, entry))

    async def forget(self, uid: str) -> None:
        entry = self.pods.pop(uid, None)
        if entry is not None:
            entry.stop_token_refresh()
        if entry is not None and entry.proc is not None and entry.proc.returncode is None:
            _signal_group(entry.proc.pid, signal.SIGKILL)

    async def kill_and_remove(self, pod: dict[str, Any], grace: int) -> None:
        meta = pod["metadata"]
        entry = self.pods.get(meta["uid"])
        if entry is not None:
            entry.killing = True
            entry.stop_token_refresh()
            if entry.proc is not None and entry.proc.returncode is None:
                _signal_group(entry.proc.pid, signal.SIGTERM)
                try:
                    await asyncio.wait_for(asyncio.shield(entry.proc.wait()), timeout=max(grace, 0))
                except asyncio.TimeoutError:
                    pass
                _signal_group(entry.proc.pid, signal.SIGKILL)
                await entry.proc.wait()
            if entry.proc is not None and entry.proc.returncode is not None:
                # Like the real kubelet, the terminated container's exit code is reported before the
                # final delete (it stays readable while something else holds the pod's deletion).
                rc = entry.proc.returncode
                code = rc if rc >= 0 else 128 - rc
                await self.set_status(pod, entry, phase="Succeeded" if code == 0 else "Failed", exit_code=code)
        # The kubelet makes the final, immediate delete once the process is gone.
        body = {"kind": "DeleteOptions", "apiVersion": "v1", "gracePeriodSeconds": 0,
                "preconditions": {"uid": meta["uid"]}}
        await self.client.request("DELETE", f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}",
                                  json=body)
        self.pods.pop(meta["uid"], None)

    async def _resolve_env(self, pod: dict[str, Any], container: dict[str, Any], ports: dict[int, int],
                           mapping: dict[str, str]) -> dict[str, str]:
        """The container's env, each value published (`ports`) and each plain value's `$(VAR)`
        expanded from `mapping` (the Service variables) and the variables defined before it."""
        ns = pod["metadata"]["namespace"]
        env: dict[str, str] = {}
        for item in container.get("env", []) or []:
            if "value" in item:
                env[item["name"]] = expand(_publish(str(item["value"]), ports), {**mapping, **env})
                continue
            src = item.get("valueFrom", {})
            if "fieldRef" in src:
                env[item["name"]] = _publish(_field_ref(pod, src["fieldRef"]["fieldPath"]), ports)
            elif "secretKeyRef" in src or "configMapKeyRef" in src:
                kind, ref = ("secrets", src["secretKeyRef"]) if "secretKeyRef" in src else ("configmaps", src["configMapKeyRef"])
                resp = await self.client.get(f"/api/v1/namespaces/{ns}/{kind}/{ref['name']}")
                resp.raise_for_status()
                data = resp.json().get("data", {})
                value = data.get(ref["key"], "")
                env[item["name"]] = _publish(base64.b64decode(value).decode() if kind == "secrets" else value, ports)
        return env

    def _backends(self, namespace: str, selector: dict[str, str], target: int | str) -> list[int]:
        """Where this node's running pods of `selector` listen on `target` (ServiceProxies)."""
        out = []
        for entry in self.pods.values():
            if entry.namespace != namespace or entry.killing or entry.proc is None or entry.proc.returncode is not None:
                continue
            if any(entry.labels.get(k) != v for k, v in selector.items()):
                continue
            number = int(target) if isinstance(target, int) or str(target).isdigit() else entry.port_names.get(str(target))
            if number is not None:
                # An undeclared port is not published: the process listens on it as it is.
                out.append(entry.ports.get(number, number))
        return out

    async def _mint_token(self, pod: dict[str, Any]) -> tuple[str, float]:
        """A pod-bound token of the pod's ServiceAccount and its lifetime in seconds."""
        spec, meta = pod["spec"], pod["metadata"]
        sa = spec.get("serviceAccountName") or "default"
        # No audiences: the token is then for the API server's own (--api-audiences), which is
        # what it expects of its clients, exactly as for a projected token without an audience.
        req = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
               "spec": {"expirationSeconds": TOKEN_SECONDS,
                        "boundObjectRef": {"kind": "Pod", "apiVersion": "v1",
                                           "name": meta["name"], "uid": meta["uid"]}}}
        resp = await self.client.post(
            f"/api/v1/namespaces/{meta['namespace']}/serviceaccounts/{sa}/token", json=req)
        resp.raise_for_status()
        status = resp.json()["status"]
        expires = dt.datetime.fromisoformat(status["expirationTimestamp"].replace("Z", "+00:00"))
        return status["token"], (expires - dt.datetime.now(dt.timezone.utc)).total_seconds()

    async def _refresh_token(self, pod: dict[str, Any], path: Path, lifetime: float) -> None:
        """Rewrites the token file before the token expires, for as long as the pod runs."""
        delay = lifetime * TOKEN_REFRESH_FRACTION
        while True:
            await asyncio.sleep(max(delay, 1.0))
            try:
                token, lifetime = await self._mint_token(pod)
            except httpx.HTTPError as exc:
                log.warning("token refresh for %s/%s failed: %s", pod["metadata"]["namespace"],
                            pod["metadata"]["name"], exc)
                delay = TOKEN_RETRY_SECONDS
                continue
            _write_atomically(path, token)
            delay = lifetime * TOKEN_REFRESH_FRACTION

    async def _write_credentials(self, pod: dict[str, Any], pod_dir: Path, entry: PodProcess) -> Path | None:
        spec, meta = pod["spec"], pod["metadata"]
        if spec.get("automountServiceAccountToken") is False:
            return None
        token, lifetime = await self._mint_token(pod)
        sa_dir = pod_dir / "serviceaccount"
        sa_dir.mkdir(parents=True, exist_ok=True)
        _write_atomically(sa_dir / "token", token)
        entry.token_refresher = asyncio.create_task(self._refresh_token(pod, sa_dir / "token", lifetime))
        (sa_dir / "ca.crt").write_bytes(self.ca_pem)
        (sa_dir / "namespace").write_text(meta["namespace"])
        server = meta.get("annotations", {}).get(API_SERVER_ANNOTATION, self.cfg.server)
        cfg = {
            "apiVersion": "v1", "kind": "Config", "current-context": "pod",
            "clusters": [{"name": "pod", "cluster": {
                "server": server, "certificate-authority": str(sa_dir / "ca.crt")}}],
            "users": [{"name": "pod", "user": {"tokenFile": str(sa_dir / "token")}}],
            "contexts": [{"name": "pod", "context": {"cluster": "pod", "user": "pod",
                                                     "namespace": meta["namespace"]}}],
        }
        path = pod_dir / "kubeconfig"
        path.write_text(yaml.safe_dump(cfg))
        return path

    async def start(self, pod: dict[str, Any], entry: PodProcess) -> None:
        meta, spec = pod["metadata"], pod["spec"]
        container = spec["containers"][0]
        argv = list(container.get("command") or []) + list(container.get("args") or [])
        if not argv:
            await self.set_status(pod, entry, phase="Failed", exit_code=127,
                                  message="the process kubelet needs container[0].command")
            return
        pod_dir = self.work_dir / f"{meta['namespace']}_{meta['name']}_{meta['uid'][:8]}"
        pod_dir.mkdir(parents=True, exist_ok=True)
        entry.log_path = pod_dir / "container.log"
        try:
            env = {k: os.environ[k] for k in ("LANG", "LC_ALL", "PYTHONPATH", "VIRTUAL_ENV") if k in os.environ}
            if os.environ.get(POD_PYTHONPATH):
                # The pods' code from elsewhere (the fault trials' --source), the kubelet's own unchanged.
                env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.environ[POD_PYTHONPATH], env.get("PYTHONPATH")]))
            # The "image" is this machine: the kubelet's own Python (with tether installed) comes first.
            env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "/usr/bin:/bin")])
            server = urlparse(self.cfg.server)
            env.update({"HOME": str(pod_dir), "HOSTNAME": meta["name"],
                        "KUBERNETES_SERVICE_HOST": server.hostname or "127.0.0.1",
                        "KUBERNETES_SERVICE_PORT": str(server.port or 443)})
            kubecfg = await self._write_credentials(pod, pod_dir, entry)
            if kubecfg is not None:
                env["KUBECONFIG"] = str(kubecfg)
            ports = _host_ports(container)
            entry.labels, entry.ports = dict(meta.get("labels") or {}), ports
            entry.port_names = {p["name"]: int(p["containerPort"]) for p in container.get("ports") or [] if p.get("name")}
            # Published before expanded: a Service's proxy port is never taken for a container port.
            services = await self.services.env_for(meta["namespace"]) if spec.get("enableServiceLinks", True) else {}
            declared = {**services, **await self._resolve_env(pod, container, ports, services)}
            argv = [expand(_publish(arg, ports), declared) for arg in argv]
            env.update(declared)
            await self._record_host_ports(pod, ports)
        except httpx.HTTPError as exc:
            entry.stop_token_refresh()
            await self.set_status(pod, entry, phase="Failed", exit_code=128,
                                  message=f"could not prepare the pod: {exc}")
            return
        await self._run(pod, entry, argv, env, pod_dir)

    async def _record_host_ports(self, pod: dict[str, Any], ports: dict[int, int]) -> None:
        if not ports:
            return
        meta = pod["metadata"]
        annotations = {HOST_PORTS_ANNOTATION: json.dumps({str(k): v for k, v in ports.items()})}
        resp = await self.client.patch(f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}",
                                       json={"metadata": {"annotations": annotations}},
                                       headers={"Content-Type": "application/merge-patch+json"})
        resp.raise_for_status()
        log.info("%s/%s: container ports published on host ports %s", meta["namespace"], meta["name"], ports)

    async def _run(self, pod: dict[str, Any], entry: PodProcess, argv: list[str],
                   env: dict[str, str], pod_dir: Path) -> None:
        restart_policy = pod["spec"].get("restartPolicy", "Always")
        while True:
            logfile = open(pod_dir / "container.log", "ab")
            try:
                # Like an image's WORKDIR: the container's workingDir, else the kubelet's root
                # (the source checkout), so relative commands such as examples/worker.py resolve.
                cwd = pod["spec"]["containers"][0].get("workingDir") or str(self.root)
                entry.proc = await asyncio.create_subprocess_exec(
                    *argv, env=env, cwd=cwd, stdin=asyncio.subprocess.DEVNULL,
                    stdout=logfile, stderr=asyncio.subprocess.STDOUT,
                    start_new_session=True, preexec_fn=_die_with_parent)
            except OSError as exc:
                logfile.close()
                entry.stop_token_refresh()
                await self.set_status(pod, entry, phase="Failed", exit_code=127, message=str(exc))
                return
            finally:
                if not logfile.closed:
                    logfile.close()
            entry.started_at = _now()
            log.info("started %s/%s pid=%s", entry.namespace, entry.name, entry.proc.pid)
            await self.set_status(pod, entry, phase="Running")
            rc = await entry.proc.wait()
            code = rc if rc >= 0 else 128 - rc
            log.info("%s/%s exited with %s", entry.namespace, entry.name, code)
            if entry.killing or entry.uid not in self.pods:
                return
            again = restart_policy == "Always" or (restart_policy == "OnFailure" and code != 0)
            if not again:
                entry.stop_token_refresh()
                await self.set_status(pod, entry, phase="Succeeded" if code == 0 else "Failed",
                                      exit_code=code)
                return
            entry.restarts += 1
            await asyncio.sleep(min(10, 2 ** entry.restarts))

    async def set_status(self, pod: dict[str, Any], entry: PodProcess, phase: str,
                         exit_code: int | None = None, message: str = "") -> None:
        meta, container = pod["metadata"], pod["spec"]["containers"][0]
        now = _now()
        running = phase == "Running"
        if running:
            state: dict[str, Any] = {"running": {"startedAt": entry.started_at}}
        else:
            state = {"terminated": {"exitCode": exit_code, "startedAt": entry.started_at or now,
                                    "finishedAt": now, "message": message,
                                    "reason": "Completed" if exit_code == 0 else "Error"}}
        ready = "True" if running else "False"
        status = {
            "phase": phase, "hostIP": "127.0.0.1", "podIP": "127.0.0.1",
            "podIPs": [{"ip": "127.0.0.1"}], "startTime": pod.get("status", {}).get("startTime") or now,
            "message": message or None,
            "conditions": [
                {"type": "PodScheduled", "status": "True", "lastTransitionTime": now},
                {"type": "Initialized", "status": "True", "lastTransitionTime": now},
                {"type": "ContainersReady", "status": ready, "lastTransitionTime": now},
                {"type": "Ready", "status": ready, "lastTransitionTime": now},
            ],
            "containerStatuses": [{
                "name": container["name"], "image": container.get("image", ""), "imageID": "",
                "containerID": f"process://{entry.proc.pid if entry.proc else 0}",
                "ready": running, "started": running, "restartCount": entry.restarts, "state": state,
            }],
        }
        resp = await self.client.patch(
            f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/status",
            json={"status": status}, headers={"Content-Type": "application/merge-patch+json"})
        if resp.status_code >= 400 and resp.status_code != 404:
            log.warning("status update of %s/%s failed: %s %s", meta["namespace"], meta["name"],
                        resp.status_code, resp.text[:300])

    async def serve_logs(self, cert: Path, key: Path, client_ca: Path) -> None:
        """Serves containerLogs over TLS to clients with a certificate of `client_ca`."""
        from aiohttp import web

        app = web.Application()
        app.router.add_get("/containerLogs/{namespace}/{pod}/{container}", self._container_logs)
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(client_ca))
        context.load_cert_chain(str(cert), str(key))
        context.verify_mode = ssl.CERT_REQUIRED
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port, ssl_context=context).start()
        self.kubelet_port = port

    async def _container_logs(self, request: Any) -> Any:
        from aiohttp import web

        ns, name = request.match_info["namespace"], request.match_info["pod"]
        entry = next((e for e in self.pods.values() if e.namespace == ns and e.name == name), None)
        if entry is None or entry.log_path is None or not entry.log_path.exists():
            return web.Response(status=404, text=f"no logs of pod {ns}/{name} on this node\n")
        data = entry.log_path.read_bytes()
        if request.query.get("tailLines"):
            lines = data.splitlines(keepends=True)
            data = b"".join(lines[len(lines) - min(len(lines), int(request.query["tailLines"])):])
        if request.query.get("follow") != "true":
            return web.Response(body=data, content_type="text/plain")
        response = web.StreamResponse(headers={"Content-Type": "text/plain"})
        await response.prepare(request)
        await response.write(data)
        offset = entry.log_path.stat().st_size
        # Until the process ends (or the client goes away), what it appends.
        while entry.proc is not None and entry.proc.returncode is None:
            await asyncio.sleep(0.5)
            with entry.log_path.open("rb") as f:
                f.seek(offset)
                more = f.read()
            offset += len(more)
            if more:
                await response.write(more)
        return response

    async def shutdown(self) -> None:
        self.services.close()
        for entry in self.pods.values():
            if entry.proc is not None and entry.proc.returncode is None:
                _signal_group(entry.proc.pid, signal.SIGKILL)


def _field_ref(pod: dict[str, Any], path: str) -> str:
    meta, spec = pod["metadata"], pod["spec"]
    simple = {
        "metadata.name": meta["name"], "metadata.namespace": meta["namespace"],
        "metadata.uid": meta["uid"], "spec.nodeName": spec.get("nodeName", ""),
        "spec.serviceAccountName": spec.get("serviceAccountName", ""),
        "status.podIP": "127.0.0.1", "status.hostIP": "127.0.0.1",
    }
    if path in simple:
        return simple[path]
    for prefix, source in (("metadata.labels", "labels"), ("metadata.annotations", "annotations")):
        if path.startswith(prefix + "["):
            key = path[len(prefix) + 1:-1].strip("'\"")
            return str(meta.get(source, {}).get(key, ""))
    return ""


_REFERENCE = re.compile(r"\$(\$|\(([^)]*)\))")


def expand(text: str, mapping: dict[str, str]) -> str:
    """`$(VAR)` replaced by its value in `mapping`, left as it is when undefined; `$$` is one `$`
    (the kubelet's rules for env values, command and args)."""
    return _REFERENCE.sub(lambda m: "$" if m[1] == "$" else mapping.get(m[2], m[0]), text)


_PORT_VALUE = re.compile(r"(^|[=:])(\d+)(?!\d)")


def _host_ports(container: dict[str, Any]) -> dict[int, int]:
    """A free host port for each TCP port the container declares."""
    declared = {int(p["containerPort"]) for p in container.get("ports") or [] if p.get("protocol", "TCP") == "TCP"}
    return {port: free_port() for port in sorted(declared)}


def _publish(text: str, ports: dict[int, int]) -> str:
    """`text` with each declared port passed as a value (whole, or after `=` or `:`) replaced by its host port."""
    return _PORT_VALUE.sub(lambda m: m[1] + str(ports.get(int(m[2]), m[2])), text)


def _write_atomically(path: Path, text: str) -> None:
    """Replaces the file in one rename, so a client never reads half a token."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.chmod(0o600)
    os.replace(tmp, path)


def _signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


async def _amain(args: argparse.Namespace) -> None:
    cfg = kubeconfig.load(args.kubeconfig)
    doc = yaml.safe_load(Path(args.kubeconfig).read_text())
    ca_pem = base64.b64decode(doc["clusters"][0]["cluster"]["certificate-authority-data"])
    kubelet = ProcessKubelet(cfg, args.node_name, Path(args.work_dir), ca_pem, Path(args.root).resolve())
    Path(args.work_dir).mkdir(parents=True, exist_ok=True)
    if args.serving_cert:
        await kubelet.serve_logs(Path(args.serving_cert), Path(args.serving_key), Path(args.client_ca))
    await kubelet.register()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    tasks = [asyncio.create_task(kubelet.node_heartbeat()), asyncio.create_task(kubelet.watch_pods())]
    await stop.wait()
    for task in tasks:
        task.cancel()
    await kubelet.shutdown()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Run pods bound to one node as local processes (tests only).")
    parser.add_argument("--kubeconfig", required=True)
    parser.add_argument("--node-name", required=True)
    parser.add_argument("--work-dir", required=True)
    parser.add_argument("--root", default=".", help="working directory of pods without workingDir")
    parser.add_argument("--serving-cert", default="", help="certificate to serve containerLogs with (none: no logs)")
    parser.add_argument("--serving-key", default="")
    parser.add_argument("--client-ca", default="", help="CA of the clients served (the API server's client certificate)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    asyncio.run(_amain(args))


if __name__ == "__main__":
    main()
