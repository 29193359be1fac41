"""One conformance case: a namespace, the operator (with its gateway), a fenced side-effect
receiver, proxies to cut or fault the worker's traffic, and the worker under test — a pod's
command run by the process kubelet, or a local process that claims the run through the gateway.

A case judges only from what the worker did through the protocol: the API server's audit log,
the final objects, the requests its proxies forwarded, and what the receiver received.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable, TypeVar

import httpx

from tether.devcluster.kubelet import API_SERVER_ANNOTATION
from tether.devcluster.processes import free_port, spawn, terminate
from testkit.apiproxy import ApiProxy
from testkit.audit import AuditRecord
from testkit.chaos import read_audit_to_end
from testkit.kube import Kube, eventually, worker_identity
from testkit.receiver import Effect, Receiver
from testkit.operator_process import OperatorProcess
from testkit.oracle import TrialFacts, judge

T = TypeVar("T")

KEEP = "conformance.tether.dev/exit-code"  # the kit's pod finalizer (Case.keep_pod)
LEASE = {"durationSeconds": 8, "renewIntervalSeconds": 1, "startupGraceSeconds": 30}
POD, GATEWAY = "pod", "gateway"


class Fail(Exception):
    """The worker broke the protocol; the message is the reason shown in the table."""


@dataclass(frozen=True)
class Cluster:
    kubeconfig: Path
    audit_log: Path

    @classmethod
    def from_env(cls) -> "Cluster":
        return cls(Path(os.environ["TETHER_TEST_KUBECONFIG"]), Path(os.environ["TETHER_TEST_AUDIT_LOG"]))


@dataclass(frozen=True)
class Sent:
    """One request a worker sent, as its proxy saw it."""

    at: float  # wall clock when it reached the proxy (the worker's send time)
    method: str
    path: str
    status: int  # what the worker got; 0: no answer
    answered: float | None = None  # wall clock when its answer went back (None: not yet, or never)


class GatewayProxy:
    """An HTTP hop between an external worker and the gateway that a case can cut (requests are
    held, then forwarded late, like a partition that heals) or make answer an error, or anything."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        # One client for every forwarded request: a one-shot httpx.post builds an SSL context (the
        # system's CA bundle) per request, which was a conformance cell's largest CPU cost. No
        # keep-alive, so each request still reaches the gateway on a connection of its own.
        self._upstream = httpx.Client(timeout=30, limits=httpx.Limits(max_keepalive_connections=0))
        self._open = threading.Event()
        self._open.set()
        self._fault: tuple[int, int] | None = None  # (status, retry-after)
        self._answer: tuple[re.Pattern[str], int, str, str] | None = None  # (path, status, body, content type)
        self._hold: tuple[re.Pattern[str], threading.Event] | None = None  # requests matching wait
        self._drop_response: re.Pattern[str] | None = None  # the next match is served, its answer lost
        self._delay_response: tuple[re.Pattern[str], float] | None = None  # the next match is answered late
        self.held = 0  # requests that have waited on hold()
        self.delayed = 0  # answers delay_response() delayed
        # [wall time it arrived, path, status the worker got (0: none yet), wall time answered (None: not yet)]
        self.requests: list[list[Any]] = []
        self._lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                record: list[Any] = [time.time(), self.path, 0, None]
                with outer._lock:
                    outer.requests.append(record)
                hold = outer._hold
                if hold is not None and hold[0].search(self.path):
                    outer.held += 1
                    hold[1].wait()
                outer._open.wait()
                fault, answer = outer._fault, outer._answer
                if fault is not None:
                    status, content = fault[0], json.dumps({"error": {"code": "Unavailable", "message": "injected"}})
                    headers = {"Retry-After": str(fault[1])}
                elif answer is not None and answer[0].search(self.path):
                    status, content, headers = answer[1], answer[2], {"Content-Type": answer[3]}
                else:
                    try:
                        resp = outer._upstream.post(outer.upstream + self.path, content=body, headers={
                            k: v for k, v in self.headers.items() if k.lower() in ("authorization", "content-type")})
                    except httpx.HTTPError:
                        self.close_connection = True
                        return
                    status, content, headers = resp.status_code, resp.text, {}
                    drop, late = outer._drop_response, outer._delay_response
                    if drop is not None and drop.search(self.path):
                        outer._drop_response = None
                        self.close_connection = True  # served upstream; the worker never hears back
                        return
                    if late is not None and late[0].search(self.path):
                        outer._delay_response = None
                        outer.delayed += 1
                        time.sleep(late[1])  # served upstream; the worker hears back late
                record[2] = status
                data = content.encode()
                try:
                    self.send_response(status)
                    for k, v in {"Content-Type": "application/json", "Content-Length": str(len(data)),
                                 **headers}.items():
                        self.send_header(k, v)
                    self.end_headers()
                    self.wfile.write(data)
                    record[3] = time.time()
                except (BrokenPipeError, ConnectionResetError):
                    self.close_connection = True  # the worker gave up on this request (its timeout)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def cut(self) -> None:
        self._open.clear()

    def heal(self) -> None:
        self._fault = self._answer = None
        if self._hold is not None:
            self._hold[1].set()
            self._hold = None
        self._open.set()

    def hold(self, path: str) -> None:
        """Holds requests whose path matches (regex) until heal()."""
        self._hold = (re.compile(path), threading.Event())

    def drop_response(self, path: str) -> None:
        """The next request whose path matches reaches the gateway; its answer is never sent."""
        self._drop_response = re.compile(path)

    def delay_response(self, path: str, seconds: float) -> None:
        """The next request whose path matches reaches the gateway; its answer comes `seconds` late."""
        self._delay_response = (re.compile(path), seconds)

    def fail_with(self, status: int, retry_after: int = 1) -> None:
        self._fault = (status, retry_after)

    def answer_with(self, path: str, status: int, body: str, content_type: str = "application/json") -> None:
        """Requests whose path matches (regex) get this answer instead of the gateway's, until heal()."""
        self._answer = (re.compile(path), status, body, content_type)

    def seen(self) -> list[tuple[float, str, int, float | None]]:
        with self._lock:
            return [(r[0], r[1], r[2], r[3]) for r in self.requests]

    def close(self) -> None:
        self.heal()
        self.server.shutdown()
        self.server.server_close()
        self._upstream.close()


@dataclass
class Case:
    """One scenario for one worker command over one transport, in a namespace of its own."""

    cluster: Cluster
    worker: list[str]  # the conformance worker's command line
    transport: str  # POD or GATEWAY
    workdir: Path
    sdk: str = ""
    operator_behind_proxy: bool = False
    kube: Kube = field(init=False)
    ns: str = field(init=False)
    faulted: set[tuple[str, str]] = field(default_factory=set)
    _cleanup: list[Callable[[], None]] = field(default_factory=list)
    _externals: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def __enter__(self) -> "Case":
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.kube = Kube(str(self.cluster.kubeconfig))
        self._audit_read = self.cluster.audit_log.stat().st_size
        self._audit: list[AuditRecord] = []
        self._audit_lock = threading.Lock()
        self.ns = f"conf-{uuid.uuid4().hex[:8]}"
        self.kube.ok(self.kube.post("/api/v1/namespaces", {"metadata": {"name": self.ns}}))
        self._cleanup.append(lambda: self.kube.delete(f"/api/v1/namespaces/{self.ns}"))
        eventually(lambda: self.kube.get(f"/api/v1/namespaces/{self.ns}/serviceaccounts/default").status_code == 200,
                   timeout=60, what="the namespace's default ServiceAccount")
        self.receiver = Receiver()
        self._cleanup.append(self.receiver.close)
        # Every pod worker reaches the API server through this proxy, so a case can cut or fault it.
        self.worker_proxy = ApiProxy(str(self.cluster.kubeconfig)).__enter__()
        self._cleanup.append(self.worker_proxy.close)
        op_kubeconfig = str(self.cluster.kubeconfig)
        if self.operator_behind_proxy:
            self.operator_proxy = ApiProxy(str(self.cluster.kubeconfig)).__enter__()
            self._cleanup.append(self.operator_proxy.close)
            op_kubeconfig = str(self.operator_proxy.write_kubeconfig(self.workdir / "operator.kubeconfig"))
        port = free_port()
        self.gateway = f"http://127.0.0.1:{port}"
        self.operator = OperatorProcess(self.ns, op_kubeconfig, self.workdir / "operator.log",
                                        extra_env={"TETHER_FOLD_INTERVAL_SECONDS": "1"},
                                        extra_args=[f"--gateway-port={port}", "--gateway-host=127.0.0.1"]).start()
        self._cleanup.append(self.operator.stop)
        probe = httpx.Client(timeout=2)  # (one SSL context for the polls, not one per poll)
        try:
            eventually(lambda: self._gateway_up(probe), timeout=60, what="the operator's gateway")
        finally:
            probe.close()
        if self.transport == GATEWAY:
            self.gateway_proxy = GatewayProxy(self.gateway)
            self._cleanup.append(self.gateway_proxy.close)
            token = worker_identity(self.kube, self.ns, "ext")
            self.token_file = self.workdir / "token"
            self.token_file.write_text(token)
        return self

    def _gateway_up(self, probe: httpx.Client) -> bool:
        try:
            return probe.get(self.gateway + "/healthz").status_code < 500
        except httpx.HTTPError:
            return False

    def __exit__(self, *exc: object) -> None:
        for proc in self._externals:
            terminate(proc, grace=0)
        # The pods' own logs (the process kubelet's), kept with the case for diagnosis.
        state = os.environ.get("TETHER_TEST_STATE_DIR")
        for log in Path(state).glob(f"pods/{self.ns}_*/container.log") if state else []:
            shutil.copyfile(log, self.workdir / f"pod-{log.parent.name.split('_')[1]}.log")
        # Workers ignore SIGTERM (conformance/WORKER.md): end their pods at once, the kept ones too.
        for pod in self.kube.ok(self.kube.get(f"/api/v1/namespaces/{self.ns}/pods"))["items"]:
            if KEEP in (pod["metadata"].get("finalizers") or []):
                self.kube.patch(f"/api/v1/namespaces/{self.ns}/pods/{pod['metadata']['name']}", {"metadata": {
                    "finalizers": [f for f in pod["metadata"]["finalizers"] if f != KEEP]}}, kind="strategic")
        self.kube.request("DELETE", f"/api/v1/namespaces/{self.ns}/pods", params={"gracePeriodSeconds": "0"})
        for fn in reversed(self._cleanup):
            try:
                fn()
            except Exception:  # noqa: BLE001 - tear down the rest regardless
                pass

    # --- runs -----------------------------------------------------------------------

    def create_run(self, name: str, payload: dict[str, Any], wrap: list[str] | None = None,
                   env: dict[str, str] | None = None, labels: dict[str, str] | None = None,
                   **spec: Any) -> dict[str, Any]:
        """`wrap`: a command the pod runs the worker under (the worker's argv follows it); `env`: the
        container's own environment (it overrides the kubelet's)."""
        body: dict[str, Any] = {
            "apiVersion": "tether.dev/v1alpha1", "kind": "WorkerRun", "metadata": {"name": name, "labels": labels or {}},
            "spec": {"payload": {"effectUrl": self.receiver.url, **payload}, "lease": LEASE,
                     "retry": {"maxAttempts": 3, "backoff": {"initialSeconds": 0}}, **spec}}
        if self.transport == POD:
            body["spec"]["executor"] = "Pod"
            body["spec"]["template"] = self.pod_template(wrap, env)
        else:
            body["spec"]["executor"] = "External"
        return self.kube.ok(self.kube.post(Kube.wr_path(self.ns), body))

    def pod_template(self, wrap: list[str] | None = None, env: dict[str, str] | None = None) -> dict[str, Any]:
        """A pod run's template: the SDK's worker, reaching the API server through the case's proxy."""
        return {"metadata": {"annotations": {API_SERVER_ANNOTATION: self.worker_proxy.url}},
                "spec": {"terminationGracePeriodSeconds": 120,
                         "containers": [{"name": "worker", "image": "tether-conformance",
                                         "command": [*(wrap or []), *self.worker],
                                         "env": [{"name": k, "value": v} for k, v in (env or {}).items()]}]}}

    def worker_class(self, name: str, bounds: dict[str, Any]) -> str:
        """A WorkerClass of the case's own (classes are cluster-wide: named after the namespace)."""
        path = "/apis/tether.dev/v1alpha1/workerclasses"
        full = f"{self.ns}-{name}"
        self.kube.ok(self.kube.post(path, {"apiVersion": "tether.dev/v1alpha1", "kind": "WorkerClass",
                                           "metadata": {"name": full}, "spec": {"bounds": bounds}}))
        self._cleanup.append(lambda: self.kube.delete(f"{path}/{full}"))
        return full

    def start_external(self, name: str, worker_id: str, direct: bool = False) -> subprocess.Popen[bytes]:
        """Starts the worker as a local process that claims `name` through the gateway proxy
        (or, `direct`, on a path of its own to the gateway)."""
        url = self.gateway if direct else self.gateway_proxy.url
        # Like a worker pool that claims what is open: an attempt to claim exists (the operator
        # granted it: the status names a holder and the Lease, written after the status, names it
        # too), so a refused claim is the worker's business. Between the two writes the gateway
        # answers NotClaimable, which a compiled worker that starts in milliseconds would meet.
        self.wait(lambda: self._claimable(name), 60, f"an open attempt of {name}")
        env = {**os.environ, "TETHER_GATEWAY_URL": url, "TETHER_GATEWAY_TOKEN_FILE":
               str(self.token_file), "TETHER_NAMESPACE": self.ns, "TETHER_RUN": name, "TETHER_WORKER_ID": worker_id}
        env.pop("KUBECONFIG", None)
        proc = spawn(self.worker, log_path=self.workdir / f"worker-{worker_id}.log", env=env)
        self._externals.append(proc)
        return proc

    def supervise(self, name: str, prefix: str = "w") -> Callable[[], None]:
        """Keeps one external worker running for `name` until the run is terminal (a crashed or
        refused worker is started again, like a process supervisor would); returns a stopper."""
        stop = threading.Event()

        def loop() -> None:
            n = 0
            while not stop.is_set():
                n += 1
                try:
                    proc = self.start_external(name, f"{prefix}{n}")
                except Fail:
                    return  # nothing open any more: the run ended, or the case is over
                while proc.poll() is None and not stop.is_set():
                    stop.wait(0.1)
                if stop.is_set() or self.phase(name) in TERMINAL:
                    return
                stop.wait(0.5)

        threading.Thread(target=loop, daemon=True).start()
        self._cleanup.append(stop.set)
        return stop.set

    def launch(self, name: str) -> None:
        """Pods start on their own; an External run needs its worker process started."""
        if self.transport == GATEWAY:
            self.supervise(name)

    def run(self, name: str) -> dict[str, Any]:
        return self.kube.ok(self.kube.get(Kube.wr_path(self.ns, name)))

    def phase(self, name: str) -> str | None:
        resp = self.kube.get(Kube.wr_path(self.ns, name))
        return (resp.json().get("status") or {}).get("phase") if resp.status_code == 200 else None

    def wait(self, fn: Callable[[], T], timeout: float, what: str) -> T:
        try:
            return eventually(fn, timeout=timeout, interval=0.1, what=what)
        except AssertionError as exc:
            raise Fail(f"timed out ({timeout:.0f}s) waiting for {what}") from exc

    def wait_phase(self, name: str, phases: tuple[str, ...], timeout: float = 90) -> dict[str, Any]:
        def reached() -> dict[str, Any] | None:
            run = self.run(name)
            return run if (run.get("status") or {}).get("phase") in phases else None
        return self.wait(reached, timeout, f"{name} in {'/'.join(phases)}")

    def wait_holder(self, name: str, attempt: int, timeout: float = 60) -> dict[str, Any]:
        """The run once attempt `attempt` holds it and its worker renewed at least once."""
        def held() -> dict[str, Any] | None:
            run = self.run(name)
            st = run.get("status") or {}
            return run if st.get("attempt") == attempt and st.get("holder") and self._renewed(name, st["holder"]) \
                else None
        return self.wait(held, timeout, f"attempt {attempt} of {name} holding and renewing")

    def _lease_spec(self, name: str) -> dict[str, Any]:
        resp = self.kube.get(f"/apis/coordination.k8s.io/v1/namespaces/{self.ns}/leases/{name}")
        return resp.json().get("spec", {}) if resp.status_code == 200 else {}

    def _claimable(self, name: str) -> bool:
        holder = (self.run(name).get("status") or {}).get("holder")
        return bool(holder) and self._lease_spec(name).get("holderIdentity") == holder

    def _renewed(self, name: str, holder: str) -> bool:
        """The holder's worker renewed: a grant writes renewTime equal to acquireTime."""
        spec = self._lease_spec(name)
        return spec.get("holderIdentity") == holder and bool(spec.get("renewTime")) \
            and spec.get("renewTime") != spec.get("acquireTime")

    def worker_requests(self, holder: str) -> list[Sent]:
        """What the holder's worker sent through its proxy, oldest first (external: every worker
        that goes through the gateway proxy)."""
        if self.transport == POD:
            offset = time.time() - time.monotonic()
            return [Sent(r.started + offset, r.method, r.path, r.status or 0,
                         None if r.finished is None else r.finished + offset)
                    for r in self.worker_proxy.requests(lambda r: r.client == f"{self.ns}/{holder}")]
        return [Sent(t, "POST", path, status, answered) for t, path, status, answered in self.gateway_proxy.seen()]

    def keep_pod(self, pod: str) -> None:
        """Keeps the pod object after the operator deletes it (a finalizer of the kit's), so its
        worker's exit code — which the kubelet reports on it — can still be read."""
        path = f"/api/v1/namespaces/{self.ns}/pods/{pod}"
        self.wait(lambda: self.kube.get(path).status_code == 200, 60, f"pod {pod}")
        self.kube.ok(self.kube.patch(path, [{"op": "add", "path": "/metadata/finalizers/-", "value": KEEP}]
                                     if self.kube.ok(self.kube.get(path))["metadata"].get("finalizers")
                                     else [{"op": "add", "path": "/metadata/finalizers", "value": [KEEP]}], kind="json"))

    def exit_code(self, pod: str, timeout: float) -> int:
        """The pod's container exit code, once its worker has exited."""
        def code() -> tuple[int] | None:  # a tuple: exit code 0 must count as found
            resp = self.kube.get(f"/api/v1/namespaces/{self.ns}/pods/{pod}")
            for cs in ((resp.json().get("status") or {}).get("containerStatuses") or []) if resp.status_code == 200 else []:
                term = (cs.get("state") or {}).get("terminated")
                if term is not None:
                    return (int(term["exitCode"]),)
            return None
        return self.wait(code, timeout, f"the worker of pod {pod} to exit")[0]

    def pod_credentials(self, pod: str) -> Path:
        """The pod's service-account directory as the process kubelet wrote it (token, ca.crt,
        namespace): what a container sees at /var/run/secrets/kubernetes.io/serviceaccount."""
        state = os.environ.get("TETHER_TEST_STATE_DIR")
        found = sorted(Path(state).glob(f"pods/{self.ns}_{pod}_*/serviceaccount")) if state else []
        if not found:
            raise Fail(f"harness: no credentials of pod {pod} (TETHER_TEST_STATE_DIR={state!r})")
        return found[-1]

    def effects(self, accepted_only: bool = True) -> list[Effect]:
        return [e for e in self.receiver.seen() if e.decision == "accepted" or not accepted_only]

    # --- judging ----------------------------------------------------------------------

    def audit(self) -> list[AuditRecord]:
        """This namespace's completed requests so far; the log is read once, incrementally."""
        with self._audit_lock:
            records, _, self._audit_read = read_audit_to_end(self.cluster.audit_log, self._audit_read, self.ns)
            self._audit.extend(records)
            return list(self._audit)

    def lease_writes(self, name: str) -> list[AuditRecord]:
        return [r for r in self.audit() if r.about("leases", self.ns, name) and r.is_write]

    def signal_time(self, name: str, predicate: Callable[[dict[str, Any]], bool]) -> float:
        """When the operator's accepted Lease write first carried signals matching `predicate`."""
        def find() -> float | None:
            for r in self.lease_writes(name):
                if not r.accepted or r.user.pod is not None:
                    continue
                raw = (((r.response_object or {}).get("metadata") or {}).get("annotations") or {}).get(
                    "tether.dev/signals")
                if raw and predicate(json.loads(raw)):
                    return r.completed.timestamp()
            return None
        return self.wait(find, 30, "the operator's signal on the Lease")

    def judge_safety(self) -> None:
        """The fault trials' oracle over this namespace: fences, results, pods, charges, liveness.
        A run's terminal status is written before its Lease is cleared: judge once both are."""
        def settled() -> bool:
            held = {x["metadata"]["name"] for x in self.kube.ok(self.kube.get(
                f"/apis/coordination.k8s.io/v1/namespaces/{self.ns}/leases"))["items"]
                if (x.get("spec") or {}).get("holderIdentity")}
            return not any((r.get("status") or {}).get("phase") in TERMINAL and r["metadata"]["name"] in held
                           for r in self.kube.ok(self.kube.get(Kube.wr_path(self.ns)))["items"])
        try:
            eventually(settled, timeout=30, interval=0.2, what="terminal runs' Leases cleared")
        except AssertionError:
            pass  # the oracle names the run whose Lease still has a holder
        runs = self.kube.ok(self.kube.get(Kube.wr_path(self.ns)))["items"]
        budgets = self.kube.ok(self.kube.get(f"/apis/tether.dev/v1alpha1/namespaces/{self.ns}/workerbudgets"))["items"]
        leases = self.kube.ok(self.kube.get(f"/apis/coordination.k8s.io/v1/namespaces/{self.ns}/leases"))["items"]
        pods = self.kube.ok(self.kube.get(f"/api/v1/namespaces/{self.ns}/pods"))["items"]
        facts = TrialFacts(namespace=self.ns, faulted=set(self.faulted), runs=runs, budgets=budgets,
                           leases_final={x["metadata"]["name"]: x for x in leases}, pods_final=pods)
        verdict = judge(self.audit(), facts)
        if not verdict.ok:
            raise Fail("; ".join(str(v) for v in verdict.violations[:3]))


TERMINAL = ("Succeeded", "Failed", "Lost", "Cancelled", "BudgetExceeded", "DeadlineExceeded", "Rejected")
