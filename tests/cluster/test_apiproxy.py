"""The fault-injecting API proxy (testkit/apiproxy.py) against the real kube-apiserver.

Each test proves one fault as a client of the proxy sees it, and checks with admin
credentials on the real API (not through the proxy) what the API server itself saw.
"""

from __future__ import annotations

import json
import os
import queue
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import pytest

from testkit.apiproxy import ApiProxy, RequestRecord
from testkit.audit import AuditLog
from testkit.kube import Kube, eventually
from tether.kube import config as kubeconfig

CMS = "/api/v1/namespaces/{ns}/configmaps"
LEASES = "/apis/coordination.k8s.io/v1/namespaces/{ns}/leases"


@pytest.fixture
def proxy() -> Iterator[ApiProxy]:
    with ApiProxy(os.environ["TETHER_TEST_KUBECONFIG"], seed=11) as p:
        yield p


@pytest.fixture
def client(proxy: ApiProxy) -> Iterator[httpx.Client]:
    """An httpx client configured from the proxy's kubeconfig by Tether's own loader."""
    with kubeconfig.load(proxy.kubeconfig).sync_client(timeout=60) as c:
        yield c


class Call:
    """A blocking request on its own thread, so the test can act while it is held."""

    def __init__(self, fn: Callable[[], httpx.Response]) -> None:
        self.response: httpx.Response | None = None
        self.error: BaseException | None = None
        self.returned_at: float | None = None
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], httpx.Response]) -> None:
        try:
            self.response = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            self.error = exc
        self.returned_at = time.monotonic()

    @property
    def done(self) -> bool:
        return self.returned_at is not None

    def result(self, timeout: float = 30) -> httpx.Response:
        self._thread.join(timeout)
        assert self.done, "the call did not return"
        if self.error is not None:
            raise self.error
        assert self.response is not None
        return self.response


class WatchReader:
    """Reads a watch stream on a thread, over a client of its own (from `kubeconfig_path`) that only
    this thread closes, once the stream has ended: a client closed by another thread under a
    blocked read frees the socket's descriptor while the read goes on, and whatever socket gets that
    number next (in one test worker: a later test's pipe to its fleet process) has its bytes stolen."""

    def __init__(self, kubeconfig_path: "str | os.PathLike[str]", path: str) -> None:
        self.lines: queue.Queue[str] = queue.Queue()
        self.ended: BaseException | str | None = None
        self.status: int | None = None
        self._thread = threading.Thread(target=self._run, args=(kubeconfig_path, path), daemon=True)
        self._thread.start()

    def _run(self, kubeconfig_path: "str | os.PathLike[str]", path: str) -> None:
        try:
            with kubeconfig.load(kubeconfig_path).sync_client(timeout=60) as client, \
                    client.stream("GET", path, timeout=httpx.Timeout(30, read=None)) as resp:
                self.status = resp.status_code
                for line in resp.iter_lines():
                    if line.strip():
                        self.lines.put(line)
            self.ended = "eof"
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            self.ended = exc

    def next_event(self, timeout: float = 30) -> dict[str, Any]:
        return json.loads(self.lines.get(timeout=timeout))

    def join(self, timeout: float = 30) -> None:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the watch did not end"


def _cm(name: str, value: str = "v1") -> dict[str, Any]:
    return {"metadata": {"name": name}, "data": {"k": value}}


def _last(proxy: ApiProxy, method: str, path_end: str) -> RequestRecord:
    return [r for r in proxy.requests() if r.method == method and r.path.endswith(path_end)][-1]


def test_kubectl_and_tethers_loader_trust_the_proxy(proxy: ApiProxy, client: httpx.Client, namespace: str,
                                                     bin_dir: Path) -> None:
    out = subprocess.run([str(bin_dir / "kubectl"), "--kubeconfig", str(proxy.kubeconfig), "get", "ns", namespace,
                          "-o", "name"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"namespace/{namespace}"
    seen = _last(proxy, "GET", f"/namespaces/{namespace}")
    # The proxy swapped its own token for the admin certificate: the API server answered 200.
    assert (seen.client, seen.forwarded, seen.upstream_status, seen.status) == ("proxy", True, 200, 200)
    assert client.get(f"/api/v1/namespaces/{namespace}").json()["metadata"]["name"] == namespace


def test_a_foreign_bearer_token_is_passed_through_not_replaced(proxy: ApiProxy, kube: Kube, namespace: str,
                                                               tmp_path: Path) -> None:
    token = kube.ok(kube.post(f"/api/v1/namespaces/{namespace}/serviceaccounts/default/token",
                              {"spec": {"expirationSeconds": 600}}))["status"]["token"]
    cfg = kubeconfig.load(proxy.write_kubeconfig(tmp_path / "sa.kubeconfig", token=token))
    with cfg.sync_client() as sa:
        resp = sa.get(CMS.format(ns=namespace))
    # The default service account may not list config maps: the API server saw the worker's identity.
    assert resp.status_code == 403, resp.text
    assert f"system:serviceaccount:{namespace}:default" in resp.json()["message"]
    assert _last(proxy, "GET", "/configmaps").client == f"system:serviceaccount:{namespace}:default"


def test_a_worker_pod_reaches_the_api_server_through_the_proxy_as_itself(proxy: ApiProxy, kube: Kube,
                                                                         namespace: str) -> None:
    """The process kubelet points a pod's kubeconfig at the proxy (annotation); the pod trusts only the
    cluster CA and sends its pod-bound token. Its default service account may not read pods: a 403 from
    the API server proves the request arrived with the pod's identity, not the proxy's."""
    probe = ("from tether.kube import config; c = config.load().sync_client(); "
             f"print(c.get('/api/v1/namespaces/{namespace}/pods/probe').status_code)")
    kube.ok(kube.post(f"/api/v1/namespaces/{namespace}/pods", {
        "metadata": {"name": "probe", "annotations": {"dev.tether.dev/api-server": proxy.url}},
        "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 2,
                 "containers": [{"name": "main", "image": "process", "command": ["python", "-c", probe]}]}}))
    rec = proxy.wait_for_request(lambda r: r.path.endswith("/pods/probe") and r.status is not None, timeout=90)
    assert rec.client == f"{namespace}/probe"
    assert (rec.upstream_status, rec.status) == (403, 403)


def test_delay_before_forwarding_and_before_answering(proxy: ApiProxy, client: httpx.Client, kube: Kube,
                                                      namespace: str) -> None:
    path = CMS.format(ns=namespace)
    proxy.delay(1.0, method="GET", path=r"/configmaps/missing$", times=1)
    began = time.monotonic()
    assert client.get(f"{path}/missing").status_code == 404
    assert time.monotonic() - began >= 1.0
    assert client.get(f"{path}/missing").status_code == 404
    assert [r.faults for r in proxy.requests() if r.path.endswith("/missing")] == [["delay@request"], []]

    # A delayed answer: the API server has made the change while the client still waits for its 201.
    proxy.delay(4.0, phase="response", method="POST", path=r"/configmaps$", times=1)
    call = Call(lambda: client.post(path, json=_cm("late")))
    eventually(lambda: kube.get(f"{path}/late").status_code == 200, timeout=10, interval=0.05,
               what="the config map created upstream")
    assert not call.done, "the client got its answer before the API server's change was visible"
    assert call.result().status_code == 201
    rec = _last(proxy, "POST", "/configmaps")
    assert rec.upstream_status == 201 and rec.faults == ["delay@response"]
    assert rec.finished is not None and rec.finished - rec.started >= 4.0


@pytest.mark.parametrize("code,reason", [(429, "TooManyRequests"), (500, "InternalError"),
                                         (503, "ServiceUnavailable"), (410, "Expired")])
def test_status_answers_with_a_kubernetes_status(proxy: ApiProxy, client: httpx.Client, kube: Kube, namespace: str,
                                                 code: int, reason: str) -> None:
    path = CMS.format(ns=namespace)
    proxy.status(code, retry_after=3, method="GET", path=r"/configmaps$", watch=False, times=1)
    resp = client.get(path)
    assert resp.status_code == code
    assert resp.headers["content-type"] == "application/json"
    assert resp.headers["retry-after"] == "3"
    body = resp.json()
    # The same fields, in the same encoding, as a Status the real API server sends.
    real = kube.get(f"{path}/no-such-map")
    assert real.status_code == 404
    assert set(real.json()) <= set(body) and set(body) - set(real.json()) <= {"details"}
    assert (body["kind"], body["apiVersion"], body["status"], body["code"], body["reason"]) == (
        "Status", "v1", "Failure", code, reason)
    assert body["details"] == {"retryAfterSeconds": 3}
    assert not _last(proxy, "GET", "/configmaps").forwarded
    assert client.get(path).status_code == 200  # the rule was for one request


def test_error_after_the_write_landed(proxy: ApiProxy, client: httpx.Client, kube: Kube, namespace: str) -> None:
    path = CMS.format(ns=namespace)
    proxy.status(503, phase="response", method="POST", times=1)
    resp = client.post(path, json=_cm("landed"))
    assert resp.status_code == 503 and resp.json()["reason"] == "ServiceUnavailable"
    # The client was told it failed; the API server did it.
    assert kube.get(f"{path}/landed").status_code == 200
    rec = _last(proxy, "POST", "/configmaps")
    assert (rec.upstream_status, rec.status) == (201, 503)


def test_answer_sends_the_body_as_given_before_or_after_the_write(proxy: ApiProxy, client: httpx.Client, kube: Kube,
                                                                  namespace: str) -> None:
    path = CMS.format(ns=namespace)
    page = b"<html><body>Please sign in</body></html>"
    proxy.answer(200, page, content_type="text/html", method="GET", path=r"/configmaps$", watch=False, times=1)
    resp = client.get(path)
    assert (resp.status_code, resp.headers["content-type"], resp.content) == (200, "text/html", page)
    assert not _last(proxy, "GET", "/configmaps").forwarded
    proxy.answer(200, b'{"kind":"Status"}', phase="response", method="POST", times=1)
    resp = client.post(path, json=_cm("answered"))
    assert (resp.status_code, resp.json()) == (200, {"kind": "Status"})
    assert kube.get(f"{path}/answered").status_code == 200  # the API server did it; the client was not told
    rec = _last(proxy, "POST", "/configmaps")
    assert (rec.upstream_status, rec.status) == (201, 200)


def test_an_expired_watch_looks_like_the_api_servers_own(proxy: ApiProxy, client: httpx.Client, kube: Kube,
                                                         namespace: str) -> None:
    """kube-apiserver reports a watch from a compacted resourceVersion in-band: 200, one ERROR event whose
    object is Status{code: 410, reason: Expired, message: "too old resource version: N (M)"}, end of stream
    (the watch cache's errWatcher and apimachinery's NewResourceExpired). A fresh cluster has compacted
    nothing, so the real one cannot be provoked here: the envelope is compared with a real watch event
    and the object with a real Status error."""
    path = CMS.format(ns=namespace)
    rv = kube.ok(kube.get(path))["metadata"]["resourceVersion"]
    # Straight to the API server; it ends the watch by itself (timeoutSeconds).
    real = WatchReader(os.environ["TETHER_TEST_KUBECONFIG"], f"{path}?watch=true&resourceVersion={rv}&timeoutSeconds=30")
    kube.ok(kube.post(path, _cm("real")))
    real_event = real.next_event()
    real_status = kube.get(f"{path}/no-such-map").json()

    proxy.status(410, watch=True, times=1)
    watch = WatchReader(proxy.kubeconfig, f"{path}?watch=true&resourceVersion=7")
    event = watch.next_event()
    watch.join()
    assert watch.status == 200 and watch.ended == "eof" and watch.lines.empty()
    assert set(event) == set(real_event) and event["type"] == "ERROR"
    assert set(event["object"]) == set(real_status) - {"details"}
    assert {k: event["object"][k] for k in ("kind", "apiVersion", "status", "code", "reason")} == {
        "kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 410, "reason": "Expired"}
    assert event["object"]["message"] == "too old resource version: 7 (8)"
    assert not _last(proxy, "GET", "/configmaps").forwarded


def test_drop_before_and_after_forwarding(proxy: ApiProxy, client: httpx.Client, kube: Kube, namespace: str) -> None:
    path = CMS.format(ns=namespace)
    proxy.drop(method="POST", times=1)
    with pytest.raises(httpx.RemoteProtocolError):
        client.post(path, json=_cm("never"))
    rec = _last(proxy, "POST", "/configmaps")
    assert not rec.forwarded and rec.status is None and rec.error == "dropped"
    assert kube.get(f"{path}/never").status_code == 404

    proxy.drop(phase="response", method="POST", times=1)
    with pytest.raises(httpx.RemoteProtocolError):
        client.post(path, json=_cm("unanswered"))
    rec = _last(proxy, "POST", "/configmaps")
    assert rec.upstream_status == 201 and rec.status is None
    assert kube.get(f"{path}/unanswered").status_code == 200
    # The connection pool recovers: the next request is answered.
    assert client.get(f"{path}/unanswered").status_code == 200


def test_a_watch_stalls_and_resumes(proxy: ApiProxy, client: httpx.Client, kube: Kube, namespace: str) -> None:
    path = CMS.format(ns=namespace)
    rv = kube.ok(kube.get(path))["metadata"]["resourceVersion"]
    watch = WatchReader(proxy.kubeconfig, f"{path}?watch=true&resourceVersion={rv}")
    kube.ok(kube.post(path, _cm("first")))
    assert watch.next_event()["object"]["metadata"]["name"] == "first"

    proxy.hold_watches()
    kube.ok(kube.post(path, _cm("second")))
    # The proxy has the event in hand and does not pass it on.
    eventually(lambda: proxy.stalled["watch"] == 1, timeout=10, interval=0.02, what="a held watch chunk")
    assert watch.lines.empty() and watch.ended is None
    assert proxy.open_watches == 1
    # Unrelated requests still flow while watches stall.
    assert client.get(f"{path}/second").status_code == 200

    proxy.release_watches()
    assert watch.next_event()["object"]["metadata"]["name"] == "second"
    assert proxy.stalled["watch"] == 0

    # reset_watches: the stream drops mid-way, as when a connection breaks.
    assert proxy.reset_watches() == 1
    watch.join()
    assert isinstance(watch.ended, httpx.HTTPError), watch.ended
    assert _last(proxy, "GET", "/configmaps").error == "reset"


def test_gate_holds_a_request_until_released_then_it_reaches_the_api_server(
        proxy: ApiProxy, client: httpx.Client, kube: Kube, namespace: str) -> None:
    path = LEASES.format(ns=namespace)
    lease = kube.ok(kube.post(path, {"metadata": {"name": "l"}, "spec": {"holderIdentity": "a"}}))
    gate = proxy.gate(method="PUT", path=r"/leases/l$")
    stale = {**lease, "spec": {"holderIdentity": "b"}}
    call = Call(lambda: client.put(f"{path}/l", json=stale))
    (held,) = gate.wait_arrived(timeout=30)
    assert held.method == "PUT" and not held.forwarded and gate.held == 1
    # While the PUT waits at the gate, someone else writes the Lease.
    kube.ok(kube.put(f"{path}/l", {**lease, "spec": {"holderIdentity": "c"}}))
    assert not call.done
    gate.release()
    # The held PUT carried the old resourceVersion: the API server itself refuses it, after the release.
    resp = call.result()
    assert resp.status_code == 409 and resp.json()["reason"] == "Conflict"
    assert _last(proxy, "PUT", "/leases/l").upstream_status == 409
    assert kube.ok(kube.get(f"{path}/l"))["spec"]["holderIdentity"] == "c"
    assert gate.held == 0 and gate.hits == 1


def test_a_dropped_gate_never_forwards_what_it_held(proxy: ApiProxy, client: httpx.Client, kube: Kube,
                                                  namespace: str) -> None:
    path = LEASES.format(ns=namespace)
    lease = kube.ok(kube.post(path, {"metadata": {"name": "l"}, "spec": {"holderIdentity": "a"}}))
    gate = proxy.gate(method="PUT", path=r"/leases/l$")
    call = Call(lambda: client.put(f"{path}/l", json={**lease, "spec": {"holderIdentity": "b"}}))
    gate.wait_arrived(timeout=30)
    gate.drop()
    with pytest.raises(httpx.RemoteProtocolError):
        call.result()
    rec = _last(proxy, "PUT", "/leases/l")
    assert not rec.forwarded and rec.error == "dropped"
    assert kube.ok(kube.get(f"{path}/l"))["metadata"]["resourceVersion"] == lease["metadata"]["resourceVersion"]
    assert client.put(f"{path}/l", json={**lease, "spec": {"holderIdentity": "c"}}).status_code == 200  # gate gone


def test_named_clients_share_the_upstream_identity_and_the_audit_log_tells_them_apart(
        proxy: ApiProxy, kube: Kube, namespace: str, tmp_path: Path) -> None:
    """The operator's replicas: one identity upstream, yet the audit log says which process sent
    each request, and when it reached the proxy (a request a gate held is judged by that)."""
    audit = AuditLog.from_env(from_end=True)
    path = LEASES.format(ns=namespace)
    clients = {label: kubeconfig.load(proxy.write_kubeconfig(tmp_path / label, token=proxy.client_token(label)))
               for label in ("replica-0.1", "replica-1.1")}
    for label, cfg in clients.items():
        with cfg.sync_client() as c:
            assert c.post(path, json={"metadata": {"name": label}, "spec": {"holderIdentity": label}}).status_code == 201
    gate = proxy.gate(method="DELETE", path=r"/leases/replica-1\.1$")
    with clients["replica-1.1"].sync_client() as c:
        call = Call(lambda: c.delete(f"{path}/replica-1.1"))
        gate.wait_arrived(timeout=30)
        time.sleep(1.0)  # the hold is the fault: the request reaches the API server a second late
        gate.release()
        assert call.result().status_code == 200
    assert {r.client for r in proxy.requests() if r.path.startswith(path)} == set(clients)
    records = [audit.wait_for(lambda r, n=name, v=verb: r.about("leases", namespace, n) and r.verb == v,
                              what=f"{verb} of {name}")
               for name, verb in (("replica-0.1", "create"), ("replica-1.1", "create"), ("replica-1.1", "delete"))]
    assert all(r.user.username == records[0].user.username and r.accepted for r in records)
    stamps = [r.stamp for r in records]
    assert [s.client for s in stamps if s] == ["replica-0.1", "replica-1.1", "replica-1.1"]
    assert all(s is not None and s.sent <= r.received for s, r in zip(stamps, records))
    held = records[2]
    assert held.stamp is not None and (held.received - held.stamp.sent).total_seconds() >= 0.9
    assert kube.get(f"{path}/replica-0.1").status_code == 200 and records[0].user_agent.startswith("python-httpx")


def test_gate_on_the_response_hands_back_what_was_read_before(proxy: ApiProxy, client: httpx.Client, kube: Kube,
                                                              namespace: str) -> None:
    """The scenario the harness needs: a client awaits its Lease GET while another write lands."""
    path = LEASES.format(ns=namespace)
    lease = kube.ok(kube.post(path, {"metadata": {"name": "l"}, "spec": {"holderIdentity": "a"}}))
    gate = proxy.gate(method="GET", path=r"/leases/l$", phase="response")
    call = Call(lambda: client.get(f"{path}/l"))
    (held,) = gate.wait_arrived(timeout=30)
    assert held.forwarded and held.upstream_status == 200
    newer = kube.ok(kube.put(f"{path}/l", {**lease, "spec": {"holderIdentity": "c"}}))
    assert not call.done
    gate.release()
    seen = call.result().json()
    assert seen["spec"]["holderIdentity"] == "a"
    assert seen["metadata"]["resourceVersion"] == lease["metadata"]["resourceVersion"]
    assert newer["metadata"]["resourceVersion"] != seen["metadata"]["resourceVersion"]
    # The gate held one request (times=1 by default): the next GET passes and reads the new state.
    assert client.get(f"{path}/l").json()["spec"]["holderIdentity"] == "c"


def test_cut_holds_everything_until_healed(proxy: ApiProxy, client: httpx.Client, kube: Kube, namespace: str) -> None:
    path = CMS.format(ns=namespace)
    rv = kube.ok(kube.get(path))["metadata"]["resourceVersion"]
    watch = WatchReader(proxy.kubeconfig, f"{path}?watch=true&resourceVersion={rv}")
    eventually(lambda: proxy.open_watches == 1, timeout=10, interval=0.02, what="the watch open")
    proxy.cut()
    call = Call(lambda: client.post(path, json=_cm("in-flight")))
    kube.ok(kube.post(path, _cm("outside")))
    # Both the new request and the watch event wait at the cut.
    eventually(lambda: proxy.stalled["cut"] == 2, timeout=10, interval=0.02, what="a request and a chunk held")
    assert kube.get(f"{path}/in-flight").status_code == 404
    assert not call.done and watch.lines.empty()
    proxy.heal()
    assert call.result().status_code == 201
    assert kube.get(f"{path}/in-flight").status_code == 200
    names = [watch.next_event()["object"]["metadata"]["name"] for _ in range(2)]
    assert names == ["outside", "in-flight"]


def test_probability_is_drawn_from_the_seed(namespace: str) -> None:
    def pattern() -> list[int]:
        with ApiProxy(os.environ["TETHER_TEST_KUBECONFIG"], seed=5) as p:
            p.status(500, probability=0.5, path=r"/configmaps$")
            with kubeconfig.load(p.kubeconfig).sync_client() as c:
                return [c.get(CMS.format(ns=namespace)).status_code for _ in range(16)]

    first = pattern()
    assert set(first) == {200, 500}
    assert pattern() == first


def test_close_ends_streams_and_held_requests_and_leaves_no_thread(kube: Kube, namespace: str) -> None:
    p = ApiProxy(os.environ["TETHER_TEST_KUBECONFIG"])
    path = CMS.format(ns=namespace)
    with kubeconfig.load(p.kubeconfig).sync_client(timeout=60) as c:
        watch = WatchReader(p.kubeconfig, f"{path}?watch=true")
        eventually(lambda: p.open_watches == 1, timeout=10, interval=0.02, what="the watch open")
        gate = p.gate(method="POST")
        call = Call(lambda: c.post(path, json=_cm("held-at-close")))
        gate.wait_arrived()
        assert [t for t in threading.enumerate() if t.name == f"apiproxy:{p.port}"]
        began = time.monotonic()
        p.close()
        assert time.monotonic() - began < 10
        watch.join()
        with pytest.raises(httpx.HTTPError):
            call.result()
    # The held request never reached the API server, nothing listens any more, the thread is gone.
    assert kube.get(f"{path}/held-at-close").status_code == 404
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", p.port), timeout=2).close()
    assert not [t for t in threading.enumerate() if t.name == f"apiproxy:{p.port}"]
    assert not p.workdir.exists()


def test_the_operator_runs_through_the_proxy_and_relists_on_an_expired_watch(
        proxy: ApiProxy, namespace: str, tmp_path: Path) -> None:
    from testkit.operator_process import OperatorProcess

    def on_runs(r: RequestRecord) -> bool:
        return r.method == "GET" and r.path.endswith(f"/namespaces/{namespace}/workerruns")

    op = OperatorProcess(namespace, str(proxy.kubeconfig), tmp_path / "operator.log").start()
    try:
        # kopf (through the kubernetes client's kubeconfig loader) trusts the proxy and streams its watches.
        first = proxy.wait_for_request(lambda r: on_runs(r) and r.watch and r.status == 200, timeout=90)
        assert first.client == "proxy"
        # The next watch of WorkerRuns is told its resourceVersion expired; kopf must re-list, then watch.
        expired = proxy.status(410, watch=True, path=f"/namespaces/{namespace}/workerruns$", times=1)
        proxy.reset_watches()
        told = proxy.wait_for_request(lambda r: on_runs(r) and "status@request" in r.faults, timeout=60)
        again = proxy.wait_for_request(lambda r: on_runs(r) and r.id > told.id and r.watch and r.status == 200
                                       and r.finished is None, timeout=60)
        relist = [r for r in proxy.requests(on_runs) if told.id < r.id < again.id
                  and (not r.watch or "resourceVersion" not in r.params)]
        assert relist, [(r.id, r.query, r.status) for r in proxy.requests(on_runs)]
        assert expired.hits == 1 and op.proc is not None and op.proc.poll() is None
    finally:
        op.stop()
